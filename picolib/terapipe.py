"""TeraPipe: token-level pipeline parallelism (Li et al., ICML 2021; lesson 08).

With one sequence per step a micro-batch pipeline has nothing to fill its stages with:
stage k waits for stages 0..k−1, the bubble is (p − 1)/1. TeraPipe cuts the *sequence*
into slices l₁…l_M that flow through the stages one after another, like micro-batches:

    plan = TeraPipePlan(slices=(96, 64, 48, 48), n_stages=4, n_layers=8)   # checked here
    stage = terapipe_stage(TinyLlama(cfg), plan, rank)                     # on every rank
    out = run_terapipe(plan, stage, tokens, targets, timeline=tl)

The core opens the file (lesson 08 shows it): `CachedAttentionCore`, `forward_slice`,
`backward_slice` and the loop of `run_terapipe`; the plan, the cache and the messages follow.
A token attends to every token before it, so a stage keeps the keys and values of the
slices it has already run (`SliceKVCache`): slice i's attention core (`CachedAttentionCore`)
attends to [cached K/V of slices < i, its own K/V]. Layer j at token t needs layer j − 1 at
*all* tokens ≤ t, which the cache holds. The cached K/V enter slice i's graph as leaves;
their gradients collect there while later slices run backward, and are handed to the slice
that produced them when its own backward runs: backward goes in reverse slice order, so
when slice i's turn comes every later slice has added its share. The schedule is GPipe's
over the slices (all forwards, then all backwards in reverse); with n_micro micro-batches
each one is sliced the same way and has its own cache. One slice and m micro-batches is
plain GPipe. Which slicing is fastest is `picolib.terapipe_slicer`'s question.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .model import AttentionCore, TinyLlama, attention_core, repeat_kv
from .pipeline_parallel import split_stages
from .pipeline_schedules import Op, Schedule
from .pipeline_simulator import simulate, validate
from .terapipe_slicer import check_slices

__all__ = ["CachedAttentionCore", "forward_slice", "backward_slice", "run_terapipe", "TeraPipePlan",
           "SliceKVCache", "use_kv_cache", "terapipe_stage", "emulated_costs", "plan_costs", "simulate_plan",
           "measure_costs", "FORWARD_SHARE"]

FORWARD_SHARE = 1 / 3     # emulated costs: forward ⅓ of t(l, c), backward ⅔ (backward ≈ 2× forward)


# --------------------------------------------------------------------------- the core

class CachedAttentionCore(nn.Module):
    """A TeraPipe stage's attention core: a slice's queries attend to the K/V its sequence's
    `cache` holds (the earlier slices) and to its own, causally; `forward_slice` sets `cache`."""

    def __init__(self, impl: str = "eager"):
        super().__init__()
        self.impl, self.cache = impl, None

    def forward(self, q, k, v):
        if self.cache is None:
            raise RuntimeError("CachedAttentionCore needs a SliceKVCache: run it through run_terapipe")
        past_k, past_v = self.cache.past(self)               # K/V of slices 0 … j−1
        keys = torch.cat([*past_k, k], dim=2) if past_k else k
        values = torch.cat([*past_v, v], dim=2) if past_v else v
        self.cache.keep(self, k, v)                          # slice j's, for slices > j
        n_rep = q.shape[1] // k.shape[1]                     # GQA: K/V heads arrive unrepeated
        return causal_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), self.impl)


def forward_slice(stage, cache, x, start: int):
    """One slice (first token `start`) through the stage; its attention reads and extends `cache`."""
    cores = [block.attn.core for block in stage.blocks]
    for core in cores:
        core.cache = cache
    try:
        y = stage(x, positions=range(start, start + x.shape[1]))     # RoPE at the true positions
    finally:
        for core in cores:
            core.cache = None
    return y, cache.take_produced()


def backward_slice(y, dy, produced):
    """∂L/∂y = dy, plus what later slices left on the K/V leaves this slice produced."""
    pairs = [(kv, leaf.grad) for kv, leaf in produced if leaf.grad is not None]
    torch.autograd.backward([y] + [kv for kv, _ in pairs], [dy] + [g for _, g in pairs])


def run_terapipe(plan: TeraPipePlan, stage: TinyLlama, tokens, targets, timeline=None,
                 cost=None, group=None, group_ranks=None) -> dict:
    """This rank's part of one TeraPipe step; the gradients accumulate in the stage's `.grad`.
    Returns {"loss": the mean loss on the last rank, else None}."""
    io = _StageIO(plan, stage, tokens, targets, timeline, cost, group, group_ranks)
    caches = [SliceKVCache() for _ in range(plan.n_micro)]       # one per sequence, on this stage
    saved, total = {}, None
    for u in plan.units:                                     # forward, slice after slice
        x = io.tokens(u) if io.first else io.recv(u, io.me - 1).requires_grad_()
        with io.span("F", u):
            y, produced = forward_slice(stage, caches[u.mb], x, u.start)
            if io.last:             # the slice's mean loss, weighted by its share of the tokens
                y = stage.loss_fn(y, io.targets(u)) * (u.length / (plan.seq * plan.n_micro))
                total = y.detach() + (0 if total is None else total)
        saved[u.number] = (x, y, produced)
        if not io.last:
            io.send(y.detach(), io.me + 1)
    for u in reversed(plan.units):                           # backward, last slice first
        x, y, produced = saved.pop(u.number)
        dy = None if io.last else io.recv(u, io.me + 1)
        with io.span("BW", u):
            backward_slice(y, dy, produced)
        if not io.first:
            io.send(x.grad, io.me - 1)
    io.wait()
    return {"loss": total}


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Unit:
    """One slice of one micro-batch: what the pipeline schedules (its `number` is the op's mb)."""
    number: int
    mb: int
    index: int     # slice index within the micro-batch
    start: int     # its first token = the context before it
    length: int


@dataclass(frozen=True)
class TeraPipePlan:
    """A sequence cut into `slices`, run through `n_stages` stages of an `n_layers` model,
    for each of `n_micro` micro-batches; `seq`, if given, is the sequence length the slices
    must add up to. Checked on construction, before any rank starts."""
    slices: tuple
    n_stages: int
    n_layers: int
    n_micro: int = 1
    seq: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "slices", check_slices(self.slices, self.seq))
        object.__setattr__(self, "seq", sum(self.slices))
        if not 1 <= self.n_stages <= self.n_layers:
            raise ValueError(f"{self.n_stages} stages for {self.n_layers} layers: need "
                             "1 ≤ stages ≤ layers (a stage holds at least one layer)")
        if self.n_layers % self.n_stages:
            raise ValueError(f"{self.n_layers} layers do not split evenly into "
                             f"{self.n_stages} stages")
        if self.n_micro < 1:
            raise ValueError(f"n_micro={self.n_micro}: need at least one micro-batch")

    @property
    def units(self) -> list[Unit]:
        """Micro-batch by micro-batch, slice by slice: the forward order."""
        out = []
        for mb in range(self.n_micro):
            start = 0
            for i, length in enumerate(self.slices):
                out.append(Unit(len(out), mb, i, start, length))
                start += length
        return out

    def schedule(self) -> Schedule:
        """GPipe over the units: every rank runs all forwards, then all backwards in reverse
        (a slice's backward needs the gradients of its K/V from every later slice)."""
        n = len(self.units)
        ops = [[Op("F", r, u) for u in range(n)] + [Op("BW", r, u) for u in reversed(range(n))]
               for r in range(self.n_stages)]
        return validate(Schedule("terapipe", n, tuple(range(self.n_stages)), ops))


# --------------------------------------------------------------------------- the K/V cache and the stage

class SliceKVCache:
    """The keys and values of the slices one stage has run for one sequence, per layer.

    Each slice's K/V are kept as *leaves* (detached, requiring grad): later slices attend
    to them and their gradients collect in `.grad`. `produced` pairs each leaf with the
    tensor it was cut from, so the producing slice's backward can pass that gradient on.
    (Generation's `picolib.model.KVCache` concatenates K/V without gradients.)"""

    def __init__(self):
        self.keys: dict = {}      # core -> [leaf per slice]
        self.values: dict = {}
        self.produced: list = []  # (tensor in the producing slice's graph, its leaf)

    def past(self, core):
        return self.keys.get(core, []), self.values.get(core, [])

    def keep(self, core, k, v):
        for store, t in ((self.keys, k), (self.values, v)):
            leaf = t.detach().requires_grad_(t.requires_grad)
            store.setdefault(core, []).append(leaf)
            if t.requires_grad:
                self.produced.append((t, leaf))

    def take_produced(self) -> list:
        out, self.produced = self.produced, []
        return out

    def truncate(self, n_slices: int) -> None:
        """Forget every slice after the first `n_slices` (for timing one slice repeatedly)."""
        for store in (self.keys, self.values):
            for core in store:
                del store[core][n_slices:]


def causal_attention(q, k, v, impl: str):
    """Attention of the last s_q positions over s_k ≥ s_q keys (earlier context + own).
    SDPA's is_causal aligns the mask top-left, so a longer context needs the mask written."""
    if impl == "eager" or k.shape[2] == q.shape[2]:
        return attention_core(q, k, v, impl)
    s_q, s_k = q.shape[2], k.shape[2]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def use_kv_cache(model: TinyLlama) -> list[CachedAttentionCore]:
    """Swap every block's attention core for a CachedAttentionCore, in place."""
    if model.cfg.recompute != "none":
        raise ValueError(f"recompute={model.cfg.recompute!r}: recomputing in backward would "
                         "run the attention core again and cache its K/V twice; use 'none'")
    cores = []
    for block in model.blocks:
        old = block.attn.core
        if not isinstance(old, CachedAttentionCore):
            if type(old) is not AttentionCore:
                raise ValueError(f"block attention core is a {type(old).__name__}; TeraPipe "
                                 "replaces only the plain AttentionCore")
            block.attn.core = CachedAttentionCore(old.impl)
        cores.append(block.attn.core)
    return cores


def terapipe_stage(model: TinyLlama, plan: TeraPipePlan, rank: int) -> TinyLlama:
    """Stage `rank` of `plan` (split_stages of lesson 07), with K/V-caching cores."""
    if len(model.blocks) != plan.n_layers:
        raise ValueError(f"the plan is for {plan.n_layers} layers, the model has {len(model.blocks)}")
    if plan.seq > model.cfg.max_seq:
        raise ValueError(f"a {plan.seq}-token sequence needs max_seq ≥ {plan.seq} "
                         f"(the config has {model.cfg.max_seq})")
    stage = split_stages(model, plan.n_stages)[rank]
    use_kv_cache(stage)
    return stage


class _StageIO:
    """run_terapipe's machinery on one rank: its checks, the slices of the batch it reads,
    its point-to-point messages and its timeline spans."""

    def __init__(self, plan, stage, tokens, targets, timeline, cost, group, group_ranks):
        me = dist.get_rank()
        self.me = me = group_ranks.index(me) if group_ranks else me
        p, self.first, self.last = plan.n_stages, me == 0, me == plan.n_stages - 1
        if (stage.embed is not None) != self.first or (stage.lm_head is not None) != self.last:
            raise ValueError(f"rank {me} of {p}: its stage {'must' if self.first else 'must not'} embed "
                             f"and {'must' if self.last else 'must not'} end in the head")
        if not all(isinstance(b.attn.core, CachedAttentionCore) for b in stage.blocks):
            raise ValueError("the stage's attention cores do not cache K/V: build it with "
                             "terapipe_stage (or use_kv_cache)")
        if tokens.shape != targets.shape or tokens.dim() != 2 or tokens.shape[1] != plan.seq:
            raise ValueError(f"tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} must "
                             f"both be (batch, {plan.seq}) for slices {list(plan.slices)}")
        if tokens.shape[0] % plan.n_micro:
            raise ValueError(f"batch {tokens.shape[0]} does not split into {plan.n_micro} micro-batches")
        self.toks, self.tgts = tokens.chunk(plan.n_micro), targets.chunk(plan.n_micro)
        self.plan, self.stage, self.like = plan, stage, next(stage.parameters())
        self.timeline, self.cost = timeline, None if cost is None else emulated_costs(cost)
        self.group, self.group_ranks, self.pending = group, group_ranks, []

    def tokens(self, u):
        return self.toks[u.mb][:, u.start:u.start + u.length]

    def targets(self, u):
        return self.tgts[u.mb][:, u.start:u.start + u.length]

    def _global(self, r):
        return self.group_ranks[r] if self.group_ranks else r

    def recv(self, u, src):
        buf = torch.empty(self.stage.hidden_shape(self.toks[u.mb].shape[0], u.length),
                          dtype=self.like.dtype, device=self.like.device)
        comm.recv(buf, self._global(src), group=self.group)
        return buf

    def send(self, t, dst):
        self.pending.append((comm.isend(t, self._global(dst), group=self.group), t))

    def wait(self):
        for work, _ in self.pending:
            work.wait()

    def span(self, kind, u):
        """A timeline span "F" or "BW" with meta length and context (the slice's start),
        costed by `emulated_costs(cost)` when run_terapipe was given a cost."""
        if self.timeline is None:
            return contextlib.nullcontext()
        label = str(u.index) if self.plan.n_micro == 1 else f"{u.mb}.{u.index}"
        meta = dict(stage=self.me, mb=u.number, slice=u.index, micro=u.mb, label=label,
                    length=u.length, context=u.start)
        return self.timeline.span(kind, cost=None if self.cost is None else self.cost[kind](**meta),
                                  **meta)


# --------------------------------------------------------------------------- costs

def emulated_costs(cost) -> dict:
    """The timeline's `emulate` for TeraPipe's ops from a slice cost t(l, c) in seconds:
    {"F": FORWARD_SHARE · t, "BW": the rest}, functions of an op's length and context."""
    return {"F": lambda length, context, **_: FORWARD_SHARE * float(cost(length, context)),
            "BW": lambda length, context, **_: (1 - FORWARD_SHARE) * float(cost(length, context))}


def plan_costs(plan: TeraPipePlan, cost) -> dict:
    """{"F": {unit: seconds}, "BW": {...}}: the emulated op costs of the plan's units."""
    ops = emulated_costs(cost)
    return {kind: {u.number: fn(length=u.length, context=u.start) for u in plan.units}
            for kind, fn in ops.items()}


def simulate_plan(plan: TeraPipePlan, cost) -> list[dict]:
    """The plan's schedule on ideal devices (lesson 07's simulator), op costs from `cost`:
    timeline events, for plot_gantt and makespan."""
    c = plan_costs(plan, cost)
    return simulate(plan.schedule(), lambda op: c["F" if op.kind == "F" else "BW"][op.mb])


def measure_costs(model: TinyLlama, lengths, contexts, layers: int = 1, batch: int = 1,
                  repeats: int = 3, seed: int = 0) -> list[tuple[int, int, float]]:
    """Time forward + backward of a slice of l tokens after c tokens of context on a stage
    of `layers` blocks of `model` (no embedding, no head): [(l, c, seconds)] for every pair
    with l + c ≤ max_seq, the fastest of `repeats` runs (other processes on the machine can
    only add time). The backward includes the gradients into the cached context."""
    stage = model.part(range(layers), embed=False, head=False)
    use_kv_cache(stage)
    g = torch.Generator().manual_seed(seed)
    h, out = model.cfg.hidden, []
    for c in contexts:
        cache = SliceKVCache()
        if c:
            forward_slice(stage, cache, torch.randn(batch, c, h, generator=g).requires_grad_(), 0)
        kept = 1 if c else 0
        for length in lengths:
            if c + length > model.cfg.max_seq:
                continue
            x = torch.randn(batch, length, h, generator=g).requires_grad_()
            dy = torch.randn(batch, length, h, generator=g)
            times = []
            for _ in range(repeats + 1):          # the first one warms up
                t0 = time.perf_counter()
                y, produced = forward_slice(stage, cache, x, c)
                backward_slice(y, dy, produced)
                times.append(time.perf_counter() - t0)
                cache.truncate(kept)
            out.append((length, c, min(times[1:])))
    stage.zero_grad(set_to_none=True)
    return out
