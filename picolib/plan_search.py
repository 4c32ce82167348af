"""Step time, MFU, and a search over configurations (lesson 11).

What: `step_time` prices one training step of a `picolib.planner.Parallelism` on a
`picolib.hardware` preset — compute at an assumed fraction of the dense peak, the
pipeline bubble of its schedule, the collectives on the critical path (TP, CP, EP, the
pipeline's sends) and the data-parallel traffic left over after it overlaps the backward
— and the MFU that follows; `search` enumerates the configurations of a model on N GPUs
at a global batch, keeps those that fit in memory and ranks them by step time; `describe`
prints one plan.
Why: the planner's bytes (picolib/planner.py) are exact; turning bytes into seconds needs
assumptions, and they are all here, named: `efficiency` (the fraction of the dense peak the
matmuls reach, 0.6 unless given), α per collective step (`hardware.ALPHA`), ring
collectives at each GPU's own link bandwidth, data-parallel traffic overlapped with the
backward (two thirds of the compute). Use the times to compare configurations, not as
promises.
"""
from __future__ import annotations

import itertools

from .hardware import ALPHA, hardware
from .memory import hardware_flops, model_flops
from .model import LlamaConfig, param_count
from .pipeline_schedules import bubble_formula
from .planner import MoE, Parallelism, layer_numel, memory, traffic

__all__ = ["active_params", "tp_comm_ratio", "step_time", "search", "describe"]


def active_params(cfg: LlamaConfig, moe: MoE | None = None) -> float:
    """Parameters a token passes through (6N FLOPs per token use these): all of a dense
    model; for a MoE the k routed and the shared experts of each layer."""
    n = param_count(cfg)
    if moe is None:
        return n
    dense_mlp = 3 * cfg.hidden * cfg.ffn_hidden
    per_token = 3 * cfg.hidden * moe.expert_ffn * (moe.top_k + moe.shared) + cfg.hidden * moe.n_experts
    return n + cfg.n_layers * (per_token - dense_mlp)


def tp_comm_ratio(cfg: LlamaConfig, tp: int, hw="H100-SXM", *, collectives: float = 8.0,
                  flops: float | None = None, dtype_bytes: int = 2, overlap: float = 0.0) -> dict:
    """Tensor parallelism's collective time per layer against the compute it splits
    (lessons 05, 10, 11): one function, every assumption a named argument.

    `collectives` counts a layer's activation collectives in units of (tp−1)/tp · T·h
    elements sent per rank: 8 for plain TP (four ring all-reduces of 2(tp−1)/tp each), 10
    for TP+SP with the backward re-gather (six all-gathers, four reduce-scatters; lesson 10
    measures 10.03 with the norms' small all-reduces). `flops` is the rate the matmuls run at
    (the dense bf16 peak unless given; lesson 05 uses 450e12, 45 % MFU). The link is the
    per-GPU bandwidth of a group of `tp` ranks on `hw` (NVLink inside a node). `overlap` is
    the fraction of the collective time hidden behind compute (0: an upper bound).
    The ratio does not depend on the tokens per micro-batch: both sides are linear in them."""
    hw = hardware(hw)
    if tp < 2:
        raise ValueError(f"tp must be at least 2 for a collective to cost anything, not {tp}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], not {overlap}")
    rate = hw.bf16 if flops is None else flops
    tokens = 1
    comm = collectives * (tp - 1) / tp * tokens * cfg.hidden * dtype_bytes / hw.link(tp)
    compute = 6 * layer_numel(cfg) * tokens / tp / rate
    exposed = comm * (1 - overlap)
    return {"link": hw.link(tp), "flops": rate, "comm_per_token": comm,
            "compute_per_token": compute, "ratio": exposed / compute}


def step_time(cfg: LlamaConfig, par: Parallelism, hw="H100-SXM", moe: MoE | None = None,
              efficiency: float = 0.6, alpha: float = ALPHA) -> dict:
    """Seconds of one step, its parts, tokens/s and MFU (model FLOPs 6N per token over
    step time × GPUs × dense peak). Compute runs at `efficiency` × peak (8N per token with
    full recomputation: HFU, lesson 01); the bubble is the schedule's (p−1)/(v·m)
    (ZB-H1: its own formula at F = B = W); TP/CP/EP/PP bytes are on the critical path at the
    per-GPU bandwidth of their group (NVLink inside a node); DP bytes overlap the backward."""
    hw = hardware(hw)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], not {efficiency}")
    sent = traffic(cfg, par, 0, moe)
    tokens = par.dp * par.micro_batches * par.micro_batch_size * par.seq
    n_act, gpus, peak = active_params(cfg, moe), par.n_gpus, hw.peak(par.precision)
    compute = hardware_flops(n_act, tokens, "full" if par.recompute == "full" else "none") \
        / gpus / (peak * efficiency)
    if par.pp == 1:
        bubble = 0.0
    elif par.schedule == "zb_h1":
        bubble = bubble_formula(par.pp, par.micro_batches, schedule="zb_h1")
    else:
        bubble = bubble_formula(par.pp, par.micro_batches, par.v)
    m = par.micro_batches
    calls = (10 if par.sp else 4) * -(-cfg.n_layers // par.pp) * m if par.tp > 1 else 0
    t_tp = sent["tp"] / hw.link(par.tp) + calls * alpha
    t_cp = sent["cp"] / hw.link(par.cp, stride=par.tp)
    t_ep = sent["ep"] / hw.link(par.ep, stride=par.tp * par.cp)
    t_pp = sent["pp"] / hw.link(par.pp, stride=par.tp * par.cp * par.dp) if par.pp > 1 else 0.0
    t_dp = sent["dp"] / hw.link(par.dp * par.cp, stride=par.tp) if par.dp * par.cp > 1 else 0.0
    exposed_dp = max(0.0, t_dp - 2 / 3 * compute)
    total = compute * (1 + bubble) + t_tp + t_cp + t_ep + t_pp + exposed_dp
    mfu = model_flops(n_act, tokens) / (total * gpus * peak)
    return {"seconds": total, "compute": compute, "bubble": compute * bubble, "tp": t_tp,
            "cp": t_cp, "ep": t_ep, "pp": t_pp, "dp": t_dp, "dp_exposed": exposed_dp,
            "tokens_per_s": tokens / total, "mfu": mfu}


# Ways to save memory, the cheapest first in this cost model: ZeRO-1/2 and selective
# recomputation (with flash attention) cost no time here, ZeRO-3 one more all-gather,
# full recomputation a third more compute. The search keeps the first that fits.
_CHEAPEST_FIRST = [(0, "none"), (1, "none"), (2, "none"), (0, "selective"), (1, "selective"),
                   (2, "selective"), (3, "none"), (3, "selective"), (0, "full"), (1, "full"),
                   (2, "full"), (3, "full")]


def _divisors(n: int, upto: int) -> list[int]:
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def search(cfg: LlamaConfig, n_gpus: int, global_batch: int, seq: int, hw="H100-SXM",
           moe: MoE | None = None, top: int = 5, usable: float = 0.9, efficiency: float = 0.6,
           precision: str = "bf16", max_pp: int = 32, max_cp: int = 1,
           activations: str = "korthikanti") -> list[dict]:
    """The `top` fastest configurations of `cfg` on `n_gpus` GPUs for a step of
    `global_batch` sequences of `seq` tokens whose per-rank memory (every pipeline rank)
    fits in `usable` × the GPU's memory (the rest: allocator, buffers, workspace — an
    assumption). Tries tp ≤ node (with SP), pp | layers (1F1B; interleaved v=2 where it
    applies), cp ≤ `max_cp` (1: context parallelism is for long sequences), micro-batch
    1, 2, 4; for each, the cheapest of ZeRO 0-3 × recomputation
    none / selective / full that fits (`_CHEAPEST_FIRST`). `activations`: the planner's
    activation count; with "picolib" (the Llama block picolib runs, measured) recompute
    "none" would keep the eager s×s scores that a flash kernel never saves, so the ladder
    starts at "selective" (the scores recomputed in backward, as flash attention does).
    Each result: {"par", "memory" (the worst rank), "time" (step_time)}."""
    hw = hardware(hw)
    if n_gpus < 1 or global_batch < 1 or seq < 1:
        raise ValueError(f"n_gpus, global_batch and seq must be positive; got {n_gpus}, "
                         f"{global_batch}, {seq}")
    budget, found = usable * hw.memory, []
    ladder = [(z, r) for z, r in _CHEAPEST_FIRST if activations != "picolib" or r != "none"]
    tps = [t for t in _divisors(n_gpus, hw.node) if t in (1, 2, 4, 8, 16, 32, 64)]
    pps = sorted(set(_divisors(cfg.n_layers, max_pp)) | {2 ** i for i in range(6) if 2 ** i <= max_pp})
    for tp, cp, pp, mbs in itertools.product(tps, _divisors(n_gpus, max_cp), pps, (1, 2, 4)):
        if n_gpus % (tp * cp * pp) or global_batch % (n_gpus // (tp * cp * pp) * mbs):
            continue
        dp = n_gpus // (tp * cp * pp)
        m = global_batch // (dp * mbs)
        scheds = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and m % pp == 0
                                  and cfg.n_layers >= 2 * pp else [])
        for name, v in scheds:
            base = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, ep=1 if moe is None else min(dp, 8),
                               sp=tp > 1, schedule=name, v=v, micro_batches=m,
                               micro_batch_size=mbs, seq=seq, precision=precision,
                               activations=activations)
            for zero, rec in ladder:
                if zero == 3 and pp > 1:
                    continue
                par = base.replace(zero=zero, recompute=rec)
                try:
                    mem = memory(cfg, par, moe=moe)
                except ValueError:
                    break
                if mem["total"] <= budget:
                    found.append({"par": par, "memory": mem,
                                  "time": step_time(cfg, par, hw, moe, efficiency)})
                    break
    found.sort(key=lambda r: r["time"]["seconds"])
    return found[:top]


def describe(cfg: LlamaConfig, par: Parallelism, hw="H100-SXM", moe: MoE | None = None,
             efficiency: float = 0.6) -> str:
    """A plan in a few lines: degrees, memory of the worst rank, step time and MFU."""
    hw = hardware(hw)
    mem, t = memory(cfg, par, moe=moe), step_time(cfg, par, hw, moe, efficiency)
    gb = {k: v / 1e9 for k, v in mem.items()}
    sched = f"{par.schedule}{f' v={par.v}' if par.v > 1 else ''}, " if par.pp > 1 else ""
    return (f"{par.n_gpus} × {hw.name}: TP{par.tp}{'+SP' if par.sp else ''} PP{par.pp} CP{par.cp} "
            f"DP{par.dp} (ZeRO-{par.zero}), {sched}m={par.micro_batches} × {par.micro_batch_size} "
            f"× {par.seq} tokens, recompute={par.recompute}\n"
            f"  memory per GPU (worst rank): params {gb['params']:.1f} + grads {gb['grads']:.1f} + "
            f"optimizer {gb['optimizer']:.1f} + activations {gb['activations']:.1f} = "
            f"{gb['total']:.1f} GB of {hw.memory / 1e9:.0f}\n"
            f"  step {t['seconds']:.2f} s (compute {t['compute']:.2f}, bubble {t['bubble']:.2f}, "
            f"TP {t['tp']:.2f}, exposed DP {t['dp_exposed']:.2f}, PP {t['pp']:.3f}); "
            f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} (at efficiency {efficiency})")
