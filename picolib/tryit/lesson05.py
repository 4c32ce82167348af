"""Lesson 05's plumbing: the activations one block saves per rank with and without sequence
parallelism (`picolib.sequence_parallel.activation_bytes_per_layer`; `saved_bytes` is checked
against `SavedActivations` on TP ranks in tests/lessons/test_tryit_05.py), §2's figure, §8's plans.
"""
from __future__ import annotations

from ..sequence_parallel import activation_bytes_per_layer
from ..style import OPS, PARALLELISM

__all__ = ["SHAPE", "MODE_COLORS", "saved_bytes", "saved_bytes_bars", "saved_per_layer_figure",
           "plan_640", "max_seq", "max_micro_batch_size"]

# TP's colour for TP; TP+SP a darker green (the same family: TP, further split); the
# gathered variant in between; one process grey
MODE_COLORS = {"one process": OPS["step"], "tp": PARALLELISM["TP"], "tp+sp-gathered": "#44AA99",
               "tp+sp": "#117733"}

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
    for k, (mode, color) in enumerate(((False, MODE_COLORS["tp"]), (True, MODE_COLORS["tp+sp"]))):
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


def saved_per_layer_figure(measured: dict, one: int, s: int, b: int, h: int, f: int, a: int):
    """Lesson 05 §2: the bytes one layer saved per rank (`measured[tp][mode]`, a list per layer)
    as bars at tp = 2 and 4 beside one process's `one`, each with its adapted formula
    (`activation_bytes_per_layer`) as a black tick."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(0, one / 1024, color=MODE_COLORS["one process"], label="one process")
    for i, tp in enumerate((2, 4)):
        for j, mode in enumerate(("tp", "tp+sp-gathered", "tp+sp")):
            x = 1 + i * 3.5 + j
            ax.bar(x, measured[tp][mode][0] / 1024, color=MODE_COLORS[mode], label=mode if i == 0 else None)
            ax.plot(x, activation_bytes_per_layer(s, b, h, f, a, tp, mode) / 1024, "k_", ms=18)
    ax.set_xticks([0, 2, 5.5]); ax.set_xticklabels(["tp = 1", "tp = 2", "tp = 4"])
    ax.set_ylabel("saved KiB per layer per rank")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("saved activations per rank: measured (bars), adapted formula (black ticks)")
    plt.tight_layout(); plt.show()


def plan_640(tp: int, sp: bool, seq: int, recompute: str = "none", micro_batch_size: int = 1,
             pp: int = 4, gpus: int = 640, micro_batches: int = 8, zero: int = 1):
    """Lesson 05 §8's plan for Llama-3-70B on `gpus` H100s, every assumption the quoted
    claims leave open named here: PP 4 (1F1B, 8 micro-batches per step), ZeRO-1 over the
    rest as DP, bf16 with flash attention (Korthikanti's count)."""
    from ..planner import Parallelism

    return Parallelism(dp=gpus // (tp * pp), tp=tp, pp=pp, sp=sp, zero=zero,
                       micro_batches=micro_batches, micro_batch_size=micro_batch_size,
                       seq=seq, recompute=recompute)


def _fits(par, usable: float) -> bool:
    from ..hardware import hardware
    from ..planner import LLAMA3_70B, memory

    try:
        return memory(LLAMA3_70B, par)["total"] <= usable * hardware("H100-SXM").memory
    except ValueError:            # a shape the plan cannot run (tp must divide seq, ...)
        return False


def max_seq(tp: int, sp: bool, recompute: str = "none", usable: float = 0.9, step: int = 1024,
            limit: int = 262144, **plan) -> int:
    """The longest sequence (a multiple of `step`) whose worst pipeline rank fits in
    `usable` × 80 GB under `plan_640` (0 if none)."""
    best = 0
    for seq in range(step, limit + 1, step):
        if _fits(plan_640(tp, sp, seq, recompute, **plan), usable):
            best = seq
    return best


def max_micro_batch_size(tp: int, sp: bool, seq: int, recompute: str = "none",
                         usable: float = 0.9, limit: int = 64, **plan) -> int:
    """The most sequences per micro-batch that fit in `usable` × 80 GB under `plan_640`."""
    return max([0] + [mbs for mbs in range(1, limit + 1)
                      if _fits(plan_640(tp, sp, seq, recompute, mbs, **plan), usable)])
