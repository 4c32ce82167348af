"""Lesson 03's "try it": bytes per rank of plain DP and a ZeRO stage, for N ranks.

    from picolib.tryit import knobs
    from picolib.tryit.lesson03 import zero_bars
    knobs(zero_bars, stage=[3, 1, 2], n=(1, 64, 1), model=["7.5B (ZeRO paper)", "tiny Llama"])

`per_rank` is the arithmetic (picolib.zero.zero_memory_bytes, padding included);
tests/test_tryit_03.py checks it against the bytes real ZeRO ranks hold
(`ZeRO(...).memory()`). `plot_groups` draws the lesson's grouped, stacked bars.
"""
from __future__ import annotations

from ..zero import optimizer_state_factor, zero_memory_bytes

__all__ = ["PRECISIONS", "MODELS", "per_rank", "plot_groups", "zero_bars"]

# bytes per parameter (params, grads) and optimizer bytes k, Adam
PRECISIONS = {"bf16 + fp32 master": (2, 12), "fp32": (4, optimizer_state_factor("adam"))}
# the ZeRO paper's 7.5B example, and the lesson's tiny Llama (its ZeRO units)
MODELS = {"7.5B (ZeRO paper)": 7_500_000_000, "tiny Llama": [2214, 2142, 2142]}
COLORS = {"params": "#2a9d8f", "grads": "#f4a261", "optimizer": "#e76f8a"}


def per_rank(stage: int, n: int, numels, precision: str = "bf16 + fp32 master") -> dict:
    """{"DP": {...}, "ZeRO-<stage>": {...}}: params, grads, optimizer bytes on one of n
    ranks; `numels` one int (Ψ) or the units' sizes (each padded to a multiple of n)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    p, k = PRECISIONS[precision]
    return {"DP": zero_memory_bytes(0, numels, n, k, param_bytes=p),
            f"ZeRO-{stage}": zero_memory_bytes(stage, numels, n, k, param_bytes=p)}


def _unit(nbytes: float):
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return scale, name
    return 1, "B"


def plot_groups(groups: dict, ax=None, title: str = "bytes per rank"):
    """Stacked bars (params, grads, optimizer) in groups with a gap between groups:
    `groups` is {group label: {bar label: {"params", "grads", "optimizer"}}}. Each bar is
    labelled under itself, each group under its bars; the legend has the three parts."""
    import matplotlib.pyplot as plt
    nbars = sum(len(bars) for bars in groups.values())
    ax = ax or plt.subplots(figsize=(1.5 + 0.55 * nbars + 0.4 * len(groups), 3.8))[1]
    scale, unit = _unit(max(sum(m.values()) for bars in groups.values() for m in bars.values()))
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
    ax.set(ylabel=unit, title=title)
    ax.legend(fontsize=9, loc="upper right")
    return ax


def zero_bars(stage: int = 3, n: int = 8, model: str = "7.5B (ZeRO paper)",
              precision: str = "bf16 + fp32 master", ax=None) -> dict:
    """Draw DP beside ZeRO-`stage` on `n` ranks for `model`; return `per_rank(...)`."""
    import matplotlib.pyplot as plt
    mem = per_rank(stage, n, MODELS[model], precision)
    created = ax is None
    ax = plot_groups({f"N = {n}": mem},
                     ax=ax or plt.subplots(figsize=(4.5, 3.8), layout="constrained")[1],
                     title=f"{model}\n{precision}: bytes per rank")
    if created:
        plt.show()
    dp, z = (sum(m.values()) for m in mem.values())
    print(f"DP {dp:,} B, ZeRO-{stage} {z:,} B per rank: {dp / z:.2f}× less")
    return mem
