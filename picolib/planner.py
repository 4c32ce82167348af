"""The planner: bytes per rank and bytes on the wire of any 5-D configuration (lesson 11).

What: for a Llama-shaped model (a `LlamaConfig`, optionally with a `MoE` MLP) and a
`Parallelism` (dp with ZeRO stage 0-3, tp with or without SP, pp with its schedule and
micro-batches, cp, ep, recomputation, precision):
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
tests/test_planner_measured.py checks them byte for byte against real ranks.

Two activation models. "picolib": the TinyLlama block exactly as picolib runs it (eager
attention, no dropout; lesson 05's `activation_bytes_per_layer`) — used to check against
measurements. "korthikanti" (default): Korthikanti et al. 2022's 16-bit count,
sbh(10 + 24/t) or sbh·34/t with SP, the 5as²b/t score term dropped with flash attention
(the count lesson 05 used for Llama-3-70B).
Step time, MFU and the search over configurations are in `picolib.plan_search`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from .comm import ring_sent_bytes
from .memory import bytes_per_param
from .model import LlamaConfig
from .pipeline_schedules import make_schedule
from .sequence_parallel import activation_bytes_per_layer, korthikanti_bytes_per_layer
from .sharded_optim import optimizer_state_factor, zero_memory_bytes, zero_traffic_bytes
from .tensor_parallel import kv_heads_per_rank

__all__ = ["MoE", "Parallelism", "check", "layer_numel", "rank_units", "rank_layers",
           "stage_layers", "elem_bytes", "layer_activation_bytes", "in_flight", "memory", "traffic",
           "LLAMA3_70B", "LLAMA3_405B"]

# Published Llama 3 shapes (Llama 3 paper, Table 3; vocabulary 128,256, untied embeddings)
LLAMA3_70B = LlamaConfig(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64,
                         n_kv_heads=8, ffn_hidden=28672, max_seq=8192)
LLAMA3_405B = LlamaConfig(vocab_size=128256, hidden=16384, n_layers=126, n_heads=128,
                          n_kv_heads=8, ffn_hidden=53248, max_seq=8192)


@dataclass(frozen=True)
class MoE:
    """Every block's MLP becomes `n_experts` SwiGLU experts of inner size `expert_ffn` (each
    token uses `top_k`), plus `shared` always-on experts and a router (h·E weights)."""
    n_experts: int
    top_k: int
    expert_ffn: int
    shared: int = 0


@dataclass(frozen=True)
class Parallelism:
    """One configuration. GPUs = dp·tp·pp·cp; ep splits the experts over ep of the dp ranks.
    A step is `micro_batches` (m) micro-batches of `micro_batch_size` sequences of `seq`
    tokens on each data-parallel replica: gbs = dp·m·mbs sequences."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0                 # 0 = plain DP (DDP), 1/2/3 = ZeRO stage
    sp: bool = False              # sequence parallelism with TP (Megatron's re-gather)
    schedule: str = "1f1b"        # picolib.pipeline_schedules name (pp > 1)
    v: int = 1                    # chunks per rank ("interleaved")
    micro_batches: int = 1
    micro_batch_size: int = 1
    seq: int = 4096
    recompute: str = "none"       # "none" | "selective" | "full"
    precision: str = "bf16"       # "fp32" | "bf16" (mixed, fp32 master) | "fp8" (bf16 states)
    activations: str = "korthikanti"   # or "picolib" (eager TinyLlama, exact)
    flash: bool = True            # korthikanti: no s×s scores saved
    fp32_grad_accum: bool = False

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def replace(self, **changes) -> "Parallelism":
        return replace(self, **changes)


def _positive(**values):
    for name, x in values.items():
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive integer, not {x!r}")


def check(cfg: LlamaConfig, par: Parallelism, moe: MoE | None = None) -> None:
    """Raise a ValueError naming the numbers when `par` cannot run `cfg`."""
    _positive(**{f.name: getattr(par, f.name) for f in fields(par)
                 if f.name in ("dp", "tp", "pp", "cp", "ep", "v", "micro_batches",
                               "micro_batch_size", "seq")})
    kv_heads_per_rank(cfg.n_heads, cfg.n_kv_heads, par.tp)       # the GQA rule of lesson 04
    for name, value in (("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
        if value % par.tp:
            raise ValueError(f"tp={par.tp} must divide {name}={value}")
    shards = (par.tp if par.sp else 1) * par.cp * (2 if par.cp > 1 else 1)
    if par.seq % shards:
        raise ValueError(f"seq={par.seq} must divide by {shards} (sp·tp and 2·cp chunks)")
    if cfg.n_layers < par.pp * par.v:
        raise ValueError(f"n_layers={cfg.n_layers} is fewer than the pp·v={par.pp * par.v} stages")
    if par.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (DDP), 1, 2 or 3, not {par.zero!r}")
    if par.zero == 3 and par.pp > 1:
        raise ValueError("ZeRO-3 with pp > 1 re-gathers every stage's weights for each "
                         "micro-batch; picolib refuses it (lesson 10): use ZeRO-1/2 with PP")
    if par.recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', not {par.recompute!r}")
    elem_bytes(par.precision)
    if par.activations not in ("korthikanti", "picolib"):
        raise ValueError(f"activations must be 'korthikanti' or 'picolib', not {par.activations!r}")
    if par.sp and par.tp == 1:
        raise ValueError("sp=True needs tp > 1 (sequence parallelism splits over the TP group)")
    if par.pp > 1:
        _ops(par.schedule, par.pp, par.micro_batches, par.v)   # make_schedule's own checks
    if moe is not None:
        _positive(n_experts=moe.n_experts, top_k=moe.top_k, expert_ffn=moe.expert_ffn)
        if moe.n_experts % par.ep or par.dp % par.ep or moe.top_k > moe.n_experts:
            raise ValueError(f"ep={par.ep} must divide n_experts={moe.n_experts} and dp={par.dp}, "
                             f"and top_k={moe.top_k} ≤ n_experts")
    elif par.ep != 1:
        raise ValueError(f"ep={par.ep} needs a MoE model (pass moe=MoE(...))")


def elem_bytes(precision: str) -> int:
    """Bytes of one activation / compute-dtype value."""
    if precision not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp8', not {precision!r}")
    return 4 if precision == "fp32" else 2


# --------------------------------------------------------------------------- parameters

def layer_numel(cfg: LlamaConfig, tp: int = 1, moe: MoE | None = None, ep: int = 1) -> int:
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


def stage_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage: equal when they divide; otherwise ⌈L/S⌉ each, one fewer on the
    stages that also hold the embedding or the head first (first, last, second, ...) — as
    Llama 3 405B's 126 layers on 16 stages: 7, 8, ..., 8, 7 (Llama 3 paper, §3.3.2)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} stages")
    base = -(-n_layers // n_stages)
    counts, order = [base] * n_stages, []
    for i in range(n_stages):
        order.append(i // 2 if i % 2 == 0 else n_stages - 1 - i // 2)
    for s in order[:base * n_stages - n_layers]:
        counts[s] -= 1
    return counts


def rank_layers(cfg: LlamaConfig, par: Parallelism, pp_rank: int = 0) -> list[int]:
    """The pipeline stages rank `pp_rank` holds (v per rank: r, r+p, ...)."""
    if not 0 <= pp_rank < par.pp:
        raise ValueError(f"pp_rank must be in [0, {par.pp}), not {pp_rank}")
    return [pp_rank + i * par.pp for i in range(par.v)]


def rank_units(cfg: LlamaConfig, par: Parallelism, pp_rank: int = 0,
               moe: MoE | None = None) -> list[int]:
    """ZeRO's units on this rank (`picolib.sharded_optim.split_units`): the root's own
    parameters first — the vocab-split embedding on the first stage, the final norm and the
    vocab-split head on the last — then one unit per block."""
    check(cfg, par, moe)
    stages = rank_layers(cfg, par, pp_rank)
    n_stages, counts = par.pp * par.v, stage_layers(cfg.n_layers, par.pp * par.v)
    h, v = cfg.hidden, cfg.vocab_size
    root = (v * h // par.tp if 0 in stages else 0) + \
        (h + v * h // par.tp if n_stages - 1 in stages else 0)
    block = layer_numel(cfg, par.tp, moe, par.ep)
    return ([root] if root else []) + [block] * sum(counts[s] for s in stages)


# --------------------------------------------------------------------------- activations

def layer_activation_bytes(cfg: LlamaConfig, par: Parallelism) -> int:
    """Bytes one block saves for backward for one micro-batch on one rank (cp splits the
    sequence; recomputation: "full" keeps the block input only, "selective" drops the s×s
    scores (picolib: softmax and mask, lesson 01))."""
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
    """Each rank's ops of picolib's schedule as (kind, stage) pairs (cached)."""
    sched = make_schedule(name, p, m, v)
    return tuple(tuple((op.kind, op.stage) for op in ops) for ops in sched.ops)


@lru_cache(maxsize=4096)
def _pp_messages(name: str, p: int, m: int, v: int, rank: int) -> int:
    """Messages rank `rank` sends: one per forward of a stage that is not last, one per
    backward (BW, or B of a split backward) of a stage that is not first."""
    last = p * v - 1
    return sum(1 for kind, stage in _ops(name, p, m, v)[rank]
               if (kind == "F" and stage != last) or (kind in ("BW", "B") and stage != 0))


def in_flight(schedule: str, p: int, m: int, v: int = 1, stage_bytes=None) -> list:
    """Per rank, the most micro-batch activations held at once, walking picolib's schedule:
    a forward (F) saves its stage's activations, the backward (BW, or B of a split
    backward) frees them. `stage_bytes[s]`: bytes per micro-batch of stage s (default 1:
    a count of micro-batch-stages)."""
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
    return out


def _activations(cfg, par, pp_rank):
    n_stages = par.pp * par.v
    counts = stage_layers(cfg.n_layers, n_stages)
    layer = layer_activation_bytes(cfg, par)
    first, last = _end_bytes(cfg, par)
    stage_bytes = [counts[s] * layer + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)
                   for s in range(n_stages)]
    if par.recompute == "full":   # backward recomputes one block at a time: its full bytes
        working = layer_activation_bytes(cfg, par.replace(recompute="none"))
    else:
        working = 0
    if par.pp == 1:
        return stage_bytes[0] + working
    return in_flight(par.schedule, par.pp, par.micro_batches, par.v, tuple(stage_bytes))[pp_rank] + working


# --------------------------------------------------------------------------- memory

def memory(cfg: LlamaConfig, par: Parallelism, pp_rank: int | None = None,
           moe: MoE | None = None) -> dict:
    """Bytes one rank holds at its peak: {"params", "grads", "optimizer", "activations",
    "total"}. Adam; fp32: 4 + 4 + 8 bytes per parameter, bf16/fp8: 2 + 2 + (4 master + 8)
    (`picolib.memory.bytes_per_param`); ZeRO shards over the dp·cp ranks
    (`zero_memory_bytes`, padded per unit as picolib pads; stage 0 = DDP, unpadded). With
    m > 1 micro-batches, ZeRO-2/3 hold the whole gradient too while they accumulate (as
    picolib/zero.py does: one reduce-scatter per step, not one per micro-batch).
    pp_rank None: the larger of the first and the last pipeline rank."""
    check(cfg, par, moe)
    if pp_rank is None:   # the first rank holds the most in flight, the last the head
        return max((memory(cfg, par, r, moe) for r in {0, par.pp - 1}), key=lambda d: d["total"])
    units = rank_units(cfg, par, pp_rank, moe)
    parts = bytes_per_param("fp32" if par.precision == "fp32" else "bf16", par.fp32_grad_accum)
    p, g = parts["params"], parts["grads"] + parts.get("fp32_grads", 0)
    k = optimizer_state_factor("adam", master=par.precision != "fp32")
    n = par.dp * par.cp
    if par.zero == 0:
        psi = sum(units)
        out = {"params": p * psi, "grads": g * psi, "optimizer": k * psi}
    else:
        out = zero_memory_bytes(par.zero, units, n, k, param_bytes=p, grad_bytes=g)
        if par.zero >= 2 and par.micro_batches > 1:   # picolib accumulates whole gradients
            out["grads"] += g * sum(units)             # until the step's last backward
    out["activations"] = _activations(cfg, par, pp_rank)
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------- traffic

def _tp_bytes(cfg, par, first, last, layers):
    """Bytes a TP rank sends per micro-batch (forward + backward), lesson 04/05's collectives."""
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
    if not par.sp:   # f and g: 4 all-reduces a block; the embedding's g; the head's f
        return layers * (4 * ar + kv) + (ar if first else 0) + (ar if last else 0) + loss
    norm = ring_sent_bytes("all_reduce", h * pe, t)
    block = 2 * ag + 2 * rs + 4 * ag + 2 * rs + 2 * norm + kv     # forward | backward (re-gather)
    return layers * block + ((rs + ag) if first else 0) + ((2 * ag + rs + norm) if last else 0) + loss


def traffic(cfg: LlamaConfig, par: Parallelism, pp_rank: int = 0, moe: MoE | None = None,
            bucket_numels: list | None = None) -> dict:
    """Bytes one rank sends in one step, by the ring formulas `picolib.comm.Ledger` records:
    {"dp", "tp", "pp", "cp", "ep", "total"}.
    dp: DDP all-reduces each gradient bucket, 2(N−1)/N·B (`bucket_numels`, default one
    bucket of all the rank's parameters); ZeRO-1/2 reduce-scatter + all-gather every unit,
    ZeRO-3 one more all-gather (`zero_traffic_bytes`); over the dp·cp ranks, in the compute
    dtype. tp: per micro-batch, TP's 4 all-reduces of (b, s, h) a block or SP's
    all-gathers and reduce-scatters, plus the embedding, the head and the vocab-parallel
    loss (3 all-reduces of (b, s) fp32). pp: one (b, s/sp, h) activation per forward of a
    stage that is not last and one gradient per backward of a stage that is not first,
    counted on the schedule. cp (ring attention): K and V pass cp−1 hops forward; backward
    passes K, V cp−1 hops and dK, dV cp hops. ep: dispatch and combine all-to-alls forward
    and backward, k·tokens·h each, (ep−1)/ep leaving the rank (even routing: exact when
    every token goes to every expert, an expectation otherwise), and the tokens-per-expert
    counts exchanged before each dispatch (int64, forward only)."""
    check(cfg, par, moe)
    units = rank_units(cfg, par, pp_rank, moe)
    stages = rank_layers(cfg, par, pp_rank)
    n_stages = par.pp * par.v
    layers = sum(stage_layers(cfg.n_layers, n_stages)[s] for s in stages)
    m, e = par.micro_batches, elem_bytes(par.precision)
    n = par.dp * par.cp
    gdt = 4 if par.precision == "fp32" else 2
    if par.zero == 0:
        dp = zero_traffic_bytes(0, bucket_numels or [sum(units)], n, gdt)
    else:
        dp = zero_traffic_bytes(par.zero, units, n, gdt)
    first, last = 0 in stages, n_stages - 1 in stages
    tp = m * _tp_bytes(cfg, par, first, last, layers)
    s, b, h = par.seq // par.cp, par.micro_batch_size, cfg.hidden
    act = b * (s // (par.tp if par.sp else 1)) * h * e
    pp = act * _pp_messages(par.schedule, par.pp, m, par.v, pp_rank) if par.pp > 1 else 0
    cp = 0
    if par.cp > 1:
        kv_local, _ = kv_heads_per_rank(cfg.n_heads, cfg.n_kv_heads, par.tp)
        block = b * kv_local * s * cfg.head_dim * e         # one K (or V) block of s/cp tokens
        cp = m * layers * (2 * (par.cp - 1) + 2 * (par.cp - 1) + 2 * par.cp) * block
    ep = 0
    if moe is not None and par.ep > 1:
        tokens = b * s // (par.tp if par.sp else 1)
        ep = m * layers * 4 * (moe.top_k * tokens * h * e) * (par.ep - 1) // par.ep
        ep += m * layers * (par.ep - 1) * (moe.n_experts // par.ep) * 8   # the int64 counts, forward
    out = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    out["total"] = sum(out.values())
    return out
