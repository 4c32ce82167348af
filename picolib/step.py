"""One training step on one rank (lesson 10): the forward and backward the trainer
(`picolib.train`) runs and the dry run (`picolib.dry_run`) runs on meta tensors, and the
bytes the step sent, sorted by the parallelism they belong to (DP, TP, PP, CP, EP).

A module below both, so that the dry run runs the trainer's own step without importing the
trainer.
"""
from __future__ import annotations

import contextlib

import torch

from .comm import Ledger
from .mesh import Mesh
from .pipeline_parallel import run_schedule

__all__ = ["forward_backward", "traffic_kind", "sent_by_kind"]


def forward_backward(cfg, stages, wrappers, sched, mesh: Mesh, tokens, targets, timeline=None):
    """Forward and backward of one step over this rank's `stages` {index: module} and their
    data-parallel `wrappers`; returns this rank's loss (None off the last stage), a device
    tensor. `--precision bf16`, one recipe on every layout: DDP and ZeRO compute on bf16
    copies of fp32 masters (`param_dtype`), so no weight is recast per forward; autocast stays
    around forward and loss as the guard of the ops it keeps in fp32 (on CUDA pow, rsqrt and
    softmax: RMSNorm and eager attention). Without a pipeline the
    micro-batches accumulate under the wrapper's `no_sync`, the last one synchronises."""
    with torch.autocast(mesh.device_mesh.device_type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        if sched is not None:
            loss = run_schedule(sched, stages, tokens, targets, timeline=timeline,
                                group_ranks=mesh.peers("pp"), data_parallel=wrappers)["loss"]
            # DualPipe: each end holds its half of the micro-batches' mean; times 2, its own mean
            return loss if loss is None else loss * len(sched.pipes)
        model, wrapper = stages[0], wrappers[0]
        loss = None
        for i, (x, y) in enumerate(zip(tokens, targets)):
            last = i == len(tokens) - 1
            with contextlib.nullcontext() if last else wrapper.no_sync(), \
                    (timeline.span("FB", mb=i) if timeline else contextlib.nullcontext()):
                micro = model.loss(x, y) / len(tokens)
                micro.backward()
            loss = micro.detach() if loss is None else loss + micro.detach()   # summed on the device
        return loss


def traffic_kind(op: str, dims: tuple[str, ...], replicas: bool = False) -> str:
    """Which parallelism a collective belongs to, from the mesh dimensions its ranks span;
    `replicas`: its group is the one gradients are averaged over (dp, or dp × cp) — DP.
    Inside dp, all-to-alls are EP's and the rest the experts' gradients (DP)."""
    if replicas:
        return "DP"
    if dims == ("dp",):
        return "EP" if op == "all_to_all" else "DP"
    return dims[0].upper() if len(dims) == 1 else "other"


def sent_by_kind(ledger: Ledger, mesh: Mesh, known: dict | None = None) -> dict[str, int]:
    """{kind: bytes this rank sent} over the ledger's records: DP, TP, PP, CP, EP or "other".
    The data-parallel wrappers tag their collectives (`comm.tagged(purpose="gradients")`):
    ranks alone cannot tell them — with dp = 1 the replicas are the cp ranks (whose all-gather
    of K/V is CP's), and an expert's replicas (edp) can be the cp ranks exactly. `known`: a
    cache {(op, ranks, purpose): kind} kept from step to step."""
    known = {} if known is None else known
    out: dict[str, int] = {}
    for r in ledger.records:
        key = (r.op, r.ranks, r.meta.get("purpose"))
        if key not in known:
            known[key] = traffic_kind(r.op, mesh.spanned(r.ranks), r.meta.get("purpose") == "gradients")
        out[known[key]] = out.get(known[key], 0) + r.sent_bytes
    return out
