"""Lesson 04's plumbing: what one Llama block costs a rank under tensor parallelism
(`layer_bytes`: weights stored, bytes its f/g all-reduces send; checked against real TP ranks in
tests/lessons/test_tryit_04.py) and the drawings of shards and of where f and g sit.
Try it: `knobs(tp_layer_bytes, tp=[1, 2, 4, 8])`.
"""
from __future__ import annotations

from ..comm import ring_sent_bytes
from ..style import COLLECTIVES, PARALLELISM, rank_color
from ..tensor_parallel import kv_heads_per_rank

__all__ = ["LLAMA3", "layer_bytes", "tp_layer_bytes", "plot_shards", "block_layout",
           "plot_tp_block", "norm_inputs"]

# hidden, query heads, KV heads, ffn_hidden, layers (published Llama 3 configurations)
LLAMA3 = {"Llama-3-8B": (4096, 32, 8, 14336, 32),
          "Llama-3-70B": (8192, 64, 8, 28672, 80),
          "Llama-3-405B": (16384, 128, 8, 53248, 126)}


def layer_bytes(tp: int, hidden: int, n_heads: int, n_kv_heads: int, ffn_hidden: int,
                tokens: int, bytes_per_value: int = 2) -> dict:
    """One block on one of `tp` ranks: {"weights": bytes stored, "all_reduce_calls": per
    step, "all_reduce_sent": bytes this rank sends for them per step (forward + backward),
    "kv_replicas": ranks holding each KV head}. Activation all-reduces only: the sums of
    replicated KV-head gradients (tp > n_kv_heads) are not counted. A ValueError names
    the numbers when tp does not fit the heads or ffn_hidden."""
    if tp < 1 or hidden % n_heads:
        raise ValueError(f"need tp >= 1 and n_heads={n_heads} dividing hidden={hidden}")
    if ffn_hidden % tp:
        raise ValueError(f"tp={tp} must divide ffn_hidden={ffn_hidden}")
    kv_local, replicas = kv_heads_per_rank(n_heads, n_kv_heads, tp)   # raises on a bad tp
    head_dim = hidden // n_heads
    values = (2 * hidden * hidden // tp             # q and o: whole query heads, split
              + 2 * hidden * kv_local * head_dim     # k and v: this rank's KV heads
              + 3 * hidden * ffn_hidden // tp        # gate, up (column) and down (row)
              + 2 * hidden)                          # the two RMSNorm weights, replicated
    calls = 4 if tp > 1 else 0
    activation = tokens * hidden * bytes_per_value
    return {"weights": values * bytes_per_value, "all_reduce_calls": calls,
            "all_reduce_sent": calls * ring_sent_bytes("all_reduce", activation, tp),
            "kv_replicas": replicas}


def tp_layer_bytes(tp: int = 1, model: str = "Llama-3-70B", seq: int = 4096, ax=None) -> dict:
    """Bars of `layer_bytes` (bf16, micro-batch 1 of `seq` tokens) at tp = 1, 2, 4, 8, 16 for
    one `model` of LLAMA3, the chosen `tp` outlined; returns its numbers. Weights shrink
    by tp; the bytes sent per layer grow towards 4 · 2 · seq · hidden · 2 and do not shrink."""
    import matplotlib.pyplot as plt

    if model not in LLAMA3:
        raise ValueError(f"model must be one of {sorted(LLAMA3)}, not {model!r}")
    hidden, heads, kv, ffn, _ = LLAMA3[model]
    tps = [1, 2, 4, 8, 16]
    if tp not in tps:
        raise ValueError(f"tp must be one of {tps}, not {tp!r}")
    rows = {t: layer_bytes(t, hidden, heads, kv, ffn, seq) for t in tps}
    created = ax is None
    if created:
        _, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    for a, key, label in ((ax[0], "weights", "weights per rank (MiB)"),
                          (ax[1], "all_reduce_sent", "all-reduce MiB sent per rank per step")):
        heights = [rows[t][key] / 2 ** 20 for t in tps]
        bars = a.bar([str(t) for t in tps], heights, color=PARALLELISM["TP"])
        bars[tps.index(tp)].set_edgecolor("black")
        bars[tps.index(tp)].set_linewidth(2.5)
        a.set_xlabel("tp (ranks)"); a.set_ylabel("MiB"); a.set_title(label, fontsize=10)
    ax[0].figure.suptitle(f"one {model} block, bf16, {seq} tokens", fontsize=10)
    if created:
        ax[0].figure.tight_layout()
        plt.show()
    mine = rows[tp]
    print(f"tp={tp}: {mine['weights'] / 2 ** 20:,.1f} MiB of weights per rank, "
          f"{mine['all_reduce_calls']} all-reduces sending {mine['all_reduce_sent'] / 2 ** 20:,.1f} MiB "
          f"per layer per step" + (f"; each KV head on {mine['kv_replicas']} ranks"
                                   if mine["kv_replicas"] > 1 else ""))
    return mine


# --------------------------------------------------------------------------- the lesson's figures and runs
def plot_shards(panel, W, shards, dim: int, title: str):
    """Draw into Axes `panel` weight `W` (out, in) in grey with each rank's shard outlined in its rank colour:
    `dim` 0 for column-parallel (rows of `weight`), 1 for row-parallel (its columns)."""
    from matplotlib.patches import Rectangle
    panel.imshow(W, cmap="Greys", alpha=0.35)
    start = 0
    for r, s in enumerate(shards):
        size = s.shape[dim]
        (x, y), w, h = (((-0.5, start - 0.5), W.shape[1], size) if dim == 0
                        else ((start - 0.5, -0.5), size, W.shape[0]))
        panel.add_patch(Rectangle((x + 0.08, y + 0.08), w - 0.16, h - 0.16, fill=False, lw=3,
                               ec=rank_color(r)))
        panel.text(x + w / 2, y + h / 2, f"rank {r}\n{tuple(s.shape)}", ha="center", va="center",
                color="#222222", fontsize=10, weight="bold",
                bbox=dict(fc="white", ec="none", alpha=0.8))
        start += size
    panel.set_title(title, fontsize=10)
    panel.set_xlabel("in features (index)")
    panel.set_ylabel("out features (index)")


def block_layout(cfg) -> dict:
    """On a rank of a tensor-parallel TinyLlama(cfg): {"attn"|"mlp": [(name, class name,
    weight shape)]} for the first block's linear layers."""
    from ..model import TinyLlama
    from ..tensor_parallel import apply_tensor_parallel
    blk = apply_tensor_parallel(TinyLlama(cfg)).blocks[0]
    return {part: [(name, type(m).__name__, tuple(m.weight.shape))
                   for name, m in getattr(blk, part).named_children() if hasattr(m, "weight")]
            for part in ("attn", "mlp")}


def _column_text(part, name, shape, r, head_dim):
    rows = shape[0]
    if part == "attn":
        return f"{name} {shape}: {rows // head_dim} {'q' if name == 'wq' else 'kv'} head(s)"
    return f"{name} {shape}: ffn features {r * rows}–{(r + 1) * rows - 1}"


def _draw_region(panel, layouts, part, title, middle, head_dim):
    from matplotlib.patches import FancyBboxPatch

    def box(x, y, text, color, w=1.9, h=0.72, alpha=1.0):
        panel.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.03",
                                    fc=color, ec="#333333", alpha=alpha))
        panel.text(x, y, text, ha="center", va="center", fontsize=9)

    def arrow(x0, y0, x1, y1):
        panel.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", color="#333333"))

    n = len(layouts)
    lanes = [0.55 * (n - 1) - 1.1 * r for r in range(n)]
    box(0.2, 0, "x (b, s, h)\nwhole on every rank", "#eeeeee", w=1.6)
    box(1.9, 0, "f\nfwd: identity\nbwd: all-reduce", COLLECTIVES["all_reduce"], w=1.3, h=0.9, alpha=0.3)
    box(10.1, 0, "g\nfwd: all-reduce\nbwd: identity", COLLECTIVES["all_reduce"], w=1.3, h=0.9, alpha=0.3)
    box(11.8, 0, "y (b, s, h)\nwhole on every rank", "#eeeeee", w=1.6)
    arrow(1.0, 0, 1.25, 0)
    arrow(10.75, 0, 11.0, 0)
    for r, y in enumerate(lanes):
        mods = layouts[r][part]
        cols = [_column_text(part, nm, sh, r, head_dim) for nm, k, sh in mods if k == "ColumnParallelLinear"]
        rows = [f"{nm} {sh}" for nm, k, sh in mods if k == "RowParallelLinear"]
        box(4.0, y, f"rank {r}: column-parallel\n" + "\n".join(cols), rank_color(r), w=2.6, h=0.95, alpha=0.3)
        box(6.3, y, f"rank {r}: {middle}\n(local, no communication)", "#dddddd", w=1.8)
        box(8.3, y, f"rank {r}: row-parallel\n{rows[0]}\n→ partial sum (b, s, h)", rank_color(r),
            w=1.9, h=0.95, alpha=0.3)
        arrow(2.55, 0, 2.7, y)
        arrow(5.3, y, 5.4, y)
        arrow(7.2, y, 7.35, y)
        arrow(9.25, y, 9.45, 0)
    panel.set_xlim(-0.7, 12.7)
    panel.set_ylim(min(lanes) - 0.7, max(lanes) + 0.7)
    panel.set_title(title, fontsize=11)
    panel.axis("off")


def plot_tp_block(layouts, head_dim: int):
    """Two panels (attention, MLP) of a tp block, one lane per rank, each box labelled from
    the modules the ranks reported (`block_layout`). Returns the figure (not shown)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(13.2, 6.3), layout="constrained")
    tp = len(layouts)
    _draw_region(axes[0], layouts, "attn",
                 f"attention, tp = {tp}: f → q, k, v (column) → attention per head → o (row) → g",
                 "softmax(qkᵀ)v\non its heads", head_dim)
    _draw_region(axes[1], layouts, "mlp",
                 f"MLP (SwiGLU), tp = {tp}: f → gate, up (column) → silu(gate)·up → down (row) → g",
                 "silu(gate)·up\non its features", head_dim)
    return fig


def norm_inputs(cfg, tokens, sequence_parallel: bool) -> dict:
    """On a rank of a tensor-parallel TinyLlama(cfg) (with or without sequence parallelism):
    {norm name: the tensor that norm received} in one forward over `tokens`, for every RMSNorm
    of the model (each block's two and the final one)."""
    from ..model import RMSNorm, TinyLlama
    from ..tensor_parallel import apply_tensor_parallel
    model = apply_tensor_parallel(TinyLlama(cfg), sequence_parallel=sequence_parallel)
    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, RMSNorm):
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.__setitem__(name, args[0].detach().clone()))
    model(tokens)
    return seen
