"""Lesson 11's "try it": a memory-and-throughput calculator for a Llama 3 on a cluster.

    plan_calculator(model, n_gpus, tp, pp, zero, recompute, micro_batch_size, hw)

draws each pipeline rank's bytes (parameters, gradients, optimizer state, activations of the
micro-batches its 1F1B schedule keeps in flight) against the GPU's memory, and prints the
step time and MFU of `picolib.plan_search.step_time`. Activations are Llama's block as
picolib runs it (`activations="picolib"`, measured): recompute "selective" recomputes the
s×s attention scores in backward, as a flash-attention kernel does; "none" is eager
attention that keeps them; "full" keeps each block's input only.
`HINTS` are the settings the lesson's hint suggests, with what each shows;
tests/test_tryit_11.py runs every one, checks the calculator's bytes against a TinyLlama
measured in one process and runs every knob combination.
`measured_block_bytes` measures the bytes a Llama block saves for backward (lesson 11 §5).
"""
from __future__ import annotations

from ..hardware import hardware
from ..plan_search import step_time
from ..planner import LLAMA3_70B, LLAMA3_405B, Parallelism, memory
from . import rank_bars

__all__ = ["MODELS", "HINTS", "plan_calculator", "measured_block_bytes"]

MODELS = {"Llama-3-70B": LLAMA3_70B, "Llama-3-405B": LLAMA3_405B}

# The lesson's hint, step by step: (settings for plan_calculator, what they show).
_405 = dict(model="Llama-3-405B", n_gpus=1024, tp=8, zero=1, recompute="selective", global_batch=2048)
HINTS = [
    (dict(_405, pp=4), "does not fit: about 103 GB on the worst rank"),
    (dict(_405, pp=8), "fits: about 76 GB"),
    (dict(_405, pp=16), "fits: about 64 GB; parameters and gradients halve again"),
    (dict(_405, pp=16, micro_batch_size=2), "does not fit: 1F1B's in-flight activations double"),
    (dict(_405, pp=16, micro_batch_size=2, recompute="full"), "fits again, at a lower MFU"),
]


def plan_calculator(model="Llama-3-70B", n_gpus: int = 640, tp: int = 8, pp: int = 4,
                    zero: int = 1, recompute: str = "selective", micro_batch_size: int = 1,
                    hw: str = "H100-SXM", seq: int = 4096, global_batch: int = 1280,
                    activations: str = "picolib", plot: bool = True, ax=None) -> dict:
    """Per pipeline rank {"params", "grads", "optimizer", "activations", "total"} bytes
    (`ranks`), whether the worst fits (`fits`), and the step time and MFU (`time`) of
    `model` (a name in MODELS or a LlamaConfig) on `n_gpus` GPUs: dp = n_gpus/(tp·pp),
    TP with SP, 1F1B with m = global_batch/(dp·mbs) micro-batches of `seq` tokens, bf16
    with Adam, the planner's `activations` count. A ValueError names the numbers that do
    not divide."""
    cfg = MODELS[model] if isinstance(model, str) else model
    if n_gpus % (tp * pp):
        raise ValueError(f"tp·pp = {tp * pp} must divide n_gpus = {n_gpus}")
    dp = n_gpus // (tp * pp)
    if global_batch % (dp * micro_batch_size):
        raise ValueError(f"dp·mbs = {dp * micro_batch_size} must divide global_batch = {global_batch}")
    par = Parallelism(dp=dp, tp=tp, pp=pp, zero=zero, sp=tp > 1, recompute=recompute, seq=seq,
                      micro_batch_size=micro_batch_size, activations=activations,
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


def measured_block_bytes(cfg, hidden: int = 64, seq: int = 32, batch: int = 2) -> float:
    """Bytes one block of a TinyLlama with `cfg`'s proportions (F/h, query heads per KV
    head) saves for backward, per token and per unit of width — the c in c·s·h —
    measured with saved-tensor hooks in bf16, the attention scores recomputed in backward
    (picolib's selective recomputation, as a flash kernel does)."""
    import torch

    from ..memory import SavedActivations
    from ..model import LlamaConfig, TinyLlama, random_tokens
    if (cfg.ffn_hidden * hidden) % cfg.hidden or cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"width {hidden} cannot keep {cfg}'s proportions")
    small = LlamaConfig(vocab_size=64, hidden=hidden, n_layers=1, n_kv_heads=1,
                        n_heads=cfg.n_heads // cfg.n_kv_heads,
                        ffn_hidden=cfg.ffn_hidden * hidden // cfg.hidden, recompute="selective")
    model = TinyLlama(small).to(torch.bfloat16)
    x, y = random_tokens(batch, seq, small.vocab_size)
    with SavedActivations(model) as act:
        model.loss(x, y)
    block = sum(v for k, v in act.by_module.items() if k.startswith("blocks.0."))
    return block / (batch * seq * hidden)
