"""The planner: bytes per rank and bytes on the wire of any 5-D configuration (lesson 11).

What: for a Llama-shaped model (a `LlamaConfig`, optionally with a `MoEShape`: the shape of
its mixture-of-experts MLPs) and a `Parallelism` (dp with ZeRO stage 0-3, tp with or
without SP, pp with its schedule and micro-batches, cp, ep, recomputation, precision):
- `rank_units`: the parameters one rank holds, as ZeRO's units (root, then each block);
- `memory`: parameters, gradients, optimizer state and saved activations of one rank — the
  activations of every micro-batch its pipeline schedule keeps in flight, read off the
  schedule itself (`picolib.pipeline_schedules`), which calculators that ignore pipeline
  parallelism leave out;
- `traffic`: the bytes one rank sends per step for each kind of parallelism, by the ring
  formulas `picolib.comm.Ledger` records.
Why: each formula is one the earlier lessons measured — ZeRO's bytes
(`picolib.sharded_optim.zero_memory_bytes`, lesson 03), saved activations per layer
(`picolib.sequence_parallel`, lessons 01 and 05), the ring's bytes (`picolib.comm`, lesson
00). Put together they size a run on thousands of GPUs; on the configurations picolib runs,
tests/lib/test_planner_measured.py and tests/lib/test_planner_trainer.py (the trainer: dense
and MoE, dp ≠ ep, DDP and ZeRO-1/2, with pp, tp, sp and cp) check them byte for byte against
real ranks.
The pipeline is read off picolib's schedule: which stages a rank holds (DualPipe: two
copies; DualPipeV: the V, head and embedding on rank 0), what it keeps in flight, what it
sends; a schedule `make_schedule` refuses, the planner refuses.

Two activation models. "picolib": the TinyLlama block exactly as picolib runs it (eager
attention, no dropout; lesson 05's `activation_bytes_per_layer`) — used to check against
measurements. "korthikanti" (default): Korthikanti et al. 2022's 16-bit count,
sbh(10 + 24/t) or sbh·34/t with SP, the 5as²b/t score term dropped with flash attention
(the count lesson 05 used for Llama-3-70B).
Step time, MFU and the search over configurations are in `picolib.plan_search`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache

from .comm import ring_sent_bytes
from .memory import bytes_per_param
from .model import LlamaConfig
from .parallel_layout import (PLANNED_PRECISIONS, Layout, cached_schedule, check_layout, layout_of, pieces,
                              rank_stages, stage_layers)
from .sequence_parallel import activation_bytes_per_layer, korthikanti_bytes_per_layer
from .sharded_optim import optimizer_state_factor, zero_memory_bytes, zero_traffic_bytes
from .tensor_parallel import kv_heads_per_rank

__all__ = ["MoEShape", "Parallelism", "Plan", "check", "moe_of", "layer_numel", "rank_units",
           "stage_layers", "elem_bytes", "layer_activation_bytes", "in_flight", "memory", "traffic",
           "expert_numel", "dp_groups", "stage_piece", "runtime_overhead", "HeldAs", "mla_saved_bytes",
           "comm_buffer_bytes", "FP8_TILE",
           "RUNTIME_OVERHEAD", "LLAMA3_70B", "LLAMA3_405B"]

# Published Llama 3 shapes (Llama 3 paper, Table 3; vocabulary 128,256, untied embeddings)
LLAMA3_70B = LlamaConfig(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64,
                         n_kv_heads=8, ffn_hidden=28672, max_seq=8192)
LLAMA3_405B = LlamaConfig(vocab_size=128256, hidden=16384, n_layers=126, n_heads=128,
                          n_kv_heads=8, ffn_hidden=53248, max_seq=8192)


@dataclass(frozen=True)
class MoEShape:
    """Every block's MLP becomes `n_experts` SwiGLU experts of inner size `expert_ffn` (each
    token uses `top_k`), plus `shared` always-on experts and a router (h·E weights)."""
    n_experts: int
    top_k: int
    expert_ffn: int
    shared: int = 0


@dataclass(frozen=True)
class Parallelism(Layout):
    """A layout (`picolib.parallel_layout.Layout`, the trainer's too: GPUs = dp·tp·pp·cp, ep
    splits the experts over ep of the dp ranks, `chunks` stages per rank for interleaved)
    and what the planner assumes to count it: `micro_batch_size` sequences per micro-batch
    (gbs = dp·m·mbs sequences), the activation model, flash attention, fp32 gradient
    accumulation. Defaults a planner's: 4,096-token sequences in bf16. Its experts come with
    their shape, the planner's `moe` argument (a `MoEShape`); `Plan` keeps the two agreeing."""
    seq: int = 4096
    precision: str = "bf16"       # "fp32" | "bf16" (mixed, fp32 master) | "fp8" (bf16 states)
    micro_batch_size: int = 1
    activations: str = "korthikanti"   # or "picolib" (eager TinyLlama, exact)
    flash: bool = True            # korthikanti: no s×s scores saved
    fp32_grad_accum: bool = False

    @property
    def n_gpus(self) -> int:
        return self.world_size

    @classmethod
    def of(cls, layout: Layout, **assumptions) -> "Parallelism":
        """`layout` (a Layout, a TrainConfig: its Layout fields as they are) with the planner's
        `assumptions` (a layout field among them counts the layout as if it were so: the
        s×s scores dropped by recompute="selective", as a flash kernel does); the micro-batch
        size is the layout's own where it has one (a TrainConfig's batch / (dp·m)), else 1."""
        mbs = getattr(layout, "micro_batch_size", 1)
        return cls(**{**asdict(layout_of(layout)), "micro_batch_size": mbs, **assumptions})


@dataclass(frozen=True)
class Plan:
    """A model and a layout for it: what `plan_search.search` finds (each result's "plan"),
    what `TrainConfig.from_plan` (its layout as it is) and `python -m picolib.train --plan FILE`
    run. `to_json` /
    `from_json` write and read it as {"model": LlamaConfig's fields, "par": Parallelism's,
    "moe": MoEShape's or null}."""
    model: LlamaConfig
    par: Parallelism
    moe: MoEShape | None = None

    def __post_init__(self):   # the layout's experts and the MoE's counts, one and the same
        moe = moe_of(self.model, self.par, self.moe)
        object.__setattr__(self, "moe", moe)
        if moe is not None and not self.par.experts:
            object.__setattr__(self, "par", self.par.replace(experts=moe.n_experts, top_k=moe.top_k))

    def to_json(self, path: str | None = None) -> str:
        """The plan as JSON text; also written to `path` when given."""
        text = json.dumps({"model": asdict(self.model), "par": asdict(self.par),
                           "moe": None if self.moe is None else asdict(self.moe)}, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan `to_json` wrote (its text); a ValueError naming what is missing or unknown."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"a plan is JSON: {e}") from None
        if not isinstance(d, dict) or not {"model", "par"} <= set(d) <= {"model", "par", "moe"}:
            raise ValueError(f"a plan is a JSON object with keys model, par and moe (or null), "
                             f"not {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        parts = {}
        for key, kind in (("model", LlamaConfig), ("par", Parallelism), ("moe", MoEShape)):
            if d.get(key) is None:
                continue
            known = {f.name for f in fields(kind)}
            unknown = sorted(set(d[key]) - known)
            if unknown:
                raise ValueError(f"the plan's {key} has unknown fields {unknown}; "
                                 f"{kind.__name__} has {sorted(known)}")
            try:
                parts[key] = kind(**d[key])
            except TypeError as e:
                raise ValueError(f"the plan's {key}: {e}") from None
        return cls(**parts)


def _positive(**values):
    for name, x in values.items():
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive integer, not {x!r}")


def moe_of(cfg: LlamaConfig, par: Parallelism, moe: MoEShape | None = None) -> MoEShape | None:
    """The experts the planner counts: `moe` where given (its counts must be the layout's
    where the layout names experts), else the layout's `experts` and `top_k` as the trainer
    builds them (each the model's MLP, `ffn_hidden`), else None (dense)."""
    if moe is None:
        return MoEShape(par.experts, par.top_k, cfg.ffn_hidden) if par.experts else None
    if par.experts and (par.experts, par.top_k) != (moe.n_experts, moe.top_k):
        raise ValueError(f"the layout's experts={par.experts}, top_k={par.top_k} are not the "
                         f"MoE's n_experts={moe.n_experts}, top_k={moe.top_k}")
    return moe


def check(cfg: LlamaConfig, par: Parallelism, moe: MoEShape | None = None) -> None:
    """Raise a ValueError naming the numbers when `par` cannot run `cfg`: the layout's rules
    (`parallel_layout.check_layout`, with the switches for what the planner prices beyond
    the trainer: fp8, ZeRO-3 with recomputation or expert parallelism, DualPipe with ep),
    then the planner's own assumptions."""
    _positive(micro_batch_size=par.micro_batch_size)
    moe = moe_of(cfg, par, moe)
    if moe is not None:
        _positive(n_experts=moe.n_experts, top_k=moe.top_k, expert_ffn=moe.expert_ffn)
        par = par.replace(experts=moe.n_experts, top_k=moe.top_k)
    check_layout(par, cfg, fp8=True, zero3_recompute=True, zero3_ep=True, dualpipe_ep=True)
    if par.activations not in ("korthikanti", "picolib"):
        raise ValueError(f"activations must be 'korthikanti' or 'picolib', not {par.activations!r}")


def elem_bytes(precision: str) -> int:
    """Bytes of one activation / compute-dtype value."""
    if precision not in PLANNED_PRECISIONS:
        raise ValueError(f"precision must be one of {PLANNED_PRECISIONS}, not {precision!r}")
    return 4 if precision == "fp32" else 2


# --------------------------------------------------------------------------- parameters

def layer_numel(cfg: LlamaConfig, tp: int = 1, moe: MoEShape | None = None, ep: int = 1) -> int:
    """Parameters of one block on one of `tp` ranks (lesson 04's split): q and o split by
    heads, k and v this rank's KV heads, the SwiGLU matrices split along ffn_hidden, the two
    norms whole. With `moe`: E/ep experts of 3·h·f_e each (not split by tp), the shared
    experts split by tp, and the router."""
    h, d = cfg.hidden, cfg.head_dim
    kv_local, _ = kv_heads_per_rank(cfg.n_heads, cfg.n_kv_heads, tp)
    attn = 2 * h * cfg.n_heads * d // tp + 2 * h * kv_local * d
    if moe is None:
        mlp = 3 * h * cfg.ffn_hidden // tp
    else:
        mlp = (moe.n_experts // ep) * 3 * h * moe.expert_ffn + moe.shared * 3 * h * moe.expert_ffn // tp \
            + h * moe.n_experts
    return attn + mlp + 2 * h


def stage_piece(par: Parallelism, stage: int) -> int:
    """The model piece schedule stage `stage` runs (DualPipe's up-pipeline stage p+i is piece
    i again: its second copy); every other schedule: the stage itself."""
    return stage % pieces(par)


def rank_units(cfg: LlamaConfig, par: Parallelism, pp_rank: int = 0,
               moe: MoEShape | None = None) -> list[int]:
    """ZeRO's units on this rank (`picolib.sharded_optim.split_units`): the root's own
    parameters first — the vocab-split embedding on the first stage, the final norm and the
    vocab-split head on the last — then one unit per block (DualPipe: both copies)."""
    check(cfg, par, moe)
    moe = moe_of(cfg, par, moe)
    h, v = cfg.hidden, cfg.vocab_size
    stages = rank_stages(par, cfg.n_layers, pp_rank)
    root = sum((v * h // par.tp if st.embed else 0) + (h + v * h // par.tp if st.head else 0)
               for st in stages)
    block = layer_numel(cfg, par.tp, moe, par.ep)
    return ([root] if root else []) + [block] * sum(len(st.layers) for st in stages)


def expert_numel(cfg: LlamaConfig, par: Parallelism, moe: MoEShape | None = None) -> int:
    """Parameters of one block held by fewer ranks than the rest: the block's E/ep routed
    experts when ep > 1 (their replicas are the dp/ep·cp ranks of their edp group); 0 when
    there are none (ep = 1: every dp rank holds every expert)."""
    if moe is None or par.ep == 1:
        return 0
    return (moe.n_experts // par.ep) * 3 * cfg.hidden * moe.expert_ffn


def dp_groups(cfg: LlamaConfig, par: Parallelism, pp_rank: int = 0,
              moe: MoEShape | None = None) -> list[tuple[list[int], int]]:
    """The rank's parameters by the group that shares them, as ZeRO and DDP split them:
    [(unit numels, group size)] — everything over the dp·cp replicas, except the routed
    experts under ep > 1, which only their (dp/ep)·cp copies share (picolib.zero's
    `groups`, the trainer's edp groups): one unit of experts per block, sharded, reduced and
    all-reduced over that smaller group."""
    units, n = rank_units(cfg, par, pp_rank, moe), par.dp * par.cp
    x = expert_numel(cfg, par, moe)
    if not x:
        return [(units, n)]
    blocks = _n_blocks(cfg, par, pp_rank)
    root = units[:len(units) - blocks]
    dense = root + [layer_numel(cfg, par.tp, moe, par.ep) - x] * blocks
    return [(dense, n), ([x] * blocks, par.dp // par.ep * par.cp)]


def _n_blocks(cfg, par, pp_rank):
    return sum(len(st.layers) for st in rank_stages(par, cfg.n_layers, pp_rank))


# --------------------------------------------------------------------------- activations

def layer_activation_bytes(cfg: LlamaConfig, par: Parallelism) -> int:
    """Bytes one block saves for backward for one micro-batch on one rank (cp splits the
    sequence; recomputation: "full" keeps the block input only, "selective" drops the s×s
    scores (picolib: softmax and mask, lesson 01b))."""
    s, b, h, a, t = par.seq // par.cp, par.micro_batch_size, cfg.hidden, cfg.n_heads, par.tp
    e = elem_bytes(par.precision)
    seq_split = t if par.sp else 1
    if par.recompute == "full":
        return b * s * h * (e if par.activations == "picolib" else 2) // seq_split
    if par.activations == "picolib":
        mode = "tp+sp" if par.sp else "tp"
        full = activation_bytes_per_layer(s, b, h, cfg.ffn_hidden, a, t, mode, e)
        return full - (e * a * b * s * s // t + s * s if par.recompute == "selective" else 0)
    per = korthikanti_bytes_per_layer(s, b, h, a, t, par.sp)
    if par.flash or par.recompute == "selective":
        per -= 5 * a * s * s * b / t
    return int(per * (2 if par.precision == "fp32" else 1))


def _end_bytes(cfg: LlamaConfig, par: Parallelism) -> tuple[int, int]:
    """(first stage, last stage) extra bytes per micro-batch: the embedding's token ids and,
    after the last block, the final norm, the head's input and the fp32 log-softmax of the
    logits with the targets (picolib, exact at tp = 1); Korthikanti: 4·s·b·v/t."""
    s, b, h, v, t = par.seq // par.cp, par.micro_batch_size, cfg.hidden, cfg.vocab_size, par.tp
    if par.activations == "korthikanti":
        return 0, 4 * s * b * v // t
    e, split = elem_bytes(par.precision), (t if par.sp else 1)
    norm = (2 * b * s * h * e + b * s * 4) // split
    return b * s * 8, norm + b * s * h * e // split + b * s * v * 4 // t + b * s * 8 + 4


@lru_cache(maxsize=512)
def _ops(name: str, p: int, m: int, v: int):
    """Each rank's ops of picolib's schedule as (kind, stage) pairs."""
    return tuple(tuple((op.kind, op.stage) for op in ops) for ops in cached_schedule(name, p, m, v).ops)


@lru_cache(maxsize=4096)
def _pp_messages(name: str, p: int, m: int, v: int, rank: int) -> int:
    """Messages rank `rank` sends: one per forward of a stage that is not the last of its
    pipeline, one per backward (BW, or B of a split backward) of a stage that is not the
    first (DualPipe: each of its two pipelines)."""
    sched = cached_schedule(name, p, m, v)
    return sum(1 for op in sched.ops[rank]
               if (op.kind == "F" and not sched.is_last(op.stage))
               or (op.kind in ("BW", "B") and not sched.is_first(op.stage)))


def in_flight(schedule: str, p: int, m: int, v: int = 1, stage_bytes=None) -> list:
    """Per rank, the most micro-batch activations held at once, walking picolib's schedule:
    a forward (F) saves its stage's activations, the backward (BW, or B of a split
    backward) frees them. `stage_bytes[s]`: bytes per micro-batch of stage s (default 1:
    a count of micro-batch-stages)."""
    return list(_in_flight(schedule, p, m, v, None if stage_bytes is None else tuple(stage_bytes)))


@lru_cache(maxsize=1024)
def _in_flight(schedule: str, p: int, m: int, v: int = 1, stage_bytes=None) -> tuple:
    out = []
    for ops in _ops(schedule, p, m, v):
        held = peak = 0
        for kind, stage in ops:
            w = 1 if stage_bytes is None else stage_bytes[stage]
            if kind == "F":
                held += w
                peak = max(peak, held)
            elif kind in ("BW", "B"):
                held -= w
        out.append(peak)
    return tuple(out)


def _stage_bytes(cfg, par, layer=None) -> tuple:
    """Saved bytes per micro-batch of each schedule stage (its piece's layers, plus the
    embedding's or the head's); `layer`: a block's bytes where the caller counts them."""
    n = pieces(par)
    counts = stage_layers(cfg.n_layers, n)
    layer = layer_activation_bytes(cfg, par) if layer is None else layer
    first, last = _end_bytes(cfg, par)
    n_stages = 1 if par.pp == 1 else len(cached_schedule(par.schedule, par.pp, par.micro_batches, par.v).stage_ranks)
    return tuple(counts[k] * layer + (first if k == 0 else 0) + (last if k == n - 1 else 0)
                 for k in (stage_piece(par, s) for s in range(n_stages)))


def _activations(cfg, par, pp_rank, layer=None, working=0):
    stage_bytes = _stage_bytes(cfg, par, layer)
    if par.recompute == "full":   # backward recomputes one block at a time: its full bytes
        working = layer_activation_bytes(cfg, par.replace(recompute="none"))
    if par.pp == 1:
        return stage_bytes[0] + working
    return in_flight(par.schedule, par.pp, par.micro_batches, par.v, stage_bytes)[pp_rank] + working


# --------------------------------------------------------------------------- memory as a run holds it

@dataclass(frozen=True)
class HeldAs:
    """How a run holds its memory where it departs from the planner's defaults — each option
    as the DeepSeek-V3 report (§3.3.2, §3.3.3 and Figure 6) describes its own run; `memory`
    takes one (`held=`), `picolib.published_runs`'s runs name theirs.
    - `mla`: count a block's saved tensors one by one as a latent-attention (MLA) + MoE
      block holds them (`mla_saved_bytes`; tp = 1), not by Korthikanti's GPT count;
    - `fp8_cache`: the inputs of Linear layers cached in FP8 with one fp32 scale per 1×128
      tile (§3.3.3 "Low-Precision Activation", §3.3.1's tiles); the SwiGLU's inputs cached in
      FP8 and its output recomputed; the attention output (the out projection's input, which
      the attention backward reads too) kept in 16 bits (the report's E5M6: its packing is
      not stated, counted at 16 bits);
    - `recompute_norm_up`: every RMSNorm and MLA up-projection recomputed in backward
      (§3.3.2): their outputs are not kept, one block's of them live while its backward runs;
    - `bf16_moments`: AdamW's two moments in BF16, the master weights in FP32 (§3.3.3
      "Low-Precision Optimizer States");
    - `fp32_grads`: the gradients kept in FP32 for the batch's accumulation (§3.3.3, the same
      paragraph; Figure 6's FP32 weight gradient);
    - `comm_buffers`: the buffers the expert all-to-all and the pipeline's sends hold
      (`comm_buffer_bytes`)."""
    mla: object = None
    fp8_cache: bool = False
    recompute_norm_up: bool = False
    bf16_moments: bool = False
    fp32_grads: bool = False
    comm_buffers: bool = False


FP8_TILE = 128    # DeepSeek-V3 report §3.3.1: activations scaled per 1×128 tile (one fp32 scale)


def mla_saved_bytes(cfg: LlamaConfig, mla, moe: MoEShape, tokens: int, fp8_cache: bool = False,
                    recompute_norm_up: bool = False) -> dict:
    """{tensor: bytes} one MLA + MoE block saves for backward for `tokens` tokens on one rank
    (tp = 1; each of the ep ranks gets k·tokens expert rows on average), in bf16 unless the
    options change it (`HeldAs`). Attention: each RMSNorm keeps its input and its fp32 rstd,
    each Linear its input (the attention norm's output, read by the fused q and kv down
    projections; the latents' normed outputs), the down projection's output (the latents and
    the shared rope key), the fused attention kernel q, k, v, its output and one fp32
    statistic a head; MoE: the router (kept in BF16 with FP8 caching too: the
    report's §3.3.1 keeps the gating in its original precision) its input and its fp32 sigmoid
    scores, the routing's int64 score positions and token ids and its fp32 weights (k a
    token), the shared experts their input (the
    router's, or an FP8 copy), the routed experts theirs (k copies of a token), a fused SwiGLU
    its gate and up outputs, the down projection its input. The routing weight scales the
    SwiGLU output before the down projection, so the combine keeps no expert output (its
    gradient is the SwiGLU output's dot with the down projection's input gradient).
    tests/lib/test_planner_held.py measures each entry on a small block."""
    h, n, t = cfg.hidden, cfg.n_heads, tokens
    k, f, e = moe.top_k, moe.expert_ffn, 2
    lin = (1 + 4 / FP8_TILE) if fp8_cache else e       # bytes of a cached Linear input value
    gone = 0 if recompute_norm_up else 1                # a norm's or up-projection's output kept?
    qk = mla.qk_nope + mla.qk_rope
    out = {"attention norm input": t * h * e, "q latent": t * mla.q_lora * e,
           "kv latent": t * mla.kv_lora * e, "MLP norm input": t * h * e,
           "norms' rstd (fp32)": gone * 4 * 4 * t,
           "norm outputs (Linear inputs)": gone * t * (h + mla.q_lora + mla.kv_lora) * lin,
           "MLP norm output (the router's input)": gone * t * h * e,
           "shared experts' FP8 input": gone * t * h * lin if fp8_cache and moe.shared else 0,
           "q, k, v (up-projection outputs)": gone * t * n * (2 * qk + mla.v_head) * e,
           "k rope (shared; with the latents)": t * mla.qk_rope * e,
           "attention output (out's input)": t * n * mla.v_head * e,
           "attention statistics (fp32)": t * n * 4,
           "router scores (fp32)": t * moe.n_experts * 4,
           "routing: score positions, token ids (int64), weights": t * k * (8 + 8 + 4),
           "experts' input": k * t * h * lin,
           "SwiGLU inputs": (k + moe.shared) * t * 2 * f * (lin if fp8_cache else e),
           "SwiGLU outputs (down's input)": 0 if fp8_cache else (k + moe.shared) * t * f * e}
    return {name: int(b) for name, b in out.items()}


def comm_buffer_bytes(cfg: LlamaConfig, par: Parallelism, moe: MoEShape | None) -> int:
    """Bytes of the communication buffers a rank holds beside the tensors (`HeldAs.comm_buffers`):
    the expert all-to-all's receive buffers for two chunks at once (DualPipe overlaps a forward
    and a backward chunk, DeepSeek-V3 report §3.2.1) — the dispatch in FP8 with its tile scales,
    the combine in BF16 (§3.3.3 "Low-Precision Communication"), k rows a token — and the
    pipeline's send and receive of one activation each way."""
    tokens = par.micro_batch_size * par.seq // par.cp
    ep = 0
    if moe is not None and par.ep > 1:
        ep = 2 * moe.top_k * tokens * cfg.hidden * ((1 + 4 / FP8_TILE) + 2)
    pp = 4 * tokens * cfg.hidden * elem_bytes(par.precision) if par.pp > 1 else 0
    return int(ep + pp)


def _held_layer(cfg, par, moe, held):
    """(saved bytes of one block, bytes live while one block's backward recomputes) under `held`."""
    if held is None or held.mla is None:
        if held is not None and (held.recompute_norm_up or held.fp8_cache):
            raise ValueError("fp8_cache and recompute_norm_up count an MLA block's tensors: give held.mla")
        return None, 0
    if moe is None or par.tp != 1:
        raise ValueError(f"the MLA inventory counts an MoE block at tp = 1, not tp={par.tp}, moe={moe}")
    tokens = par.micro_batch_size * par.seq // par.cp
    kept = mla_saved_bytes(cfg, held.mla, moe, tokens, held.fp8_cache, held.recompute_norm_up)
    whole = mla_saved_bytes(cfg, held.mla, moe, tokens, held.fp8_cache, False)
    return sum(kept.values()), sum(whole.values()) - sum(kept.values())


# --------------------------------------------------------------------------- memory

# What a GPU holds besides the tensors: the CUDA context and the kernels PyTorch loads, each
# NCCL communicator's buffers, and the caching allocator's reserve (blocks it keeps but does
# not use). Sources in `runtime_overhead`'s docstring. `memory` adds them when asked
# (overhead=True); the planner's fit verdicts on a GPU (`plan_search.search`, `describe`) do.
RUNTIME_OVERHEAD = {"context": 0.3e9, "per_communicator": 0.2e9, "reserve": 0.05}


def runtime_overhead(par: Parallelism, tensor_bytes: float, context: float | None = None,
                     per_communicator: float | None = None, reserve: float | None = None) -> float:
    """Bytes a GPU shows (nvidia-smi) beyond the tensors the planner counts: `context` (the
    CUDA context and the kernels PyTorch loads: about 300 MB since CUDA 11.7 loads kernels
    lazily, over 1,000 MB before — a PyTorch maintainer in pytorch/pytorch issue 107667; more
    as a run loads more kernels — measure yours as torch.cuda.mem_get_info before and after
    the first CUDA call),
    `per_communicator` for each NCCL communicator this rank is in (one per parallel dimension
    > 1; NCCL's documented default NCCL_BUFFSIZE is 4 MiB per channel and peer, which with
    16-32 channels and both directions is ≈ 0.2 GB — the channel count is assumed), and
    `reserve` × the tensors (the caching allocator's fragmentation: 5 %, an assumption — the
    ZeRO paper (Rajbhandari et al. 2020, "Memory Fragmentation") saw fragmentation leave over
    30 % of memory unusable in extreme cases, and removes most of it by moving long-lived
    tensors into pre-allocated buffers, as DeepSeek-V3's own framework may; no published
    measurement of a typical run is cited — compare torch.cuda.memory_reserved with
    memory_allocated in a real run). Defaults:
    RUNTIME_OVERHEAD."""
    d = RUNTIME_OVERHEAD
    context = d["context"] if context is None else context
    per_communicator = d["per_communicator"] if per_communicator is None else per_communicator
    reserve = d["reserve"] if reserve is None else reserve
    groups = sum(1 for x in (par.dp * par.cp, par.tp, par.pp, par.cp, par.ep) if x > 1)
    return context + groups * per_communicator + reserve * tensor_bytes


def memory(cfg: LlamaConfig, par: Parallelism, pp_rank: int | None = None,
           moe: MoEShape | None = None, overhead: bool = False, held: HeldAs | None = None) -> dict:
    """Bytes one rank holds at its peak: {"params", "grads", "optimizer", "activations",
    "total"}. Adam; fp32: 4 + 4 + 8 bytes per parameter, bf16/fp8: 2 + 2 + (4 master + 8)
    (`picolib.memory.bytes_per_param`); ZeRO shards over the ranks that hold the same
    parameters (`dp_groups`: the dp·cp replicas; an expert's (dp/ep)·cp copies)
    (`zero_memory_bytes`, padded per unit as picolib pads; stage 0 = DDP, unpadded). With
    m > 1 micro-batches, ZeRO-2/3 hold the whole gradient too while they accumulate (as
    picolib/zero.py does: one reduce-scatter per step, not one per micro-batch).
    pp_rank None: the pipeline rank with the largest total. `overhead=True` adds
    "overhead" (`runtime_overhead`: context, NCCL buffers, allocator reserve) to the total;
    off, the figures are the tensors alone, what picolib's runs count byte for byte.
    `held` (a `HeldAs`): the run's own ways of holding memory — its block's saved tensors,
    FP8 caching, recomputed norms and up-projections, BF16 moments, FP32 gradients,
    communication buffers ("buffers")."""
    check(cfg, par, moe)
    moe = moe_of(cfg, par, moe)
    if pp_rank is None:
        return max((memory(cfg, par, r, moe, overhead, held) for r in range(par.pp)),
                   key=lambda d: d["total"])
    parts = bytes_per_param("fp32" if par.precision == "fp32" else "bf16", par.fp32_grad_accum)
    p, g = parts["params"], parts["grads"] + parts.get("fp32_grads", 0)
    k = optimizer_state_factor("adam", master=par.precision != "fp32")
    if held is not None and (held.bf16_moments or held.fp32_grads) and par.precision == "fp32":
        raise ValueError("bf16_moments and fp32_grads describe mixed precision, not precision='fp32'")
    if held is not None and held.bf16_moments:    # fp32 master (4) + two bf16 moments (2 + 2)
        k = 4 + 2 + 2
    if held is not None and held.fp32_grads:
        g = 4
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for units, n in dp_groups(cfg, par, pp_rank, moe):
        if par.zero == 0:
            part = {"params": p * sum(units), "grads": g * sum(units), "optimizer": k * sum(units)}
        else:
            part = zero_memory_bytes(par.zero, units, n, k, param_bytes=p, grad_bytes=g)
            if par.zero >= 2 and par.micro_batches > 1:   # picolib accumulates whole gradients
                part["grads"] += g * sum(units)            # until the step's last backward
        for key in out:
            out[key] += part[key]
    out["activations"] = _activations(cfg, par, pp_rank, *_held_layer(cfg, par, moe, held))
    if held is not None and held.comm_buffers:
        out["buffers"] = comm_buffer_bytes(cfg, par, moe)
    if overhead:
        out["overhead"] = int(runtime_overhead(par, sum(out.values())))
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------- traffic

def _tp_bytes(cfg, par, first, last, layers, moe=None):
    """Bytes a TP rank sends per micro-batch (forward + backward), lesson 04/05's collectives.
    A MoE block whose MLP has no tp-split part (routed experts only: each tp rank runs whole
    experts on its tokens) has the attention's collectives alone."""
    t = par.tp
    if t == 1:
        return 0
    s, b, h = par.seq // par.cp, par.micro_batch_size, cfg.hidden
    e = elem_bytes(par.precision)
    x = b * s * h * e
    ar, rs, ag = (ring_sent_bytes(op, x, t) for op in ("all_reduce", "reduce_scatter", "all_gather"))
    loss = 3 * ring_sent_bytes("all_reduce", b * s * 4, t) if last else 0
    pe = 4 if par.precision == "fp32" else 2                    # parameter (and its grad) dtype
    kv_local, replicas = kv_heads_per_rank(cfg.n_heads, cfg.n_kv_heads, t)
    kv = 2 * ring_sent_bytes("all_reduce", (t // replicas) * kv_local * cfg.head_dim * h * pe, t) \
        if replicas > 1 else 0
    subs = 1 if moe is not None and not moe.shared else 2   # attention (and a tp-split MLP)
    if not par.sp:   # f and g: 2 all-reduces per sub-block; the embedding's g; the head's f
        return layers * (2 * subs * ar + kv) + (ar if first else 0) + (ar if last else 0) + loss
    norm = ring_sent_bytes("all_reduce", h * pe, t)
    # per sub-block: forward ag + rs | backward rs + ag + the re-gather's ag
    block = subs * (ag + rs) + subs * (2 * ag + rs) + 2 * norm + kv
    return layers * block + ((rs + ag) if first else 0) + ((2 * ag + rs + norm) if last else 0) + loss


def traffic(cfg: LlamaConfig, par: Parallelism, pp_rank: int = 0, moe: MoEShape | None = None,
            bucket_numels: list | None = None) -> dict:
    """Bytes one rank sends in one step, by the ring formulas `picolib.comm.Ledger` records:
    {"dp", "tp", "pp", "cp", "ep", "total"}.
    DualPipe adds one all-reduce of the rank's gradients with its mirror rank p−1−r (the two
    copies of each layer are summed before the optimizer step).
    dp: DDP all-reduces each gradient bucket, 2(N−1)/N·B (`bucket_numels`, default one
    bucket of all the rank's parameters); ZeRO-1/2 reduce-scatter + all-gather every unit,
    ZeRO-3 one more all-gather (`zero_traffic_bytes`); in the compute dtype, each part over
    the ranks that share it (`dp_groups`: the dp·cp replicas; the experts' (dp/ep)·cp
    copies, with DDP's one-float all-finite check over the replicas). tp: per micro-batch, TP's 4 all-reduces of (b, s, h) a block or SP's
    all-gathers and reduce-scatters, plus the embedding, the head and the vocab-parallel
    loss (3 all-reduces of (b, s) fp32). pp: one (b, s/sp, h) activation per forward of a
    stage that is not last and one gradient per backward of a stage that is not first,
    counted on the schedule. cp (`cp_algorithm`): ring attention — K and V pass cp−1 hops
    forward; backward passes K, V cp−1 hops and dK, dV cp hops (in fp32: the ring
    accumulates them in fp32 whatever the compute dtype); allgather — K and V
    all-gathered, dK and dV reduce-scattered; Ulysses — q, k, v (K/V repeated to the query
    heads when cp does not divide them) all-to-all to head shards and the output back,
    forward and backward. ep: dispatch and combine all-to-alls forward
    and backward, k·tokens·h each, (ep−1)/ep leaving the rank (even routing: exact when
    every token goes to every expert, an expectation otherwise), and the tokens-per-expert
    counts exchanged before each dispatch (int64, forward only)."""
    check(cfg, par, moe)
    moe = moe_of(cfg, par, moe)
    stages = rank_stages(par, cfg.n_layers, pp_rank)
    layers = sum(len(st.layers) for st in stages)
    m, e = par.micro_batches, elem_bytes(par.precision)
    if par.pp > 1:   # DualPipe: each of its two pipelines carries half of the micro-batches
        m //= len(cached_schedule(par.schedule, par.pp, par.micro_batches, par.v).pipes)
    gdt = 4 if par.precision == "fp32" else 2
    groups = dp_groups(cfg, par, pp_rank, moe)
    dp = 0
    for i, (units, n) in enumerate(groups):
        if par.zero == 0:
            dp += zero_traffic_bytes(0, (bucket_numels if i == 0 else None) or [sum(units)], n, gdt)
        else:
            dp += zero_traffic_bytes(par.zero, units, n, gdt)
    if par.zero == 0 and len(groups) > 1:   # DDP with expert groups: one float32 max over
        dp += ring_sent_bytes("all_reduce", 4, par.dp * par.cp)   # the replicas: all finite?
    if par.pp > 1 and par.schedule == "dualpipe":   # ranks r and p−1−r hold the same two pieces:
        dp += ring_sent_bytes("all_reduce", gdt * sum(rank_units(cfg, par, pp_rank, moe)), 2)   # sum the copies
    first, last = any(st.embed for st in stages), any(st.head for st in stages)
    tp = m * _tp_bytes(cfg, par, first, last, layers, moe)
    s, b, h = par.seq // par.cp, par.micro_batch_size, cfg.hidden
    act = b * (s // (par.tp if par.sp else 1)) * h * e
    pp = act * _pp_messages(par.schedule, par.pp, par.micro_batches, par.v, pp_rank) if par.pp > 1 else 0
    cp = 0
    if par.cp > 1:
        kv_local, _ = kv_heads_per_rank(cfg.n_heads, cfg.n_kv_heads, par.tp)
        block = b * kv_local * s * cfg.head_dim * e         # one K (or V) block of s/cp tokens
        if par.cp_algorithm == "ring":   # dK, dV travel as fp32 accumulators (context_parallel)
            cp = m * layers * ((2 * (par.cp - 1) + 2 * (par.cp - 1)) * block + 2 * par.cp * block * 4 // e)
        elif par.cp_algorithm == "allgather":   # K and V gathered; backward reduce-scatters dK, dV
            cp = m * layers * 2 * ring_sent_bytes("all_gather", 2 * par.cp * block, par.cp)
        else:   # Ulysses: q, k, v to head-sharded and the output back; backward the same
            a = cfg.n_heads // par.tp
            kv = kv_local if kv_local % par.cp == 0 else a   # K/V repeated to the query heads
            qkv, out = b * (a + 2 * kv) * s * cfg.head_dim * e, b * a * s * cfg.head_dim * e
            cp = m * layers * 2 * (ring_sent_bytes("all_to_all", qkv, par.cp)
                                   + ring_sent_bytes("all_to_all", out, par.cp))
        if moe is not None:   # the balancing loss's statistics (2E floats) summed over cp
            cp += m * layers * ring_sent_bytes("all_reduce", 2 * moe.n_experts * 4, par.cp)
    ep = 0
    if moe is not None and par.ep > 1:
        tokens = b * s // (par.tp if par.sp else 1)
        ep = m * layers * 4 * (moe.top_k * tokens * h * e) * (par.ep - 1) // par.ep
        ep += m * layers * (par.ep - 1) * (moe.n_experts // par.ep) * 8   # the int64 counts, forward
    out = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    out["total"] = sum(out.values())
    return out
