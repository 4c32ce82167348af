"""The planner against published training runs (lesson 11b): `RUNS`, `predict`, `table`.

Each run is a published layout and its published throughput, in the source's own convention,
converted here to one common quantity — tokens per second per GPU — by the source's own FLOP
formula (`published_tokens_per_s`). The planner (`plan_search.step_time` with every op on the
roofline of the run's hardware preset) predicts the same quantity; `table` gives both and the
error. Nothing is fitted: the presets' efficiencies are measurements with their sources
(picolib/hardware.py), and the runs are the sources' numbers. `by_term` gives the table's mean
and worst error with each term of the time model (`TERMS`) switched on in turn (lesson 11b §3).

Conventions converted:
- Llama 3 report, Table 4: BF16 TFLOP/s per GPU; the FLOP count is not stated — picolib's
  (`model_flops_per_token`: 6N + the causal attention core) is the one under which lesson 11b
  finds all three rows consistent.
- Narayanan et al. 2021, Table 1: TFLOP/s per GPU counting the recomputed forward, F = 96·B·s·l·h²
  (1 + s/6h + V/16lh) per iteration (their eq. 3).
- Korthikanti et al. 2022, Table 5 (the Megatron-LM README repeats it): model FLOPs utilization
  of the A100's 312 TFLOP/s, model FLOPs 72·B·s·l·h²(1 + s/6h + V/12lh) per iteration.
- DeepSeek-V3 report, §1: 180K H800 GPU hours per trillion training tokens.
- BLOOM's training README (its log line at the end of the first epoch), MT-NLG's paper (§2.4)
  and the Nemotron-4 340B report (Table 2): seconds per iteration, the global batch's tokens
  in that time (no FLOP formula needed; the test checks each source's own TFLOP/s or MFU
  against it).
GPT shapes (Narayanan, Korthikanti: 4h GeLU MLP, multi-head attention, vocabulary 51,200,
2,048-token sequences, dropout) are counted (memory, parameters, model FLOPs) as a Llama block
of the same weights — a SwiGLU of inner size 8h/3 (rounded to a multiple of 64) has the 8h²
weights and FLOPs of the 4h GeLU MLP — and timed as GPT's own block (`block="gpt"` of
`layer_costs.layer_ops`: LayerNorm, biases, the GeLU MLP, no RoPE). DeepSeek-V3 is counted as a
Llama block of its hidden size and heads, timed with its latent attention (`mla`), its memory
held as its report says it held it (`held`: `planner.HeldAs`, `run_memory`). BLOOM and MT-NLG
are GPT shapes too (BLOOM with its own vocabulary; its ALiBi biases are not priced), Nemotron-4's
squared-ReLU MLP (two matrices of 4h) a SwiGLU of the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .model import LlamaConfig
from .planner import HeldAs, MoEShape, Parallelism, LLAMA3_405B, memory
from .layer_costs import MLAShape

__all__ = ["Run", "RUNS", "gpt", "published_tokens_per_s", "predict", "run_memory", "table", "markdown",
           "TERMS", "term_presets", "by_term"]


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200) -> LlamaConfig:
    """A GPT-3-style shape (Megatron's runs) as the Llama block of the same weights."""
    return LlamaConfig(vocab_size=vocab, hidden=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_hidden=round(8 * hidden / 3 / 64) * 64, max_seq=2048)


@dataclass(frozen=True)
class Run:
    name: str
    source: str              # a name of docs/sources.md, with the table
    cfg: LlamaConfig
    par: Parallelism
    hw: str
    published: float         # in the source's unit
    unit: str                # "TFLOP/s (causal)", "TFLOP/s (Megatron, recomputed)", "MFU (Megatron)",
                             # "GPU hours per 1e12 tokens", "s per iteration"
    moe: MoEShape | None = None
    options: dict = field(default_factory=dict)   # step_time's keywords (block, mla, dp_overlap, ...)
    held: HeldAs | None = None                    # how the run held its memory (planner.memory's `held`)

    @property
    def gpus(self) -> int:
        return self.par.n_gpus

    @property
    def tokens(self) -> int:
        return self.par.dp * self.par.micro_batches * self.par.micro_batch_size * self.par.seq


def published_tokens_per_s(run: Run) -> float:
    """The run's published throughput as tokens per second per GPU, by its source's formula."""
    from .plan_search import model_flops_per_token
    c, s = run.cfg, run.par.seq
    b = run.tokens / s
    l, h, v = c.n_layers, c.hidden, c.vocab_size
    if run.unit == "TFLOP/s (causal)":
        return run.published * 1e12 / model_flops_per_token(c, s, run.moe)
    if run.unit == "TFLOP/s (Megatron, recomputed)":
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return run.tokens / (flops / (run.published * 1e12 * run.gpus)) / run.gpus
    if run.unit == "MFU (Megatron)":
        flops = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        return run.tokens / (flops / (run.published * 312e12 * run.gpus)) / run.gpus
    if run.unit == "GPU hours per 1e12 tokens":
        return 1e12 / (run.published * 3600)
    if run.unit == "s per iteration":
        return run.tokens / (run.published * run.gpus)
    raise ValueError(f"unknown unit {run.unit!r}")


def predict(run: Run, hw=None, **kw) -> dict:
    """`step_time` of the run on its preset, or on `hw` (keywords override the run's options)."""
    from .plan_search import step_time
    return step_time(run.cfg, run.par, run.hw if hw is None else hw, run.moe, **{**run.options, **kw})


_LLAMA = dict(tp=8, pp=16, sp=True, zero=1, schedule="interleaved", chunks=2)
_MEGATRON = dict(flash=False, zero=0, activations="korthikanti")
_GPT = {"dropout": True, "block": "gpt"}
# Narayanan et al.'s Table 1 as Megatron-LM's scripts rerun it (Megatron-LM code, docs/sources.md:
# examples/sc21/run_table_1.sh): the micro-batch sizes, interleaving for 145.6B, and the DDP: "torch"
# (the all-reduce overlaps the last backward) up to 18.4B, "local" above — train_step all-reduces
# after the last micro-batch's backward, none of it overlapped
_LOCAL_DDP = {**_GPT, "dp_overlap": False}
_NARAYANAN = dict(recompute="full", seq=2048, **_MEGATRON)
_KORTHIKANTI = dict(recompute="selective", sp=True, seq=2048, **_MEGATRON)
# DeepSeek-V3's config (DeepSeek-V3 report, §4.2; DeepSeek-V3 repository, config_671B.json):
# 61 layers, the first 3 dense with an 18,432 SwiGLU (= 9 × 2,048: the FLOPs of a MoE layer's 8 routed
# and 1 shared experts, so all 61 are timed as MoE layers), MLA with 128 heads, one MTP module (§2.2)
_DS = LlamaConfig(vocab_size=129280, hidden=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_hidden=18432)
_MLA = MLAShape(q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128)

# How DeepSeek-V3 held its memory (DeepSeek-V3 report §3.3.2-§3.3.3, Figure 6; planner.HeldAs)
_DS_HELD = HeldAs(mla=_MLA, fp8_cache=True, recompute_norm_up=True, bf16_moments=True, fp32_grads=True,
                  comm_buffers=True)
# BLOOM (BigScience's tr11-176B-ml README and slurm script, docs/sources.md): 70 layers of 14,336, 112
# heads, the vocabulary padded to 250,880, 2,048 tokens; TP4 PP12 DP8 on 384 A100 80GB, micro-batch 2 of
# a 2,048-sequence batch, bf16 with DeepSpeed's BF16_Optimizer (its own ZeRO-1), full activation
# checkpointing, Megatron's dropouts; DeepSpeed's pipeline (1F1B) reduces the gradients after the last
# micro-batch. Its Omni-Path network (4 × 100 Gb/s a node) is slower than the A100 preset's.
_BLOOM = gpt(14336, 70, 112, vocab=250880)
_DEEPSPEED = {**_NARAYANAN, "zero": 1}
# MT-NLG 530B (Smith et al. 2022, §2.4): 105 layers of 20,480, 128 heads, batch 1,920 of 2,048 tokens;
# TP8 × PP35 a replica on DGX A100s, DeepSpeed's pipeline; its TFLOP/s (126, 121, 113) count the
# recomputed forward, Narayanan's 96·B·s·l·h² (the test checks them against the iteration times)
# Nemotron-4 340B (NVIDIA 2024, §2.2 and Table 2): 96 layers of 18,432, 96 heads with 8 KV heads, a
# squared-ReLU MLP of 73,728 (as a SwiGLU of 49,152: the same weights), vocabulary 256,000, 4,096 tokens;
# TP8, PP12 with interleaving, DP 16 → 64 as the batch ramps (768, 1,536, 2,304 sequences), a
# distributed optimizer (ZeRO-1). The report does not state the interleaving depth: one layer a chunk
# (8 chunks) assumed; no recomputation assumed
_NEMOTRON = LlamaConfig(vocab_size=256000, hidden=18432, n_layers=96, n_heads=96, n_kv_heads=8,
                        ffn_hidden=49152, max_seq=4096)
_NEMOTRON_LAYOUT = dict(tp=8, pp=12, sp=True, zero=1, schedule="interleaved", chunks=8, seq=4096)

RUNS = (
    Run("Llama 3 405B, 8,192 GPUs, 8k", "Llama 3 report, Table 4", LLAMA3_405B,
        Parallelism(dp=64, micro_batches=32, seq=8192, **_LLAMA), "H100-SXM", 430, "TFLOP/s (causal)"),
    Run("Llama 3 405B, 16,384 GPUs, 8k", "Llama 3 report, Table 4", LLAMA3_405B,
        Parallelism(dp=128, micro_batches=16, seq=8192, **_LLAMA), "H100-SXM", 400, "TFLOP/s (causal)"),
    Run("Llama 3 405B, 16,384 GPUs, 131k", "Llama 3 report, Table 4", LLAMA3_405B,
        Parallelism(dp=8, cp=16, micro_batches=16, seq=131072, **_LLAMA), "H100-SXM", 380, "TFLOP/s (causal)"),
    Run("GPT 1.7B, 32 GPUs", "Narayanan et al., Table 1", gpt(2304, 24, 24),
        Parallelism(dp=32, micro_batch_size=16, **_NARAYANAN), "A100-SXM", 137,
        "TFLOP/s (Megatron, recomputed)", options=_GPT),
    Run("GPT 7.5B, 128 GPUs", "Narayanan et al., Table 1", gpt(4096, 36, 32),
        Parallelism(dp=32, tp=4, micro_batch_size=16, **_NARAYANAN), "A100-SXM", 142,
        "TFLOP/s (Megatron, recomputed)", options=_GPT),
    Run("GPT 18.4B, 256 GPUs", "Narayanan et al., Table 1", gpt(6144, 40, 48),
        Parallelism(dp=32, tp=8, micro_batch_size=8, micro_batches=4, **_NARAYANAN), "A100-SXM", 135,
        "TFLOP/s (Megatron, recomputed)", options=_GPT),
    Run("GPT 145.6B, 1,536 GPUs", "Narayanan et al., Table 1", gpt(12288, 80, 96),
        Parallelism(dp=24, tp=8, pp=8, micro_batch_size=2, micro_batches=48, schedule="interleaved", chunks=2,
                    **_NARAYANAN), "A100-SXM", 148, "TFLOP/s (Megatron, recomputed)", options=_LOCAL_DDP),
    Run("GPT 1T, 3,072 GPUs", "Narayanan et al., Table 1", gpt(25600, 128, 160),
        Parallelism(dp=6, tp=8, pp=64, micro_batches=512, **_NARAYANAN), "A100-SXM", 163,
        "TFLOP/s (Megatron, recomputed)", options=_LOCAL_DDP),
    Run("GPT 22B, 8 GPUs", "Korthikanti et al., Table 5", gpt(6144, 48, 64),
        Parallelism(tp=8, micro_batch_size=4, **_KORTHIKANTI), "A100-SXM", 0.415, "MFU (Megatron)",
        options=_GPT),
    Run("GPT 175B, 64 GPUs", "Korthikanti et al., Table 5", gpt(12288, 96, 96),
        Parallelism(tp=8, pp=8, micro_batches=64, **_KORTHIKANTI), "A100-SXM", 0.514, "MFU (Megatron)",
        options=_GPT),
    Run("GPT 530B, 280 GPUs", "Korthikanti et al., Table 5", gpt(20480, 105, 128),
        Parallelism(tp=8, pp=35, micro_batches=280, **_KORTHIKANTI), "A100-SXM", 0.560, "MFU (Megatron)",
        options=_GPT),
    Run("GPT 1T, 512 GPUs", "Korthikanti et al., Table 5", gpt(25600, 128, 160),
        Parallelism(tp=8, pp=64, micro_batches=512, **_KORTHIKANTI), "A100-SXM", 0.563, "MFU (Megatron)",
        options=_GPT),
    Run("DeepSeek-V3 (MoE), 2,048 H800s", "DeepSeek-V3 report, §1", _DS,
        Parallelism(dp=128, ep=64, pp=16, micro_batches=120, seq=4096, zero=1, precision="fp8",
                    schedule="dualpipe"), "H800", 180e3, "GPU hours per 1e12 tokens",
        moe=MoEShape(n_experts=256, top_k=8, expert_ffn=2048, shared=1),
        options={"ep_nodes": 4, "mla": _MLA, "mtp": 1}, held=_DS_HELD),
    *(Run(f"BLOOM 176B, {gpus:,} GPUs", "BLOOM training README", _BLOOM,
          Parallelism(dp=gpus // 48, tp=4, pp=12, micro_batch_size=2, micro_batches=2048 // (2 * gpus // 48),
                      fp32_grad_accum=True, **_DEEPSPEED), "A100-SXM", t, "s per iteration", options=_LOCAL_DDP)
      for gpus, t in ((384, 104.70),)),
    *(Run(f"MT-NLG 530B, {gpus:,} GPUs", "MT-NLG paper, §2.4", gpt(20480, 105, 128),
          Parallelism(dp=gpus // 280, tp=8, pp=35, micro_batches=1920 // (gpus // 280), **_DEEPSPEED),
          "A100-SXM", t, "s per iteration", options=_LOCAL_DDP)
      for gpus, t in ((2240, 60.1), (2800, 50.2), (3360, 44.4))),
    *(Run(f"Nemotron-4 340B, {gpus:,} GPUs", "Nemotron-4 340B report, Table 2", _NEMOTRON,
          Parallelism(dp=gpus // 96, micro_batches=batch // (gpus // 96), **_NEMOTRON_LAYOUT),
          "H100-SXM", t, "s per iteration")
      for gpus, batch, t in ((1536, 768, 10.3), (3072, 1536, 10.3), (6144, 2304, 8.0))),
)


def run_memory(run: Run, **kw) -> dict:
    """`planner.memory` of the run's busiest rank as the run held it (its `held`), with the
    runtime's overhead (context, communicators, allocator reserve); keywords override."""
    return memory(run.cfg, run.par, moe=run.moe, **{"overhead": True, "held": run.held, **kw})


def table(runs=RUNS, presets=None, **kw) -> list[dict]:
    """Per run: {"run", "published" (tokens/s per GPU), "planner" (the same), "error"
    (planner / published − 1), "time" (step_time's dict)}; `presets` ({name: Hardware}) replaces
    the runs' presets of those names."""
    out = []
    for run in runs:
        t = predict(run, (presets or {}).get(run.hw), **kw)
        pub = published_tokens_per_s(run)
        mine = t["tokens_per_s"] / run.gpus
        out.append({"run": run, "published": pub, "planner": mine, "error": mine / pub - 1, "time": t})
    return out


def markdown(rows=None) -> str:
    """The validation table as Markdown (the README's copy is this text; a test compares)."""
    rows = table() if rows is None else rows
    lines = ["| run | source | GPUs | published, as the source states it | tokens/s per GPU, published | planner | error |",
             "|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        run = r["run"]
        stated = (f"{run.published:.1%} MFU" if run.unit == "MFU (Megatron)" else
                  f"{run.published / 1e3:.0f}K {run.unit}" if run.unit.startswith("GPU hours") else
                  f"{run.published:.1f} {run.unit}" if run.unit == "s per iteration" else
                  f"{run.published:.0f} {run.unit}")
        lines.append(f"| {run.name} | {run.source} | {run.gpus:,} | {stated} | {r['published']:,.0f} | "
                     f"{r['planner']:,.0f} | {r['error']:+.1%} |")
    return "\n".join(lines)


# The terms issue 57 added to the time model, in the order `by_term` switches them on.
TERMS = ("as before: every matmul at the best shape's rate; the A100 with Hopper's HBM and NCCL fractions",
         "+ tiles and waves: a matmul in whole waves of cuBLAS's tiles over the GPU's SMs",
         "+ the A100's own HBM fraction (a measured A100 read)",
         "+ the A100's own NCCL fraction (nccl-tests on 8 A100s)")


def term_presets(step: int, names=None) -> dict:
    """{preset name: Hardware} with the first `step` of `TERMS[1:]` switched on (0: as before
    them; len(TERMS) − 1: the presets as they are), for the presets `names` (default: the runs')."""
    from dataclasses import replace
    from .hardware import hardware
    if not 0 <= step < len(TERMS):
        raise ValueError(f"step must be in [0, {len(TERMS) - 1}], not {step}")
    hop = hardware("H100-SXM")
    out = {}
    for name in sorted(names or {r.hw for r in RUNS}):
        hw = hardware(name)
        if step < 1:
            hw = replace(hw, sms=0)
        if name == "A100-SXM" and step < 2:
            hw = replace(hw, hbm_eff=hop.hbm_eff)
        if name == "A100-SXM" and step < 3:
            hw = replace(hw, link_eff=hop.link_eff)
        out[name] = hw
    return out


def by_term(runs=RUNS) -> list[dict]:
    """The validation table with each of `TERMS` switched on in turn: per step {"term", "mean"
    (the mean signed error), "worst" (the error farthest from 0), "rows" (`table`'s)}; the
    last step is `table(runs)`."""
    out = []
    for step, term in enumerate(TERMS):
        rows = table(runs, term_presets(step, {r.hw for r in runs}))
        errors = [r["error"] for r in rows]
        out.append({"term": term, "mean": sum(errors) / len(errors), "worst": max(errors, key=abs),
                    "rows": rows})
    return out
