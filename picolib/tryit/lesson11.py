"""Lesson 11's "try it": a memory-and-throughput calculator for a Llama 3 on a cluster.

    plan_calculator(model, n_gpus, tp, pp, zero, recompute, micro_batch_size, hw)

draws each pipeline rank's bytes (parameters, gradients, optimizer state, activations of the
micro-batches its 1F1B schedule keeps in flight) against the GPU's memory, and prints the
step time and MFU of `picolib.plan_search.step_time`. tests/test_tryit_11.py checks its
bytes against a TinyLlama measured in one process and runs every knob combination.
"""
from __future__ import annotations

from ..hardware import hardware
from ..plan_search import step_time
from ..planner import LLAMA3_70B, LLAMA3_405B, Parallelism, memory
from . import rank_bars

__all__ = ["MODELS", "plan_calculator"]

MODELS = {"Llama-3-70B": LLAMA3_70B, "Llama-3-405B": LLAMA3_405B}


def plan_calculator(model="Llama-3-70B", n_gpus: int = 640, tp: int = 8, pp: int = 4,
                    zero: int = 1, recompute: str = "none", micro_batch_size: int = 1,
                    hw: str = "H100-SXM", seq: int = 4096, global_batch: int = 1280,
                    plot: bool = True, ax=None) -> dict:
    """Per pipeline rank {"params", "grads", "optimizer", "activations", "total"} bytes
    (`ranks`), whether the worst fits (`fits`), and the step time and MFU (`time`) of
    `model` (a name in MODELS or a LlamaConfig) on `n_gpus` GPUs: dp = n_gpus/(tp·pp),
    TP with SP, 1F1B with m = global_batch/(dp·mbs) micro-batches of `seq` tokens, bf16
    with Adam. A ValueError names the numbers that do not divide."""
    cfg = MODELS[model] if isinstance(model, str) else model
    if n_gpus % (tp * pp):
        raise ValueError(f"tp·pp = {tp * pp} must divide n_gpus = {n_gpus}")
    dp = n_gpus // (tp * pp)
    if global_batch % (dp * micro_batch_size):
        raise ValueError(f"dp·mbs = {dp * micro_batch_size} must divide global_batch = {global_batch}")
    par = Parallelism(dp=dp, tp=tp, pp=pp, zero=zero, sp=tp > 1, recompute=recompute, seq=seq,
                      micro_batch_size=micro_batch_size,
                      micro_batches=global_batch // (dp * micro_batch_size))
    gpu = hardware(hw)
    ranks = [memory(cfg, par, pp_rank=r) for r in range(pp)]
    worst = max(r["total"] for r in ranks)
    out = {"par": par, "ranks": ranks, "fits": worst <= gpu.memory,
           "time": step_time(cfg, par, gpu)}
    if plot:
        rank_bars(ranks, 1e9, "GB", gpu.memory / 1e9, f"{gpu.name} {gpu.memory / 1e9:.0f} GB",
                  f"{model if isinstance(model, str) else 'model'}: TP{tp} PP{pp} DP{dp} "
                  f"ZeRO-{zero}, recompute={recompute}, mbs={micro_batch_size} (computed)", ax)
    t = out["time"]
    print(f"worst rank {worst / 1e9:.1f} GB of {gpu.memory / 1e9:.0f} GB: "
          f"{'fits' if out['fits'] else 'does NOT fit'}; step {t['seconds']:.2f} s, "
          f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} (computed, efficiency 0.6 assumed)")
    return out
