"""Lesson 06's "try it": which rank computes which block of the causal score matrix.

    work_per_rank(n, layout, seq)    # unmasked query-key scores each rank computes
    score_grid(n, layout)            # the knob cell: the matrix, blocks coloured by rank

Both read the layout from `picolib.context_parallel.chunk_ids` and the mask from
`picolib.blockwise_attention.visible` (the code lesson 06 §3 shows); tests/lessons/test_tryit_06.py checks `work_per_rank`
against the blocks a real ring counts on its ranks.
"""
from __future__ import annotations

from ..blockwise_attention import unmasked_scores, visible, visible_pairs
from ..context_parallel import LAYOUTS, chunk_len, chunk_ids
from ..style import rank_color

__all__ = ["work_per_rank", "score_grid"]


def work_per_rank(n: int, layout: str = "zigzag", seq: int = 256) -> list[int]:
    """Unmasked scores (query-key pairs) rank r computes in causal attention over `seq`
    tokens cut over `n` ranks in `layout`: rank r's query chunks against every key chunk."""
    c, all_ids = chunk_len(layout, n, seq), [j for r in range(n) for j in chunk_ids(layout, r, n)]
    return [sum(unmasked_scores(kind, c) for *_, kind in visible_pairs(chunk_ids(layout, r, n), all_ids))
            for r in range(n)]


def score_grid(n: int = 4, layout: str = "zigzag", seq: int = 1680, ax=None) -> dict:
    """Draw the causal score matrix in chunk × chunk blocks, each coloured by the rank that
    computes it (the owner of its query chunk), masked blocks blank; print and return the
    work per rank and the ratio of the busiest rank to the idlest. The default 1,680 tokens
    cut into 2N chunks for every N from 1 to 8 (the knob's range)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon, Rectangle

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, not {layout!r}")
    work = work_per_rank(n, layout, seq)
    chunks = n if layout == "contiguous" else 2 * n
    owner = {i: r for r in range(n) for i in chunk_ids(layout, r, n)}
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(4.6, 4.6))
    for i in range(chunks):                  # query chunk i: row i (top to bottom)
        for j in range(chunks):
            kind = visible(i, j)
            y = chunks - 1 - i
            if kind == "full":
                ax.add_patch(Rectangle((j, y), 1, 1, color=rank_color(owner[i]), alpha=0.85))
            elif kind == "diagonal":
                ax.add_patch(Polygon([(j, y), (j, y + 1), (j + 1, y)], color=rank_color(owner[i]),
                                     alpha=0.85))
    for r in range(n):
        ax.plot([], [], "s", color=rank_color(r), label=f"rank {r}")
    ax.set(xlim=(0, chunks), ylim=(0, chunks), aspect="equal", xlabel="key chunk",
           ylabel="query chunk", xticks=[], yticks=[])
    ax.set_title(f"{layout}, N = {n}: who computes which scores", fontsize=10)
    ax.legend(loc="upper right", fontsize=9, frameon=False)   # in the masked (blank) triangle
    if created:                 # handed an ax (a panel of a bigger figure): draw, never show
        plt.show()
    ratio = max(work) / min(work)
    print(f"{layout}, N={n}, {seq} tokens: scores per rank {work}; busiest / idlest = {ratio:.2f}")
    return {"work": work, "ratio": ratio}
