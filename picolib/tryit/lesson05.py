"""Lesson 05's "try it": the activations one block saves per rank, with and without
sequence parallelism.

    saved_bytes(tp, seq, sp, hidden, ffn_hidden, n_heads, batch)   # the number
    saved_bytes_bars(tp, seq, sp)                                   # the knob cell (bars)

Both use `picolib.sequence_parallel.activation_bytes_per_layer` (fp32, eager attention, the
TinyLlama block); tests/test_tryit_05.py checks `saved_bytes` against bytes measured with
`picolib.memory.SavedActivations` on tensor-parallel ranks.
"""
from __future__ import annotations

from ..sequence_parallel import activation_bytes_per_layer

__all__ = ["SHAPE", "saved_bytes", "saved_bytes_bars"]

SHAPE = {"hidden": 1024, "ffn_hidden": 4096, "n_heads": 16, "batch": 1}   # the knob cell's block


def saved_bytes(tp: int, seq: int, sp: bool, hidden: int = SHAPE["hidden"],
                ffn_hidden: int = SHAPE["ffn_hidden"], n_heads: int = SHAPE["n_heads"],
                batch: int = SHAPE["batch"]) -> int:
    """Bytes one block saves for backward on one of `tp` ranks, under TP (`sp=False`) or
    TP+SP (`sp=True`, Megatron's re-gather). A ValueError names the numbers tp must divide."""
    return activation_bytes_per_layer(seq, batch, hidden, ffn_hidden, n_heads, tp,
                                      "tp+sp" if sp else "tp")


def saved_bytes_bars(tp: int = 1, seq: int = 128, sp: bool = False, ax=None) -> dict:
    """Bars of `saved_bytes` for the SHAPE block at tp = 1, 2, 4, 8, TP and TP+SP side by
    side, the chosen (tp, sp) outlined; prints and returns its numbers."""
    import matplotlib.pyplot as plt

    tps = [1, 2, 4, 8]
    if tp not in tps:
        raise ValueError(f"tp must be one of {tps}, not {tp!r}")
    if seq % 8:
        raise ValueError(f"seq={seq} must be a multiple of 8 (every tp here must divide it)")
    one = saved_bytes(1, seq, False)
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(6.5, 3.2))
    for k, (mode, color) in enumerate(((False, "#e15759"), (True, "#4e79a7"))):
        xs = [i + 0.38 * k for i in range(len(tps))]
        bars = ax.bar(xs, [saved_bytes(t, seq, mode) / 2**20 for t in tps], width=0.36,
                      color=color, label="TP+SP" if mode else "TP")
        if mode == sp:
            bars[tps.index(tp)].set_edgecolor("black")
            bars[tps.index(tp)].set_linewidth(2.5)
    ax.set_xticks([i + 0.19 for i in range(len(tps))], [f"tp = {t}" for t in tps])
    ax.set_ylabel("saved MiB per layer per rank")
    ax.set_title(f"one block (h={SHAPE['hidden']}, f={SHAPE['ffn_hidden']}, "
                 f"{SHAPE['n_heads']} heads, fp32, eager attention), {seq} tokens", fontsize=9)
    ax.legend(frameon=False)
    if created:
        ax.figure.tight_layout()
        plt.show()
    mine = saved_bytes(tp, seq, sp)
    out = {"bytes": mine, "one_process": one, "fraction": mine / one}
    print(f"tp={tp}, {'TP+SP' if sp else 'TP'}, {seq} tokens: {mine / 2**20:,.2f} MiB per layer "
          f"per rank = {out['fraction']:.3f} of one process ({one / 2**20:,.2f} MiB)")
    return out
