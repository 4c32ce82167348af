"""The dry run (lesson 11): what each rank of a cluster this machine cannot run would hold
and send, answered by the trainer's own code rather than by formulas.

    python -m picolib.dry_run --preset llama3-70b --dp 20 --tp 8 --pp 4 --sp --zero 1 \\
        --micro-batches 16 --batch 320 --seq 8192 --precision bf16 --world 640 --gpu H100-SXM

For each pipeline position one representative rank — the one at dp = cp = tp = 0 — runs in a
process of its own as that rank of a `world`-rank group on PyTorch's `fake` process-group
backend (every collective returns at once and moves nothing). It builds the model on the
`meta` device (shapes and dtypes, no data) and applies `compose.build` — the transforms,
DDP or ZeRO and the schedule the real run builds — then runs one step (forward, backward,
optimizer) with the comm Ledger and `memory.SavedActivations` open, as `train.train` does
(its `_step`; without a pipeline, the same loop without the loss's `.item()`). Bytes come from the same counters a real run reads: the wrappers'
`memory()` (ZeRO) or the stages' parameters, gradients and AdamW state (DDP), the peak of
saved activations, and the ledger's bytes sent, classified by `train._sent_by_kind`.

What meta tensors cannot do, the dry run does not do, and says so:
- no values: the weights are not drawn, the wrappers' NaN/inf check after the gradient sync
  is skipped (it reads a value; its all-reduce, where DDP makes one, is still sent), and so
  is the loss (`None` in the report);
- storage identity: picolib counts each storage once by its address; a meta storage has
  none (address 0), so inside the dry run a meta tensor's storage is told apart by the
  storage object itself — what a real run's address stands for;
- kernels: on meta, PyTorch's fused attention takes its math path (which saves the s×s
  probabilities); the dry run calls the flash kernel that a CPU or GPU run takes. Meta
  add/sub/mul get a shape rule in place of PyTorch's Python one (same shapes, 5× faster);
- routing (an ASSUMPTION, the one number the dry run does not get from the code): a mixture
  of experts sends each expert the tokens the router chose, which meta tensors do not have.
  The dry run runs the router, the experts, the all-to-alls and the balancing loss as a real
  run does, with a *balanced* routing: each expert receives tokens·top_k/n_experts of a
  rank's tokens (`balanced_counts`; the first experts one more when it does not divide). Its
  bytes are then the planner's even-routing figures; a real router's imbalance adds to the
  all-to-alls and to the busiest expert's activations. The report says so (`assumptions`).
  Dropping tokens past a capacity depends on the values too: refused (`NotImplementedError`).
`fits` compares tensors only (state and saved activations) with the GPU's memory: no CUDA
context, communication buffers, transient workspace or allocator reserve.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import asdict, replace

import torch

from .compose import TrainConfig, check_config
from .parallel_layout import layout_of

__all__ = ["LARGE_PRESETS", "representatives", "dry_run", "refuse", "assumptions",
           "balanced_counts", "rank_report", "main"]

# Model shapes of published models, for the dry run (and later the trainer on GPUs). They
# take fused attention (`sdpa`): nobody trains at 8k tokens with s×s score matrices saved.
LARGE_PRESETS = {
    "llama3-8b": dict(vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_hidden=14336, rope_theta=500000.0, attn_impl="sdpa"),
    "llama3-70b": dict(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_hidden=28672, rope_theta=500000.0, attn_impl="sdpa"),
    "llama3-405b": dict(vocab_size=128256, hidden=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_hidden=53248, rope_theta=500000.0, attn_impl="sdpa"),
    # DeepSeek-V3's sizes on picolib's blocks (GQA instead of MLA; every layer a mixture of
    # --experts of this ffn size; no shared expert): use with --experts 256 --top-k 8
    "deepseek-v3-like": dict(vocab_size=129280, hidden=7168, n_layers=61, n_heads=128,
                             n_kv_heads=128, ffn_hidden=2048, attn_impl="sdpa"),
}
KINDS = ("dp", "tp", "pp", "cp", "ep")


@contextlib.contextmanager
def _with_presets():
    """compose.MODEL_PRESETS with the large ones added while it is open (the real trainer never
    sees them: it refuses them as unknown presets)."""
    from . import compose
    added = [n for n in LARGE_PRESETS if n not in compose.MODEL_PRESETS]
    compose.MODEL_PRESETS.update({n: LARGE_PRESETS[n] for n in added})
    try:
        yield
    finally:
        for n in added:
            compose.MODEL_PRESETS.pop(n, None)


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
    with _with_presets():
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

def _meta_storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return ("meta", s._cdata) if t.is_meta else s.data_ptr() or ("empty", id(t))


class _MetaFlash(torch.autograd.Function):
    """Flash attention's shapes and saved tensors on meta: the output, and q, k, v (K/V heads
    not repeated: grouped-query flash kernels read them as they are), the output and one
    log-sum-exp per row of each head — what a GPU's kernel keeps for backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        # contiguous (b, heads, s, d), so the output projection's input is a copy of it, as
        # the planner counts. empty_like(q) took q's layout, which the meta kernels set
        # differently by release: under torch 2.6 q stayed transposed, the copy became a view
        # and the dry run counted about 4 % less than under 2.13 (measured; 2.11's 6 % less
        # looks the same). A flash kernel's own output is laid out (b, s, heads, d), which
        # would make it a view too: one s·b·h tensor a layer fewer than counted here.
        out = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _patch_for_meta():
    """Where picolib reads what a meta tensor lacks, and what meta runs differently
    (module docstring); only ever called in a dry run's own rank process."""
    from . import data_parallel, flat, memory, sharded_optim, zero
    flat.storage_key = sharded_optim.storage_key = _meta_storage_key
    memory._key = lambda t: (t.device, _meta_storage_key(t))
    skip = lambda *a, **k: None          # noqa: E731 — no values: nothing to check
    zero.check_finite = data_parallel.check_finite = skip
    from . import model, moe                 # nor to draw (meta randn: ~2 ms a tensor)
    for cls in (model.TinyLlama, moe.MoE, torch.nn.Linear):
        init = cls.reset_parameters
        cls.reset_parameters = lambda self, *seed, init=init: (
            None if next(self.parameters()).is_meta else init(self, *seed))
    finite = flat.is_finite                 # DDP with expert groups all-reduces the verdict
    zero.is_finite = data_parallel.is_finite = \
        lambda t: torch.tensor(True) if t.is_meta else finite(t)   # (sent) and reads it
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if q.is_meta and attn_mask is None and set(kw) <= {"enable_gqa", "scale"}:
            return _MetaFlash.apply(q, k, v)   # meta has no kernel choice: the flash one's bytes
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
    torch.nn.functional.scaled_dot_product_attention = fused
    if not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::broadcast_", "Meta"):
        _skip_meta_messages()
    global _LIB      # PyTorch's meta add/sub/mul are Python (~0.5 ms a call): a shape rule
    _LIB = torch.library.Library("aten", "IMPL")
    for op in ("add.Tensor", "sub.Tensor", "mul.Tensor"):
        try:
            _LIB.impl(op, _broadcast, "Meta")
        except RuntimeError:   # torch 2.11 keeps its own Python meta kernel: slower, same shapes
            pass


class _Done:
    def wait(self, *args):
        return True

    def is_completed(self):
        return True


def _skip_meta_messages():
    """Where the c10d ops have no meta kernels (torch 2.6 has none: broadcast, send, recv,
    all-gather...; 2.13 and 2.15 have them), a collective on meta tensors raises even on the
    fake backend. The fake group would move nothing anyway, so the dry run skips those calls;
    the comm ledger has counted their bytes before calling."""
    import torch.distributed as dist

    def skipping(call):
        def wrapped(tensor, *args, **kwargs):
            return _Done() if tensor.is_meta else call(tensor, *args, **kwargs)
        return wrapped
    from torch.distributed import distributed_c10d
    for name in ("broadcast", "send", "recv", "isend", "irecv", "all_reduce",
                 "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        setattr(dist, name, skipping(getattr(dist, name)))
    for name in ("isend", "irecv"):       # a P2POp accepts only the functions c10d itself holds
        setattr(distributed_c10d, name, getattr(dist, name))
    batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        if ops and all(op.tensor.is_meta for op in ops):
            return [_Done() for _ in ops]
        return batch(ops)
    dist.batch_isend_irecv = batch_isend_irecv


def balanced_counts(assignments: int, n_experts: int) -> list[int]:
    """The dry run's routing assumption: each expert receives assignments/n_experts of the
    (token, choice) assignments — tokens·top_k/n_experts — the first `assignments mod
    n_experts` experts one more when it does not divide."""
    base, extra = divmod(assignments, n_experts)
    return [base + (e < extra) for e in range(n_experts)]


def _patch_moe_for_meta():
    """Balanced routing in place of the router's choices (module docstring): which expert
    each token goes to is a value, which meta tensors do not have. The router, the experts,
    the dispatch and combine all-to-alls (with their real split sizes under the assumption)
    and the balancing loss's collectives run as in a real run; only who-goes-where is
    assumed. A capacity (dropping tokens) depends on the values too: refused."""
    from . import expert_parallel, moe
    keep_mask, sort, exchange, bincount = (moe.keep_mask, moe.sort_by_expert,
                                           expert_parallel.exchange_counts, torch.bincount)
    regroup = expert_parallel.group_by_local_expert

    def meta_keep(choice, n_experts, cap):
        if not choice.is_meta:
            return keep_mask(choice, n_experts, cap)
        if cap is not None:
            raise NotImplementedError("the dry run cannot drop tokens past an expert's capacity: "
                                      "which ones overflow depends on the router's values")
        return torch.ones(choice.shape, dtype=torch.bool)   # dropless: every assignment kept

    def meta_sort(choice, keep, n_experts):
        if not choice.is_meta:
            return sort(choice, keep, n_experts)
        # expert order of the T·k assignments (stable: the kept ones, in order), and their counts
        return (torch.arange(choice.numel(), device=choice.device),
                torch.tensor(balanced_counts(choice.numel(), n_experts)))

    def meta_exchange(counts, group=None):
        out = exchange(counts, group)          # the real all-to-all of the counts (the ledger's)
        ep, r = out.shape[0], torch.distributed.get_rank(group)
        # the fake backend moved nothing: under balanced routing every rank of the group
        # sends this rank's experts what this rank's own counts say
        return out.copy_(counts.view(ep, -1)[r].expand(ep, -1))

    def meta_bincount(x, weights=None, minlength=0):
        if x.is_meta and weights is None and minlength:
            return torch.empty(minlength, dtype=torch.long, device=x.device)
        return bincount(x, weights, minlength)

    def meta_regroup(recv_counts):   # the permutation lives where the rows do (the device)
        return regroup(recv_counts).to("meta")

    moe.keep_mask, moe.sort_by_expert = meta_keep, meta_sort
    expert_parallel.group_by_local_expert = meta_regroup
    expert_parallel.sort_by_expert, expert_parallel.exchange_counts = meta_sort, meta_exchange
    torch.bincount = meta_bincount


def _broadcast(a, b, *_, **__):
    shape = torch.broadcast_shapes(tuple(a.shape), tuple(getattr(b, "shape", ())))
    return torch.empty(shape, dtype=torch.result_type(a, b), device="meta")


def rank_report(cfg: dict | TrainConfig, world: int, rank: int) -> dict:
    """Run in a fresh process: be `rank` of `world` on the fake backend and dry-run one step."""
    import resource

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import compose, train
    from .comm import Ledger
    from .memory import SavedActivations
    from .mesh import Mesh
    compose.MODEL_PRESETS.update(LARGE_PRESETS)   # this process is the dry run's own rank
    cfg = cfg if isinstance(cfg, TrainConfig) else TrainConfig(**cfg)
    check_config(cfg, world)
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fake,meta:fake", rank=rank, world_size=world, store=FakeStore())
    refuse(cfg)
    _patch_for_meta()
    if cfg.experts:
        _patch_moe_for_meta()
    meta = torch.device("meta")
    mesh = Mesh("cpu", device=meta, **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    with meta:
        stages, wrappers, optimizers, sched, replicas = compose.build(cfg, mesh)
    for m in stages.values():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if not t.is_meta:
                raise RuntimeError(f"{name} was allocated on {t.device}: the dry run allocates nothing")
    tokens, targets = [], []
    for out in (tokens, targets):    # the rank's own rows and positions, one tensor per
        # micro-batch (train._batch)
        out.extend(torch.empty(cfg.batch // cfg.dp // cfg.micro_batches, cfg.seq // cfg.cp,
                               dtype=torch.long, device=meta) for _ in range(cfg.micro_batches))
    held = lambda: sum(w.memory()["grads"] for w in wrappers.values())  # noqa: E731
    grads_peak = [0]                 # gradients held before each backward (accumulated ones)
    for w in wrappers.values():      # the pipeline executor sets it before each backward
        def sampled(on, sync=w.set_requires_gradient_sync):
            grads_peak.append(held())
            return sync(on)
        w.set_requires_gradient_sync = sampled
    with Ledger() as led, SavedActivations() as act:
        if sched is not None:
            train._step(cfg, stages, wrappers, sched, mesh, tokens, targets, None)
        else:                        # train._step without its loss.item()
            model, wrapper = stages[0], wrappers[0]
            for i, (x, y) in enumerate(zip(tokens, targets)):
                last = i == len(tokens) - 1
                grads_peak.append(held())
                with contextlib.nullcontext() if last else wrapper.no_sync():
                    (model.loss(x, y) / len(tokens)).backward()
        for opt in optimizers:
            opt.step()
    state = {k: sum(w.memory()[k] for w in wrappers.values()) for k in ("params", "grads", "optimizer")}
    by_kind = train._sent_by_kind(led, mesh, replicas, {})
    sent = {k: by_kind.get(k.upper(), 0) for k in KINDS}
    return {"rank": rank, "pp_rank": mesh.coordinate("pp"), **state,
            "grads_peak": max(grads_peak + [state["grads"]]), "activations": act.peak, "sent": sent, "other": by_kind.get("other", 0),
            "by_op": {op: s["sent_bytes"] for op, s in led.summary().items()},
            "stages": sorted(stages), "layout": asdict(layout_of(cfg)), "loss": None,
            "assumptions": assumptions(cfg),
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# --------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    """The trainer's options (`picolib.train`) plus --world, --gpu and --json."""
    from .train import build_parser as trainer
    p = trainer()
    p.prog = "python -m picolib.dry_run"
    for action in p._actions:          # the trainer's --preset choices, plus the large presets
        if action.dest == "preset" and action.choices is not None:
            action.choices = [*action.choices, *LARGE_PRESETS]
    p.description = ("Dry-run one training step of any layout on meta tensors over a fake process "
                     "group of --world ranks: per pipeline position, the bytes a rank holds and "
                     "sends. Presets also " + ", ".join(LARGE_PRESETS) + ".")
    p.add_argument("--world", type=int, default=None, help="world size (default: the product of the degrees)")
    p.add_argument("--gpu", default=None, help="check the fit against this GPU (picolib.hardware: H100-SXM, ...)")
    p.add_argument("--json", default=None, help="write the reports to this file (a list, one object per rank)")
    return p


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    world, gpu, out = args.pop("world"), args.pop("gpu"), args.pop("json")
    args.pop("nproc"), args.pop("backend"), args.pop("dry_run", None)
    from .train import config_from_args
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
