"""The dry run (lesson 11): what each rank of a cluster this machine cannot run would hold
and send, answered by the trainer's own code rather than by formulas.

    python -m picolib.dry_run --preset llama3-70b --dp 20 --tp 8 --pp 4 --sp --zero 1 \\
        --micro-batches 16 --batch 320 --seq 8192 --precision bf16 --world 640 --gpu H100-SXM

For each pipeline position one representative rank — the one at dp = cp = tp = 0 — runs in a
process of its own as that rank of a `world`-rank group on PyTorch's `fake` process-group
backend (every collective returns at once and moves nothing). It builds the model on the
`meta` device (shapes and dtypes, no data) and applies `compose.build` — the transforms,
DDP or ZeRO and the schedule the real run builds — then runs one step (forward, backward,
optimizer) with the comm Ledger and `memory.SavedActivations` open, through the trainer's own
step (`step.forward_backward`). Bytes come from the same counters a real run reads: the
wrappers' `memory()`, the peak of saved activations, and the ledger's bytes sent, classified
by `step.sent_by_kind`. Nothing is patched: the meta device is the mode, chosen by the
caller (`Mesh(device="meta")`), and each place in picolib that reads what a meta tensor
lacks says in place what it does there (`picolib.meta` lists them).

What meta tensors cannot do, the dry run does not do, and says so:
- no values: the weights are not drawn, the wrappers' NaN/inf check after the gradient sync
  finds nothing (`flat.is_finite`; its all-reduce, where DDP makes one, is still sent), and
  the loss is not read (`None` in the report); no collective moves anything (`comm`);
- storage identity: picolib counts each storage once by its address; a meta storage has
  none (address 0), so a meta tensor's storage is told apart by the storage object itself
  (`memory.storage_key`) — what a real run's address stands for;
- kernels: on meta, PyTorch's fused attention takes its math path (which saves the s×s
  probabilities); picolib's attention calls the flash kernel's shapes that a CPU or GPU run
  takes (`meta.flash_attention`). Meta add/sub/mul get a shape rule in place of PyTorch's
  Python one while a dry run's rank builds and steps (`meta.fast_arithmetic`: same shapes,
  5× faster; a torch.library registration undone when that block ends);
- routing (an ASSUMPTION, the one number the dry run does not get from the code): a mixture
  of experts sends each expert the tokens the router chose, which meta tensors do not have.
  The dry run runs the router, the experts, the all-to-alls and the balancing loss as a real
  run does, with a *balanced* routing: each expert receives tokens·top_k/n_experts of a
  rank's tokens (`moe.balanced_counts`; the first experts one more when it does not divide). Its
  bytes are then the planner's even-routing figures; a real router's imbalance adds to the
  all-to-alls and to the busiest expert's activations. The report says so (`assumptions`).
  Dropping tokens past a capacity depends on the values too: refused (`NotImplementedError`).
`fits` compares tensors only (state and saved activations) with the GPU's memory: no CUDA
context, communication buffers, transient workspace or allocator reserve.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import torch

from .cli import build_parser as trainer_parser, config_from_args
from .compose import TrainConfig, check_config
from .parallel_layout import layout_of

__all__ = ["KINDS", "representatives", "dry_run", "refuse", "assumptions", "rank_report", "main"]

KINDS = ("dp", "tp", "pp", "cp", "ep")


def representatives(cfg: TrainConfig) -> list[int]:
    """The rank at dp = cp = tp = 0 of each pipeline position."""
    from .parallel_layout import rank_at
    return [rank_at(cfg, pp=p, dp=0, cp=0, tp=0) for p in range(cfg.pp)]


def dry_run(cfg: TrainConfig, world: int, gpu: str | None = None,
            ranks: list[int] | None = None, timeout: float = 300.0) -> list[dict]:
    """One report per pipeline position (its rank at dp = cp = tp = 0, or `ranks`), each
    computed in its own process on the fake backend: {rank, pp_rank, params, grads,
    optimizer (held after the step, as the trainer logs them), grads_peak (the most held
    before a backward: ZeRO-2/3 keep whole gradients while micro-batches accumulate),
    activations (peak saved), sent {dp, tp, pp, cp, ep: bytes this step}, other, by_op,
    fits (params + grads_peak + optimizer + activations within `gpu`; None without), gpu_bytes}."""
    check_config(cfg, world)
    refuse(cfg)
    ranks = representatives(cfg) if ranks is None else ranks
    from . import dry_run as this   # by reference (under `python -m` this file is __main__)
    from .launch import run
    reports = run(this._worker, len(ranks), asdict(cfg), world, ranks, backend="gloo", timeout=timeout)
    if gpu is not None:
        from .hardware import hardware
        capacity = int(hardware(gpu).memory)
        for rep in reports:
            rep["gpu_bytes"] = capacity
            rep["fits"] = rep["params"] + rep["grads_peak"] + rep["optimizer"] + rep["activations"] <= capacity
    else:
        for rep in reports:
            rep["gpu_bytes"], rep["fits"] = None, None
    return reports


def _worker(cfg: dict, world: int, ranks: list[int]) -> dict:
    """A launch.run rank (a fresh fork): leave its gloo group, become ranks[i] of `world`."""
    import torch.distributed as dist
    i = dist.get_rank()
    dist.barrier()      # every rank connected before any leaves (gloo's mesh setup)
    dist.destroy_process_group()
    return rank_report(cfg, world, ranks[i])


def assumptions(cfg: TrainConfig) -> list[str]:
    """What a report rests on besides the code (module docstring)."""
    if not cfg.experts:
        return []
    return [f"balanced routing: each of the {cfg.experts} experts receives tokens × "
            f"{cfg.top_k}/{cfg.experts} of a rank's tokens (a real router's imbalance sends more)"]


def refuse(cfg: TrainConfig) -> None:
    """What the dry run cannot compute (module docstring), refused before anything starts.
    A mixture of experts runs under the balanced routing assumption, and the trainer's MoE is
    dropless (capacity drops, which depend on values, are refused inside the rank if a model
    has them)."""
    if cfg.pp > 1 and cfg.schedule == "dualpipe":
        raise NotImplementedError(
            "the dry run cannot run --schedule dualpipe: its pairs' gradients are reduced over "
            "a group of their own (as experts'), and the check that every rank agrees they are "
            "finite reads a value, which meta tensors do not have")


# --------------------------------------------------------------------------- one rank

def rank_report(cfg: dict | TrainConfig, world: int, rank: int) -> dict:
    """Run in a fresh process: be `rank` of `world` on the fake backend and dry-run one step."""
    import resource

    import torch.distributed as dist
    from .mesh import Mesh
    from .meta import fast_arithmetic
    from .step import sent_by_kind
    from .torch_compat import fake_store
    cfg = cfg if isinstance(cfg, TrainConfig) else TrainConfig(**cfg)
    check_config(cfg, world)
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fake,meta:fake", rank=rank, world_size=world, store=fake_store())
    refuse(cfg)
    mesh = Mesh("cpu", device=torch.device("meta"), **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    with fast_arithmetic():
        stages, wrappers, led, act, grads_peak = _one_step(cfg, mesh)
    state = {k: sum(w.memory()[k] for w in wrappers.values()) for k in ("params", "grads", "optimizer")}
    by_kind = sent_by_kind(led, mesh)
    sent = {k: by_kind.get(k.upper(), 0) for k in KINDS}
    return {"rank": rank, "pp_rank": mesh.coordinate("pp"), **state,
            "grads_peak": max(grads_peak + [state["grads"]]), "activations": act.peak, "sent": sent, "other": by_kind.get("other", 0),
            "by_op": {op: s["sent_bytes"] for op, s in led.summary().items()},
            "stages": sorted(stages), "layout": asdict(layout_of(cfg)), "loss": None,
            "assumptions": assumptions(cfg),
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _one_step(cfg: TrainConfig, mesh):
    """Build the rank's stages on meta and run one step (forward, backward, optimizer) with the
    ledger and saved activations open; the gradients held are sampled before each backward
    through the wrappers' sync hook (`register_sync_hook`: the loop or the pipeline executor
    sets the sync switch before each backward)."""
    from .comm import Ledger
    from .compose import build
    from .memory import SavedActivations
    from .step import forward_backward
    meta = mesh.device
    with meta:
        stages, wrappers, optimizers, sched, _ = build(cfg, mesh)
    for m in stages.values():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if not t.is_meta:
                raise RuntimeError(f"{name} was allocated on {t.device}: the dry run allocates nothing")
    tokens, targets = [], []
    for out in (tokens, targets):    # the rank's own rows and positions, one tensor per
        # micro-batch (train._batch)
        out.extend(torch.empty(cfg.batch // cfg.dp // cfg.micro_batches, cfg.seq // cfg.cp,
                               dtype=torch.long, device=meta) for _ in range(cfg.micro_batches))
    grads_peak = [0]                 # gradients held before each backward (accumulated ones)

    def sample(*_):
        grads_peak.append(sum(w.memory()["grads"] for w in wrappers.values()))

    hooks = [w.register_sync_hook(sample) for w in wrappers.values()]
    with Ledger() as led, SavedActivations() as act:
        forward_backward(cfg, stages, wrappers, sched, mesh, tokens, targets)
        for opt in optimizers:
            opt.step()
    for hook in hooks:
        hook.remove()
    return stages, wrappers, led, act, grads_peak


# --------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    """The trainer's options (`picolib.cli`) plus --world, --gpu and --json."""
    p = trainer_parser()
    p.prog = "python -m picolib.dry_run"
    p.description = ("Dry-run one training step of any layout on meta tensors over a fake process "
                     "group of --world ranks: per pipeline position, the bytes a rank holds and "
                     "sends.")
    p.add_argument("--world", type=int, default=None, help="world size (default: the product of the degrees)")
    p.add_argument("--gpu", default=None, help="check the fit against this GPU (picolib.hardware: H100-SXM, ...)")
    p.add_argument("--json", default=None, help="write the reports to this file (a list, one object per rank)")
    return p


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    world, gpu, out = args.pop("world"), args.pop("gpu"), args.pop("json")
    args.pop("nproc"), args.pop("backend"), args.pop("dry_run", None)
    cfg = replace(config_from_args(parser, argv, args), progress=False)   # args or --plan FILE
    try:
        if gpu is not None:
            from .hardware import hardware
            hardware(gpu)
        reports = dry_run(cfg, cfg.world_size if world is None else world, gpu)
    except (ValueError, KeyError, NotImplementedError) as e:   # bad input: one line, exit 2
        parser.error(str(e).strip("'\""))
    if out:
        with open(out, "w") as f:
            json.dump(reports, f, indent=1)
    for line in assumptions(cfg):
        print("assumed:", line)
    gb = lambda b: f"{b / 1e9:9.2f}"  # noqa: E731
    print(f"{'rank':>6} {'pp':>3} {'params':>9} {'grads':>9} {'optim':>9} {'activ':>9} "
          + " ".join(f"{'sent ' + k:>9}" for k in KINDS) + "  GB" + ("  fits " + gpu if gpu else ""))
    for r in reports:
        print(f"{r['rank']:>6} {r['pp_rank']:>3} " + " ".join(gb(r[k]) for k in ("params", "grads", "optimizer", "activations"))
              + " " + " ".join(gb(r["sent"][k]) for k in KINDS) + ("  " + str(r["fits"]) if gpu else ""))
    return reports


if __name__ == "__main__":
    main()
