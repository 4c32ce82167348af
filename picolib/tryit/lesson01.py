"""Lesson 01, try it: the four kinds of training memory of the tiny Llama, measured.

    from picolib.tryit import knobs
    from picolib.tryit.lesson01 import memory_bars
    knobs(memory_bars, batch=(1, 8, 1), seq=[64, 128, 256], recompute=["none", "selective", "full"])

One fp32 Adam step on `TinyLlama(LlamaConfig(max_seq=...))`; parameters, gradients and
optimizer state come from picolib.memory's storage counts, activations from
`SavedActivations` (bytes autograd saved for backward during the forward)."""
from __future__ import annotations

import torch

from ..memory import Breakdown, SavedActivations, measure, plot_breakdown
from ..model import LlamaConfig, TinyLlama, random_tokens

RECOMPUTE = ("none", "selective", "full")


def memory_bars(batch: int = 1, seq: int = 64, recompute: str = "none", attn_impl: str = "eager",
                plot: bool = True) -> Breakdown:
    """Measure one training step of the tiny Llama (h=64, L=4) at micro-batch `batch` and
    sequence length `seq` with `recompute` ∈ none/selective/full; draw one bar per kind of
    memory. Returns the Breakdown (bytes)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    batch, seq = int(batch), int(seq)
    cfg = LlamaConfig(max_seq=max(seq, 256), recompute=recompute, attn_impl=attn_impl)
    model = TinyLlama(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = random_tokens(batch, seq, cfg.vocab_size)
    with SavedActivations(model) as act:
        loss = model.loss(x, y)
    loss.backward()
    opt.step()
    bd = measure(model, opt, act)
    if plot:
        import matplotlib.pyplot as plt
        rows = {kind: Breakdown(**{kind: getattr(bd, kind)})
                for kind in ("params", "grads", "optimizer", "activations")}
        ax = plot_breakdown(rows, title=f"b={batch}, s={seq}, recompute={recompute}: "
                                        f"{bd.total / 2**20:.2f} MiB")
        ax.get_legend().remove()
        plt.show()
    return bd
