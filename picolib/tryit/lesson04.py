"""Lesson 04's "try it": what one Llama block costs a rank under tensor parallelism.

    layer_bytes(tp, hidden, n_heads, n_kv_heads, ffn_hidden, tokens)   # the numbers
    tp_layer_bytes(tp, model, seq)                                      # the knob cell (bars)

`layer_bytes` counts the weights a rank stores for one block (attention q, k, v, o;
SwiGLU gate, up, down; the two norms) and the bytes it *sends* for the block's
activation all-reduces in one training step (two forward — g after attention and after
the MLP — and two backward — f before each), each a ring all-reduce of the (tokens, hidden)
activation (`picolib.comm.ring_sent_bytes`). tests/test_tryit_04.py checks both against a
real tensor-parallel TinyLlama block on gloo ranks, its bytes counted as sent on picolib's
rings (`comm.Ledger(rings=True)`).
"""
from __future__ import annotations

from ..comm import ring_sent_bytes
from ..tensor_parallel import kv_heads_per_rank

__all__ = ["LLAMA3", "layer_bytes", "tp_layer_bytes"]

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
    for a, key, label in ((ax[0], "weights", "weights per rank (MB)"),
                          (ax[1], "all_reduce_sent", "all-reduce MB sent per rank per step")):
        heights = [rows[t][key] / 1e6 for t in tps]
        bars = a.bar([str(t) for t in tps], heights, color="#4e79a7")
        bars[tps.index(tp)].set_edgecolor("black")
        bars[tps.index(tp)].set_linewidth(2.5)
        a.set_xlabel("tp"); a.set_title(label, fontsize=10)
    ax[0].figure.suptitle(f"one {model} block, bf16, {seq} tokens", fontsize=10)
    if created:
        ax[0].figure.tight_layout()
        plt.show()
    mine = rows[tp]
    print(f"tp={tp}: {mine['weights'] / 1e6:,.1f} MB of weights per rank, "
          f"{mine['all_reduce_calls']} all-reduces sending {mine['all_reduce_sent'] / 1e6:,.1f} MB "
          f"per layer per step" + (f"; each KV head on {mine['kv_replicas']} ranks"
                                   if mine["kv_replicas"] > 1 else ""))
    return mine
