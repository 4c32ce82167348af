"""One description of a layout (lessons 10-11): how a model's training step is spread over
ranks, read alike by the trainer (`picolib.compose.TrainConfig` adds the run's options), the
planner (`picolib.planner.Parallelism` adds its counting assumptions), the dry run and the
placement of ranks on a network. torchtitan's `ParallelDims` is the precedent; this one also
carries what decides a rank's bytes: schedule, chunks, micro-batches, ZeRO stage, precision,
recomputation, the context-parallel algorithm and the experts.

- `Layout`: the fields; `layout_of(x)` the Layout part of a TrainConfig or a Parallelism.
- `check_layout`: the rules every user of a layout shares, before any process starts; the
  planner's looser ones are explicit switches (it prices what the trainer does not run).
- `stage_layers`: the one split of the layers into pipeline stages — uneven where they do
  not divide, as published runs cut them (Llama 3 405B: 126 layers on 16 stages);
  `rank_stages`: the stages one pipeline rank holds, their layers, embedding and head, read
  off the schedule (the trainer's placement of parameters and the planner both ask it).
- `coordinates`, `rank_at`: the one rank numbering, row-major over pp, dp, cp, tp (tp
  innermost), as `picolib.mesh` and PyTorch's DeviceMesh lay ranks out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import NamedTuple

from .context_parallel import check_context_parallel
from .mesh import DIMS, check_mesh   # DIMS: outermost → innermost
from .moe import check_moe
from .pipeline_schedules import SCHEDULES, make_schedule
from .tensor_parallel import check_tensor_parallel

__all__ = ["Layout", "layout_of", "check_layout", "stage_layers", "stage_ranges", "pieces",
           "RankStage", "rank_stages", "cached_schedule", "coordinates", "rank_at", "ZERO3_PIPELINE",
           "DIMS"]

PRECISIONS = ("fp32", "bf16")            # what the trainer runs
PLANNED_PRECISIONS = PRECISIONS + ("fp8",)   # what the planner also prices
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """Where a step runs. Ranks = dp·tp·pp·cp; ep is a block of the dp ranks; sp splits the
    sequence over tp; `chunks` stages per rank for the interleaved schedule (`v`);
    `micro_batches` per step on each replica (pipelined, or accumulated); a `seq`-token
    sequence is split over cp by `cp_algorithm` in `cp_layout`; `experts` > 0 makes every MLP
    a mixture of that many experts, `top_k` a token."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0                 # 0: DDP; 1, 2, 3: ZeRO stage
    schedule: str = "1f1b"
    chunks: int = 2               # v for the interleaved schedule
    micro_batches: int = 1
    seq: int = 32
    recompute: str = "none"       # "none" | "selective" | "full"
    precision: str = "fp32"       # "fp32" | "bf16": bf16 copies of fp32 masters (the planner also prices "fp8")
    experts: int = 0              # > 0: every MLP becomes a mixture of this many experts
    top_k: int = 1
    ep: int = 1                   # expert-parallel ranks, a block of the dp ranks
    cp_algorithm: str = "ring"    # "ring" | "allgather" (K/V, Llama 3) | "ulysses"
    cp_layout: str = "zigzag"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def v(self) -> int:
        """Stages per rank the schedule is made with: `chunks` for interleaved, else 1."""
        return self.chunks if self.schedule == "interleaved" else 1

    def make_schedule(self):
        """picolib's schedule of this layout (pp > 1), `pipeline_schedules.make_schedule`."""
        return make_schedule(self.schedule, self.pp, self.micro_batches, self.v)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def layout_of(x) -> Layout:
    """The Layout part of `x` (a TrainConfig, a Parallelism, a Layout): its Layout fields."""
    return Layout(**{f.name: getattr(x, f.name) for f in fields(Layout)})


def pieces(layout: Layout) -> int:
    """How many pieces the model is cut into: one per schedule stage (p·v; DualPipeV's 2p),
    except DualPipe, whose 2p stages are two copies of p pieces."""
    return 1 if layout.pp == 1 else _pieces(layout.schedule, layout.pp, layout.micro_batches, layout.v)


@lru_cache(maxsize=1024)
def cached_schedule(name: str, p: int, m: int, v: int):
    """picolib's schedule (`make_schedule`), cached: the planner and `rank_stages` read its
    stages, ops and pipes."""
    return make_schedule(name, p, m, v)


def _pieces(schedule: str, p: int, m: int, v: int) -> int:
    return len(cached_schedule(schedule, p, m, v).pipes[0][0])


def stage_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage: equal when they divide; otherwise ⌈L/S⌉ each, one fewer on the
    stages that also hold the embedding or the head first (first, last, second, ...) — as
    Llama 3 405B's 126 layers on 16 stages: 7, 8, ..., 8, 7 (Llama 3 paper, §3.3.2)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} stages: need 1 ≤ stages ≤ layers")
    base = -(-n_layers // n_stages)
    counts = [base] * n_stages
    order = [i // 2 if i % 2 == 0 else n_stages - 1 - i // 2 for i in range(n_stages)]
    for s in order[:base * n_stages - n_layers]:
        counts[s] -= 1
    return counts


def stage_ranges(n_layers: int, n_stages: int) -> list[range]:
    """`stage_layers` as contiguous ranges of layer indices."""
    out, at = [], 0
    for n in stage_layers(n_layers, n_stages):
        out.append(range(at, at + n))
        at += n
    return out


class RankStage(NamedTuple):
    """One schedule stage a pipeline rank holds: its layers of the whole model, and whether
    it holds the embedding (the first piece) and the head (the last)."""
    stage: int
    layers: range
    embed: bool
    head: bool


def rank_stages(layout, n_layers: int, pp_rank: int = 0) -> list[RankStage]:
    """The schedule stages pipeline rank `pp_rank` holds, in stage order, read off the
    schedule (interleaved: r, r+p, ...; DualPipeV: r and 2p−1−r; DualPipe: r and 2p−1−r, the
    second a copy of piece p−1−r), each with its piece's layers (`stage_ranges`)."""
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank must be in [0, {layout.pp}), not {pp_rank}")
    if layout.pp == 1:
        return [RankStage(0, range(n_layers), True, True)]
    n = pieces(layout)
    parts = stage_ranges(n_layers, n)
    stages = cached_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.v).stages_of(pp_rank)
    return [RankStage(s, parts[s % n], s % n == 0, s % n == n - 1) for s in stages]


def coordinates(layout, rank: int, order=DIMS) -> dict[str, int]:
    """{pp, dp, cp, tp} of a global rank, ranks numbered row-major over `order` (outermost
    first; default the mesh's pp, dp, cp, tp)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is not one of the {layout.world_size} ranks of the mesh")
    out = {}
    for d in reversed(order):
        size = getattr(layout, d)
        out[d], rank = rank % size, rank // size
    return {d: out[d] for d in DIMS}


def rank_at(layout, order=DIMS, **coords: int) -> int:
    """The global rank at these coordinates (every one of pp, dp, cp, tp given)."""
    rank = 0
    for d in order:
        rank = rank * getattr(layout, d) + coords[d]
    return rank


ZERO3_PIPELINE = ("ZeRO-3 × pipeline parallelism is not supported: ZeRO-3 gathers and frees a "
                  "stage's parameters around each forward while a schedule keeps micro-batches "
                  "in flight; use ZeRO-1/2 or DDP on pipeline stages")


def _positive(layout, names):
    for name in names:
        x = getattr(layout, name)
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive integer, not {x!r}")


def check_layout(layout: Layout, model, world_size: int | None = None, *, fp8: bool = False,
                 zero3_recompute: bool = False, zero3_ep: bool = False,
                 dualpipe_ep: bool = False) -> None:
    """Raise a ValueError naming the numbers when `layout` cannot run `model` (a
    LlamaConfig) on `world_size` ranks (None: any). The rules of the code that runs it: the
    mesh, ZeRO's stages, TP's heads and widths, SP's and CP's sequence cuts, the schedule's
    own checks and one layer per stage at least, ZeRO-3 without a pipeline, the experts over
    ep dp ranks. The switches allow what the planner prices but the trainer does not run:
    `fp8` precision, ZeRO-3 with recomputation (`zero3_recompute`) or with experts spread
    over ep > 1 (`zero3_ep`), DualPipe with ep > 1 (`dualpipe_ep`)."""
    _positive(layout, ("dp", "tp", "pp", "cp", "ep", "chunks", "micro_batches", "seq"))
    if world_size is not None:
        check_mesh(world_size, **{d: getattr(layout, d) for d in DIMS})
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (DDP), 1, 2 or 3, not {layout.zero!r}")
    precisions = PLANNED_PRECISIONS if fp8 else PRECISIONS
    if layout.precision not in precisions:
        raise ValueError(f"precision must be {' or '.join(precisions)}, not {layout.precision!r}")
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', not {layout.recompute!r}")
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {layout.schedule!r}; choose one of {sorted(SCHEDULES)}")
    check_tensor_parallel(model, layout.tp)
    if layout.sp and layout.tp == 1:
        raise ValueError("sp (sequence parallelism) splits the sequence over tp: it needs tp ≥ 2")
    if layout.sp and (layout.seq % layout.cp or layout.seq // layout.cp % layout.tp):
        raise ValueError(f"with sp each rank's seq={layout.seq}/cp={layout.cp} tokens must "
                         f"divide by tp={layout.tp}")
    check_context_parallel(model, layout.cp, layout.cp_algorithm, layout.cp_layout, tp=layout.tp,
                           seq=layout.seq if layout.cp > 1 else None)
    if layout.pp > 1:
        n = pieces(layout)                  # make_schedule's own checks first
        if n > model.n_layers:
            raise ValueError(f"n_layers={model.n_layers} is fewer than the {n} pipeline stages "
                             f"of {layout.schedule} (pp={layout.pp}"
                             + (f" × chunks={layout.v}" if layout.v > 1 else "") + ")")
        if layout.zero == 3:
            raise ValueError(ZERO3_PIPELINE)
        if layout.schedule == "dualpipe" and layout.experts and layout.ep > 1 and not dualpipe_ep:
            raise ValueError(f"dualpipe keeps each expert on its pair of pipeline ranks as well "
                             f"as its ep={layout.ep} replicas: use ep=1 with it")
    if layout.experts:
        check_moe(layout.experts, layout.top_k, None, "softmax", layout.ep)
        if layout.dp % layout.ep:
            raise ValueError(f"ep={layout.ep} must divide dp={layout.dp} (expert-parallel groups "
                             "are made of data-parallel ranks)")
        if layout.zero == 3 and layout.ep > 1 and not zero3_ep:
            raise ValueError(f"zero=3 gathers each block over all dp={layout.dp} replicas, but "
                             f"with ep={layout.ep} a block's experts differ between them: use "
                             "zero=1 or 2")
    elif layout.ep > 1:
        raise ValueError(f"ep={layout.ep} spreads experts: it needs a mixture of experts")
    if layout.zero == 3 and layout.recompute != "none" and not zero3_recompute:
        raise ValueError("ZeRO-3 frees parameters after forward: recompute needs zero ≤ 2")
