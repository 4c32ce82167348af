"""Checks for lesson 06 (context parallelism).

- `check_merge_partials(fn)`: `fn(o1, lse1, o2, lse2)` → (o, lse): two partial attention
  results over disjoint key blocks (each normalised over its own block, with its
  log-sum-exp) merged into the result over both blocks.
- `check_zigzag_positions(fn)`: `fn(rank, n, seq)` → the positions (a list or a 1-D tensor)
  of the tokens rank `rank` of `n` holds in the zig-zag layout.
- `check_ring_pairs(fn)`: `fn(rank, n, step, layout)` → the (query chunk, key chunk, kind)
  triples rank `rank` computes at ring step `step` (kind "full" or "diagonal"; masked pairs
  left out), chunks numbered in the sequence, in any order.
"""
from __future__ import annotations

import torch

from ..blockwise_attention import block_forward, visible
from ..context_parallel import LAYOUTS, chunk_ids, positions
from ._core import call_student, compare, explain, fits, report

__all__ = ["check_merge_partials", "check_zigzag_positions", "check_ring_pairs"]


def check_merge_partials(fn) -> None:
    """Split the keys of random attention into two blocks (a causal block among them, whose
    first rows see only the diagonal), merge the halves with `fn`, compare with attention
    over all keys — both orders of the blocks."""
    problems, checks, worst = [], 0, 0.0      # worst: o's largest error where dtypes agree
    g = torch.Generator().manual_seed(6)
    for b, a, c, d in ((1, 1, 3, 4), (2, 4, 5, 8)):
        q, k1, v1, k2, v2 = (torch.randn(b, a, c, d, generator=g, dtype=torch.float64) for _ in range(5))
        o1, lse1 = block_forward(q, k1, v1, diagonal=False)    # keys before the queries
        o2, lse2 = block_forward(q, k2, v2, diagonal=True)     # the queries' own chunk
        mask_whole = torch.cat((torch.ones(c, c), torch.ones(c, c).tril()), 1).bool()
        s = (q @ torch.cat((k1, k2), 2).transpose(-2, -1) / d ** 0.5).masked_fill(~mask_whole, float("-inf"))
        o, lse = s.softmax(-1) @ torch.cat((v1, v2), 2), s.logsumexp(-1)
        for order, args in (("(block 1, block 2)", (o1, lse1, o2, lse2)),
                            ("(block 2, block 1)", (o2, lse2, o1, lse1))):
            got = call_student(fn, *(t.clone() for t in args))
            checks += 1
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                problems.append(f"{order}: expected (o, lse), got {type(got).__name__}")
                continue
            casts = [f"{name} is {t.dtype}" for name, t in (("o", got[0]), ("lse", got[1]))
                     if isinstance(t, torch.Tensor) and t.dtype != q.dtype]
            if casts:
                problems.append(f"shape {tuple(q.shape)}, {order}: {' and '.join(casts)}, the inputs "
                                f"{q.dtype} — a cast: return the inputs' dtype (float32 keeps about "
                                f"7 digits, the check compares to 1e-9)")
                continue
            if isinstance(got[0], torch.Tensor) and got[0].shape == o.shape:
                worst = max(worst, (got[0] - o).abs().max().item())
            problems += compare(f"shape {tuple(q.shape)}, {order}: o", got[0], o, atol=1e-9)
            problems += compare(f"shape {tuple(q.shape)}, {order}: lse", got[1], lse, atol=1e-9)
        if not problems:                       # large scores: a naive exp overflows
            checks += 1
            big = (o1, lse1 + 1000.0, o2, lse2 + 1000.0)
            got = call_student(fn, *(t.clone() for t in big))
            bad = not (isinstance(got, (tuple, list)) and len(got) == 2) or any(
                not isinstance(t, torch.Tensor) or not torch.isfinite(t).all() for t in got)
            if bad:
                problems.append("log-sum-exps near 1000 (large scores): the result is not finite "
                                "— exp(lse) overflows: merge with torch.logaddexp and weight each "
                                "oᵢ by exp(lseᵢ − lse), which stays ≤ 1")
            else:
                problems += compare(f"shape {tuple(q.shape)}, lse + 1000: o", got[0], o, atol=1e-9)
                problems += compare(f"shape {tuple(q.shape)}, lse + 1000: lse", got[1],
                                    lse + 1000.0, atol=1e-9)
    if any("o:" in p for p in problems) and not any("a cast" in p for p in problems):
        if worst < 1e-4:              # right to float32's precision: not the formula
            problems.insert(0, f"hint: o is right to about 7 digits only (largest error {worst:.1e}): "
                            "something is computed in float32 — keep the inputs' float64 throughout")
        else:
            problems.insert(0, "hint: each oᵢ is normalised by its own exp(lseᵢ); weight it by "
                            "exp(lseᵢ − lse) with lse = log(exp(lse₁) + exp(lse₂))")
    report("merging partial attention results", problems, checks)


def check_zigzag_positions(fn) -> None:
    """Every rank for n = 1..4 and two lengths; names the contiguous layout if that came back."""
    problems, checks = [], 0
    for n in range(1, 5):
        for seq in (2 * n, 6 * n):
            for r in range(n):
                got = call_student(fn, r, n, seq)
                got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
                want = positions("zigzag", r, n, seq).tolist()
                checks += 1
                if got != want:
                    hint = (" — that is the contiguous layout; zig-zag holds chunks r and 2N−1−r "
                            "of 2N" if got == positions("contiguous", r, n, seq).tolist() else "")
                    problems.append(f"rank {r}, n={n}, seq={seq}: got {got}, expected {want}{hint}")
    report("zig-zag positions", problems, checks)


def _pairs(rank, n, step, layout):
    src = (rank - step) % n
    return sorted((i, j, visible(i, j)) for i in chunk_ids(layout, rank, n)
                  for j in chunk_ids(layout, src, n) if visible(i, j))


# the slips whose pairs a rule gives, each named only when it alone gives every answer
_PAIR_SLIPS = {
    "the K/V at step k come from rank r−k (they travel to the right), not r+k":
        lambda r, n, step, layout: _pairs(r, n, -step, layout),
    **{f"the {fixed} layout's chunks whatever `layout` asks: in the contiguous layout rank r holds "
       "chunk r of N, in zig-zag chunks r and 2N−1−r of 2N":
       (lambda r, n, step, layout, fixed=fixed: _pairs(r, n, step, fixed)) for fixed in LAYOUTS},
}


def check_ring_pairs(fn) -> None:
    """Every rank and step for n = 1..4 in both layouts; names a ring turned the wrong way or
    the other layout's chunks when that slip alone gives every answer."""
    problems, checks, answers = [], 0, []
    for layout in LAYOUTS:
        for n in range(1, 5):
            for r in range(n):
                for step in range(n):
                    got = call_student(fn, r, n, step, layout)
                    want = _pairs(r, n, step, layout)
                    checks += 1
                    try:
                        got = sorted((int(i), int(j), str(kind)) for i, j, kind in got)
                    except (TypeError, ValueError):
                        problems.append(f"{layout}, n={n}, rank {r}, step {step}: expected "
                                        f"(query chunk, key chunk, kind) triples, got {got!r}")
                        continue
                    answers.append(((r, n, step, layout), got))
                    if got != want:
                        problems.append(f"{layout}, n={n}, rank {r}, step {step}: got {got}, "
                                        f"expected {want}")
    if problems and len(answers) == checks:
        hint = explain([why for why, rule in _PAIR_SLIPS.items()
                        if fits(rule, answers, lambda got, value: got == value)])
        problems = [f"{problems[0]} — {hint}"] if hint else problems
    report("ring attention: the blocks a rank computes at each step", problems, checks)
