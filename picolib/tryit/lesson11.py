"""Lessons 11 and 11b's plumbing: `rooflines` (the critical batch of each parallelism on a GPU
and network), `plan_calculator` (a Llama 3's bytes per pipeline rank against a GPU's memory, and
the step time of `picolib.plan_search.step_time`), the rank functions and fake-process-group runs
of 11b §1, the planner beside the dry run (11 §4) and Table 4 of the Llama 3 report (11b §3).
`HINTS` and `ROOFLINE_HINTS` are the hints' settings (tests/lessons/test_tryit_11.py runs them).
"""
from __future__ import annotations

from ..hardware import hardware
from ..model import param_count
from ..plan_search import model_flops_per_token, step_time
from ..planner import LLAMA3_70B, LLAMA3_405B, Parallelism, memory
from ..memory import rank_bars

__all__ = ["MODELS", "HINTS", "ROOFLINE_HINTS", "rooflines", "plan_calculator", "measured_block_bytes", "zero_step", "tp_sp_step",
           "pipeline_step", "fake_pg_traffic", "plot_all_reduce", "plot_candidates", "trainer_vs_planner",
           "dry_vs_planner", "show_dry_vs_planner", "TABLE4", "price_table4",
           "tokens_through_a_stage_copy"]

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


# Lesson 11's hint: (settings for rooflines, what they show).
ROOFLINE_HINTS = [
    (dict(hw="H100-SXM"), "DP about 1,236 tokens per GPU across 1,024 GPUs; the MoE about 4,945 at EP 64"),
    (dict(hw="H100-SXM", ep=8), "EP 8 stays in a node: the MoE needs about 39,560, 8x more"),
    (dict(hw="GB200-NVL72"), "2.5x the FLOPs: DP about 1,389 in the rack and across racks; TP at most 6-way"),
    (dict(hw="H100-SXM", ffn_hidden=8192), "F = 8,192: TP at most 4-way"),
]


def rooflines(hw: str = "H100-SXM", n_gpus: int = 1024, ffn_hidden: int = 16384, hidden: int = 8192,
              n_experts: int = 256, top_k: int = 8, ep: int = 64, plot: bool = True, ax=None) -> dict:
    """Lesson 11's try-it: tokens per GPU above which each kind of parallelism hides its
    communication behind its matmuls on `hw` (computed, bf16): DP inside one node, DP and
    FSDP over `n_gpus`, a MoE of `n_experts` (top-`top_k`) with `ep`-way expert parallelism
    (`n_gpus // ep` copies of each expert); TP's largest degree for `ffn_hidden` and PP's
    smallest stage for `hidden`. Returns them as a dict; draws the tokens on a log axis."""
    from ..hardware import (critical_tokens_dp, critical_tokens_moe, max_tp_degree,
                            pp_min_stage_params)
    gpu = hardware(hw)
    if n_gpus % ep:
        raise ValueError(f"ep = {ep} must divide n_gpus = {n_gpus}")
    tokens = {f"DP, one node ({gpu.node} GPUs)": critical_tokens_dp(gpu, gpu.node),
              f"DP, {n_gpus:,} GPUs": critical_tokens_dp(gpu, n_gpus),
              f"FSDP, {n_gpus:,} GPUs": critical_tokens_dp(gpu, n_gpus, fsdp=True),
              f"MoE {n_experts}/{top_k}, EP {ep}": critical_tokens_moe(gpu, max(1, n_gpus // ep), n_experts,
                                                                      top_k, ep=ep)}
    out = {"tokens": tokens, "tp": max_tp_degree(gpu, ffn_hidden), "pp": pp_min_stage_params(gpu, hidden)}
    if plot:
        import matplotlib.pyplot as plt

        from ..style import PARALLELISM
        created = ax is None
        if created:
            _, ax = plt.subplots(figsize=(8, 3))
        colors = [PARALLELISM["DP"], PARALLELISM["DP"], PARALLELISM["DP"], PARALLELISM["EP"]]
        low = min(tokens.values()) / 2           # bars start here: a log axis has no 0
        values = list(tokens.values())[::-1]
        ax.barh(list(tokens)[::-1], [v - low for v in values], left=low, color=colors[::-1])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=9)
        ax.set_xscale("log")
        ax.set_xlim(low, max(tokens.values()) * 8)
        ax.set(xlabel="tokens per GPU per step (log scale)",
               title=f"{gpu.name}: tokens each parallelism needs to hide its communication (computed)")
        ax.title.set_fontsize(10)
        if created:
            ax.figure.tight_layout()
            plt.show()
    for name, v in tokens.items():
        print(f"{name:28s} {v:10,.0f} tokens per GPU")
    print(f"TP for F = {ffn_hidden:,}: at most {out['tp']}-way in a node; PP for h = {hidden:,}: "
          f"a stage needs > {out['pp'] / 1e6:,.0f} M parameters")
    return out


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
          f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} (computed, matmuls on the roofline)")
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


# ------------------------------------------------------------------ §4: the planner vs runs

def zero_step(cfg, stage: int, mbs: int, seq: int):
    """One ZeRO step on this rank, its collectives on picolib's rings: (the model state ZeRO
    holds, the ledger's records as dicts — every one counted as sent, `measured=True`)."""
    import torch.distributed as dist

    from .. import comm
    from ..model import TinyLlama, random_tokens
    from ..zero import ZeRO
    model = TinyLlama(cfg)
    z = ZeRO(model, stage)
    x, y = random_tokens(mbs, seq, cfg.vocab_size, seed=dist.get_rank())
    with comm.Ledger(rings=True) as led:
        model.loss(x, y).backward()
        z.step()
    return z.memory(), led.as_dicts()


def tp_sp_step(cfg, mbs: int, seq: int):
    """One TP+SP forward and backward on this rank, on picolib's rings: (parameter bytes,
    bytes block 0 saves for backward, the ledger's records as dicts)."""
    from .. import comm
    from ..memory import SavedActivations, param_bytes
    from ..model import TinyLlama, random_tokens
    from ..tensor_parallel import apply_tensor_parallel
    model = apply_tensor_parallel(TinyLlama(cfg), sequence_parallel=True)
    x, y = random_tokens(mbs, seq, cfg.vocab_size, seed=1)
    with comm.Ledger(rings=True) as led, SavedActivations(model) as act:
        model.loss(x, y).backward()
    block = sum(v for k, v in act.by_module.items() if k.startswith("blocks.0."))
    return param_bytes(model), block, led.as_dicts()


def pipeline_step(cfg, m: int, mbs: int, seq: int):
    """One 1F1B step of m micro-batches on this rank: (the peak bytes of saved activations,
    the ledger's point-to-point records as dicts — each a `send` of the tensor handed to it)."""
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..memory import SavedActivations
    from ..model import TinyLlama, random_tokens
    from ..pipeline_parallel import run_schedule, schedule_stages
    from ..pipeline_schedules import make_schedule
    sched = make_schedule("1f1b", dist.get_world_size(), m)
    stages = schedule_stages(TinyLlama(cfg), sched)
    mine = {s: stages[s] for s in sched.stages_of(dist.get_rank())}
    x, y = random_tokens(mbs * m, seq, cfg.vocab_size, seed=1)
    act = SavedActivations(torch.nn.ModuleList(mine.values()), per_module=False)
    with comm.Ledger() as led:   # one storage per micro-batch, as a data loader hands them out
        run_schedule(sched, mine, [t.clone() for t in x.chunk(m)], [t.clone() for t in y.chunk(m)],
                     measure=act)
    return act.peak, led.as_dicts()


_FAKE = '''
import json, sys, torch, torch.distributed as dist
from picolib.torch_compat import fake_store
dist.init_process_group("fake", rank=5, world_size=1024, store=fake_store())
torch.set_num_threads(1)
from picolib import comm
from picolib.data_parallel import DDP
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.zero import ZeRO
cfg = LlamaConfig(**json.loads(sys.argv[1]))
out = {}
for stage in (0, 1, 2, 3):
    model = TinyLlama(cfg)
    w = DDP(model) if stage == 0 else ZeRO(model, stage)
    x, y = random_tokens(2, 8, cfg.vocab_size)
    with comm.Ledger() as led:
        model.loss(x, y).backward()
        if stage:
            w.step()
    out[stage] = [led.total("sent_bytes"), w.memory() if stage else None,
                  [[r.op, r.nbytes, r.group_size] for r in led.records]]
print(json.dumps(out))
'''


def fake_pg_traffic(cfg) -> dict:
    """DDP (stage 0) and ZeRO-1/2/3 as rank 5 of 1,024 on PyTorch's `fake` process group
    (every collective returns at once and moves nothing), in a separate interpreter:
    {stage: [bytes the ring formula gives for the collectives rank 5 issued (the ledger's
    computed records), ZeRO's model state (None for DDP), [[op, buffer bytes, group size], ...]]}."""
    import json
    import subprocess
    import sys
    from dataclasses import asdict
    done = subprocess.run([sys.executable, "-c", _FAKE, json.dumps(asdict(cfg))],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(done.stderr[-1500:])
    return {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


# ------------------------------------------------------------------------- figures

def plot_all_reduce(h100, ib: float = 50e9, ns=None):
    """§2: all-reduce seconds against GPUs for 1 GB (ring, tree, hierarchical + SHARP) and
    1 MB (ring and tree only: the hierarchical model has no latency term, and at 1 MB latency
    is nearly all of the time). All three are all-reduces: one colour, three line styles."""
    import matplotlib.pyplot as plt

    from ..hardware import hierarchical_all_reduce_time, ring_time, tree_all_reduce_time
    from ..style import color
    ns = ns or [2 ** k for k in range(1, 15)]
    c = color("all_reduce")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, size in zip(axes, (1e9, 1e6)):          # the titles say 1 GB and 1 MB
        ax.loglog(ns, [ring_time("all_reduce", size, n, ib) for n in ns], "o-", color=c,
                  label=f"ring, {ib / 1e9:g} GB/s")
        ax.loglog(ns, [tree_all_reduce_time(size, n, ib) for n in ns], "s--", color=c, mfc="white",
                  label=f"tree, {ib / 1e9:g} GB/s")
        if size >= 1e8:
            ax.loglog(ns, [hierarchical_all_reduce_time(size, h100, n) for n in ns], "^:", color="k",
                      label="hierarchical + SHARP\n(bandwidth only)")
        ax.set(xlabel="GPUs", ylabel="seconds",
               title=f"all-reduce of 1 {'GB' if size >= 1e9 else 'MB'} (computed, α = 5 µs)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig


def plot_candidates(cfg, candidates: dict):
    """§5: memory (worst rank, by kind) and step time (by part) of each named Parallelism,
    legends beside the axes, off the bars; colours from picolib.style."""
    import matplotlib.pyplot as plt

    from ..plan_search import step_time
    from ..style import MEMORY, OPS, PARALLELISM
    names = list(candidates)
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(12, 4.6))
    mems = [memory(cfg, p) for p in candidates.values()]
    bottom = [0.0] * len(names)
    for kind, c in MEMORY.items():
        vals = [m[kind] / 1e9 for m in mems]
        ax_m.bar(names, vals, bottom=bottom, color=c, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_m.axhline(80, color="k", ls="--", lw=1, label="80 GB")
    ax_m.set(ylabel="GB per GPU (worst rank)", title="memory per configuration (computed)")
    times = [step_time(cfg, p) for p in candidates.values()]
    parts = {"compute": OPS["BW"], "bubble": OPS["idle"], "tp": PARALLELISM["TP"],
             "pp": PARALLELISM["PP"], "dp_exposed": PARALLELISM["DP"]}
    bottom = [0.0] * len(names)
    for part, c in parts.items():
        vals = [t[part] for t in times]
        ax_t.bar(names, vals, bottom=bottom, color=c, edgecolor="0.4", lw=0.5, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_t.set(ylabel="seconds per step", title="step time, 1.3 M tokens (computed, roofline matmuls)")
    for ax in (ax_m, ax_t):
        ax.tick_params(axis="x", labelrotation=25, labelsize=9)
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def _train_all(configs):
    from ..train import train
    return [train(cfg)[0] for cfg in configs]


def trainer_vs_planner(layouts: list[dict], seq: int = 16, batch: int = 8) -> list[dict]:
    """Train each layout (keyword arguments of `picolib.train.TrainConfig`, all of one world
    size) for one step on real ranks, in one launch, and return per layout the busiest
    rank's state bytes and bytes sent by kind, the trainer's and the planner's (fp32,
    picolib's counts): [{"layout", "trainer", "planner"}] with each side {"state", "sent"}.
    The trainer files the experts' gradients over their (dp/ep)·cp copies under DP (the
    data-parallel wrappers tag their collectives); anything it files as "other" is added to
    DP here, as before that tag existed."""
    from ..launch import run
    from ..planner import traffic
    from ..train import TrainConfig
    configs = [TrainConfig(steps=1, progress=False, data="random", seq=seq, batch=batch, **kw)
               for kw in layouts]
    sizes = {c.world_size for c in configs}
    if len(sizes) != 1:
        raise ValueError(f"the layouts must share one world size, not {sorted(sizes)}")
    records = run(_train_all, sizes.pop(), configs, timeout=300)[0]
    out = []
    for kw, cfg, rec in zip(layouts, configs, records):
        mcfg, par = cfg.model_config(), Parallelism.of(cfg, activations="picolib", flash=False)
        state = max(sum(memory(mcfg, par, r)[k] for k in ("params", "grads", "optimizer"))
                    for r in range(par.pp))
        sent = [traffic(mcfg, par, r) for r in range(par.pp)]
        kinds = {k.upper(): max(x[k] for x in sent) for k in ("dp", "tp", "pp", "cp", "ep")}
        measured = dict(rec["sent_bytes_by_kind"])
        if "other" in measured:
            measured["DP"] = measured.get("DP", 0) + measured.pop("other")
        out.append({"layout": kw, "trainer": {"state": rec["state_bytes"], "sent": measured},
                    "planner": {"state": state, "sent": {k: v for k, v in kinds.items() if v}}})
    return out


KINDS = ("dp", "tp", "pp", "cp", "ep")


def dry_vs_planner(cfg, world: int, gpu: str = "H100-SXM", pp_ranks=None) -> list[dict]:
    """Dry-run trainer configuration `cfg` as `world` ranks (`picolib.dry_run`: one process
    per pipeline position asked for — default all — as its rank at dp = cp = tp = 0) and
    compute the planner's bytes for the same positions: [{"pp_rank", "dry": the dry run's
    report, "planner": {"params", "grads", "optimizer", "activations", "total", "sent":
    {kind: bytes}}}]. The planner counts Llama's block as picolib runs it with the s×s
    scores dropped (`activations="picolib", recompute="selective"`: what a flash kernel
    keeps), in the configuration's precision; its gradients are their peak (the dry run's
    `grads_peak`)."""
    from ..dry_run import dry_run
    from ..parallel_layout import rank_at
    from ..planner import traffic
    positions = range(cfg.pp) if pp_ranks is None else pp_ranks
    reports = dry_run(cfg, world, gpu, ranks=[rank_at(cfg, pp=p, dp=0, cp=0, tp=0) for p in positions])
    mcfg = cfg.model_config()
    par = Parallelism.of(cfg, activations="picolib",
                         recompute="selective" if cfg.recompute == "none" else cfg.recompute)
    out = []
    for r in reports:
        plan = memory(mcfg, par, r["pp_rank"])
        sent = traffic(mcfg, par, r["pp_rank"])
        out.append({"pp_rank": r["pp_rank"], "dry": r,
                    "planner": {**plan, "sent": {k: sent[k] for k in KINDS}}})
    return out


def show_dry_vs_planner(rows: list[dict]) -> None:
    """One line per pipeline position and side: GB held (parameters, gradients at their
    peak, optimizer state, saved activations, their sum) and GB sent by kind."""
    gb = lambda b: f"{b / 1e9:7.2f}"  # noqa: E731
    print(f"{'pp':>3} {'':8s}{'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'total':>7} | sent "
          + " ".join(f"{k:>7}" for k in KINDS) + "   (GB)")
    for row in rows:
        d, p = row["dry"], row["planner"]
        held = [d["params"], d["grads_peak"], d["optimizer"], d["activations"]]
        for name, vals, sent in (("dry run", held + [sum(held)], d["sent"]),
                                 ("planner", [p[k] for k in ("params", "grads", "optimizer", "activations", "total")], p["sent"])):
            print(f"{row['pp_rank']:>3} {name:8s}" + " ".join(gb(v) for v in vals) + " |      "
                  + " ".join(gb(sent[k]) for k in KINDS))


# Llama 3 report, Table 4: GPUs, TP, CP, PP, DP, sequence, sequences per DP rank, TFLOP/s per GPU
TABLE4 = {"8,192 GPUs, 8k": (8192, 8, 1, 16, 64, 8192, 32, 430),
          "16,384 GPUs, 8k": (16384, 8, 1, 16, 128, 8192, 16, 400),
          "16,384 GPUs, 131k": (16384, 8, 16, 16, 8, 131072, 16, 380)}


def price_table4(cfg=LLAMA3_405B) -> dict:
    """The planner's BF16 TFLOP/s per GPU for each run of `TABLE4`: {run: (published, {v: {count:
    TFLOP/s}})}, v = 1 under 1F1B and v = 2 interleaved (ZeRO-1, SP), and three ways to count a
    token's FLOPs: "causal" (picolib's `model_flops_per_token`), "square" (the whole s×s attention,
    Megatron-LM's formula) and "dense" (6 × parameters only)."""
    priced = {}
    for name, (gpus, tp, cp, pp, dp, seq, m, published) in TABLE4.items():
        par = Parallelism(dp=dp, tp=tp, cp=cp, pp=pp, sp=True, zero=1, micro_batches=m, seq=seq)
        per_gpu = {}
        for v in (1, 2):
            t = step_time(cfg, par.replace(schedule="interleaved" if v > 1 else "1f1b", chunks=v))
            rate = t["tokens_per_s"] / gpus / 1e12
            per_gpu[v] = {c: model_flops_per_token(cfg, seq, causal=c == "causal") * rate for c in ("causal", "square")}
            per_gpu[v]["dense"] = 6 * param_count(cfg) * rate
        priced[name] = (published, per_gpu)
    return priced


def tokens_through_a_stage_copy(schedule: str, pp: int, micro_batches: int, seq: int) -> int:
    """Tokens that pass each (rank, stage) copy of the weights in one step of `schedule` on `pp`
    ranks, counted from its forward ops, one sequence of `seq` tokens a micro-batch."""
    from collections import Counter

    from ..pipeline_schedules import make_schedule
    sched = make_schedule(schedule, pp, micro_batches)
    counts = Counter((r, op.stage) for r, ops in enumerate(sched.ops) for op in ops if op.kind == "F")
    assert len(set(counts.values())) == 1, counts          # every copy sees as many
    return counts.popitem()[1] * seq
