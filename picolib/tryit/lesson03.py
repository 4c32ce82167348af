"""Lesson 03's plumbing: bytes per rank of plain DP and a ZeRO stage, and the prefetch figure's counts.

    from picolib.tryit import knobs
    from picolib.tryit.lesson03 import zero_bars
    knobs(zero_bars, stage=[3, 1, 2], ranks=(1, 64, 1), model=["7.5B (ZeRO paper)", "tiny Llama"])

`per_rank` is the arithmetic (picolib.zero.zero_memory_bytes, padding included);
tests/lessons/test_tryit_03.py checks it against the bytes real ZeRO ranks hold. `plot_groups`
draws the lesson's grouped, stacked bars; `model_states` gives a real model's bytes per stage from
the planner; `hidden_fraction` and `gathers_under_compute` read §6's timelines. The lesson's cells
run DDP and ZeRO themselves.
"""
from __future__ import annotations

from ..memory import binary_unit
from ..style import MEMORY
from ..zero import optimizer_state_factor, zero_memory_bytes

__all__ = ["PRECISIONS", "MODELS", "per_rank", "plot_groups", "zero_bars", "gathers_under_compute",
           "hidden_fraction", "model_states"]

# bytes per parameter (params, grads) and optimizer bytes B_opt, Adam
PRECISIONS = {"bf16 + fp32 master": (2, 12), "fp32": (4, optimizer_state_factor("adam"))}
# the ZeRO paper's 7.5B example, and the lesson's tiny Llama (its ZeRO units)
MODELS = {"7.5B (ZeRO paper)": 7_500_000_000, "tiny Llama": [2214, 2142, 2142]}
COLORS = {kind: MEMORY[kind] for kind in ("params", "grads", "optimizer")}   # picolib.style


def per_rank(stage: int, n: int, numels, precision: str = "bf16 + fp32 master") -> dict:
    """{"DP": {...}, "ZeRO-<stage>": {...}}: params, grads, optimizer bytes on one of n
    ranks; `numels` one int (Ψ) or the units' sizes (each padded to a multiple of n)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    p, b_opt = PRECISIONS[precision]
    return {"DP": zero_memory_bytes(0, numels, n, b_opt, param_bytes=p),
            f"ZeRO-{stage}": zero_memory_bytes(stage, numels, n, b_opt, param_bytes=p)}


def plot_groups(groups: dict, ax=None, title: str = "bytes per rank"):
    """Stacked bars (params, grads, optimizer) in groups with a gap between groups:
    `groups` is {group label: {bar label: {"params", "grads", "optimizer"}}}. Each bar is
    labelled under itself, each group under its bars; the legend has the three parts."""
    import matplotlib.pyplot as plt
    nbars = sum(len(bars) for bars in groups.values())
    ax = ax or plt.subplots(figsize=(1.5 + 0.55 * nbars + 0.4 * len(groups), 3.8))[1]
    scale, unit = binary_unit(max(sum(m.values()) for bars in groups.values() for m in bars.values()))
    x, ticks, labels, centers = 0.0, [], [], []
    for group, bars in groups.items():
        first = x
        for label, mem in bars.items():
            bottom = 0.0
            for kind, color in COLORS.items():
                ax.bar(x, mem[kind] / scale, bottom=bottom, color=color, width=0.8,
                       label=kind if not ticks else None)
                bottom += mem[kind] / scale
            ticks.append(x)
            labels.append(label)
            x += 1
        centers.append(((first + x - 1) / 2, group))
        x += 0.8                                     # the gap between groups
    ax.set_xticks(ticks, labels, fontsize=9)
    for cx, group in centers:
        ax.annotate(group, (cx, 0), xycoords=("data", "axes fraction"), xytext=(0, -24),
                    textcoords="offset points", ha="center", va="top", fontsize=10,
                    fontweight="bold", annotation_clip=False)
    ax.set(ylabel=f"{unit} per rank", title=title)
    ax.legend(fontsize=9, loc="upper right")
    return ax


def zero_bars(stage: int = 3, ranks: int = 8, model: str = "7.5B (ZeRO paper)",
              precision: str = "bf16 + fp32 master", ax=None) -> dict:
    """Draw DP beside ZeRO-`stage` on N = `ranks` ranks for `model`; return `per_rank(...)`."""
    import matplotlib.pyplot as plt
    mem = per_rank(stage, ranks, MODELS[model], precision)
    created = ax is None
    ax = plot_groups({f"N = {ranks}": mem},
                     ax=ax or plt.subplots(figsize=(4.5, 3.8), layout="constrained")[1],
                     title=f"{model}\n{precision}: bytes per rank")
    if created:
        plt.show()
    dp, z = (sum(m.values()) for m in mem.values())
    print(f"DP {dp:,} B, ZeRO-{stage} {z:,} B per rank: {dp / z:.2f}× less")
    return mem


def model_states(cfg, n: int, precision: str) -> list:
    """Bytes per rank of parameters, gradients and optimizer state (the ZeRO paper's model
    states) under DP, ZeRO-1, -2 and -3 on `n` data-parallel ranks: `picolib.planner.memory`."""
    from ..planner import Parallelism, memory
    return [sum(v for kind, v in memory(cfg, Parallelism(dp=n, zero=z, precision=precision)).items()
                if kind in ("params", "grads", "optimizer")) for z in range(4)]


def hidden_fraction(events, rank: int = 0) -> float:
    """Share of `rank`'s all-gather time that runs under some forward or backward span."""
    from ..timeline import busy_time, overlap_time
    return overlap_time(events, rank, "all_gather", ["F", "B"]) / busy_time(events, rank, "all_gather")


def gathers_under_compute(events, rank: int = 0) -> tuple:
    """(all-gathers of `rank` that spend at least half their time under a forward or
    backward span, all-gathers of `rank`)."""
    comp = [e for e in events if e["rank"] == rank and e["name"] in ("F", "B")]
    gathers = [e for e in events if e["rank"] == rank and e["name"] == "all_gather"]
    under = [g for g in gathers if any(min(g["end"], c["end"]) - max(g["start"], c["start"])
                                       >= 0.5 * (g["end"] - g["start"]) for c in comp)]
    return len(under), len(gathers)
