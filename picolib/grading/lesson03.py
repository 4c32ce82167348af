"""Checks for lesson 03 (ZeRO).

- `check_shard_bounds(fn)`: `fn(numel, n, rank)` → (start, stop) of rank's shard of a flat
  buffer padded to a multiple of n (each shard ⌈numel/n⌉ elements).
- `check_zero_memory(fn)`: `fn(stage, psi, n, k)` → {"params", "grads", "optimizer"} bytes
  per rank with bf16 parameters and gradients (2 + 2) and k optimizer bytes per
  parameter; stage 0 is plain DP; stages 1-3 pad Ψ to a multiple of n.
- `check_zero1_step(fn)`: `fn(param, grad, lr, group=None)` → the new full parameter
  vector after one ZeRO-1 SGD step: reduce-scatter (mean) the gradient, update this rank's
  shard, all-gather — through picolib.comm, on 2 and 3 ranks, with a size that does not
  divide by either.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..zero import padded_numel, shard_bounds, zero_memory_bytes
from ._core import call_student, compare, report, run_student

__all__ = ["check_shard_bounds", "check_zero_memory", "check_zero1_step"]



def check_shard_bounds(fn) -> None:
    """Every rank's [start, stop) for sizes that divide by n and sizes that do not."""
    cases = [(10, 4), (12, 4), (4, 2), (1, 8), (7, 1), (2214, 4), (1000, 3), (5, 8)]
    problems, count = [], 0
    for numel, n in cases:
        got = [call_student(fn, numel, n, r) for r in range(n)]
        got = [tuple(g) if isinstance(g, (list, tuple)) else g for g in got]
        want = [shard_bounds(numel, n, r) for r in range(n)]
        problems += compare(f"numel={numel}, n={n}", got, want)
        count += 1
    report("shard bounds with padding", problems, count)


def check_zero_memory(fn) -> None:
    """DP and the three stages, against the formula, padding included."""
    cases = [(s, 7_500_000_000, 64, 12) for s in range(4)]               # the ZeRO paper's model
    cases += [(s, 10, 4, 12) for s in range(4)] + [(s, 6498, 8, 12) for s in range(4)]
    cases += [(s, 1000, 1, 12) for s in range(4)] + [(2, 99, 2, 8), (3, 3, 8, 4)]
    problems = []
    for stage, psi, n, k in cases:
        got = call_student(fn, stage, psi, n, k)
        if isinstance(got, dict):
            got = {key: int(v) for key, v in got.items()}
        problems += compare(f"stage={stage}, Ψ={psi}, N={n}, k={k}", got,
                            zero_memory_bytes(stage, psi, n, k, param_bytes=2))
    report("ZeRO memory per rank", problems, len(cases))


def _zero1_worker(fn, numel, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    param = torch.randn(numel, generator=g)
    grads = torch.randn(n, numel, generator=g)
    with Ledger() as ledger:
        out = fn(param.clone(), grads[rank].clone(), lr)
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, ledger.summary(), param - lr * grads.mean(0)


def check_zero1_step(fn) -> None:
    """Values equal to one SGD step on the mean gradient, the same on every rank, and the
    traffic of a reduce-scatter plus an all-gather of the padded buffer (no all-reduce)."""
    problems, count = [], 0
    for n, numel in [(2, 11), (3, 11), (3, 12)]:
        ranks = run_student(_zero1_worker, n, fn, numel, 0.1, name="zero1_step")
        for rank, (out, led, want) in enumerate(ranks):
            count += 1
            where = f"N={n}, {numel} elements, rank {rank}"
            problems += compare(f"{where}: new parameters", out, want, atol=1e-6)
            if "all_reduce" in led:
                problems.append(f"{where}: used all_reduce — ZeRO-1 reduce-scatters instead")
            ring = (n - 1) * padded_numel(numel, n) * 4 // n
            for op in ("reduce_scatter", "all_gather"):
                sent = led.get(op, {}).get("sent_bytes", 0)
                if sent != ring:
                    problems.append(f"{where}: {op} sent {sent} bytes; one {op} of the padded "
                                    f"buffer ({padded_numel(numel, n)} fp32) sends {ring}")
    report("ZeRO-1 step", problems, count)
