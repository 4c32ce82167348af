"""Lesson 08 checks: each accepts a correct answer and rejects plausible wrong ones."""
import re
import contextlib
import pytest
import torch

from picolib.grading._core import ExerciseFailed
from picolib.grading.lesson08 import check_dp_slicer, check_pipeline_latency, check_slice_mask


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def _stub(*args):
    raise NotImplementedError


def _costs(slices, cost):
    t, ctx = [], 0
    for length in slices:
        t.append(cost(length, ctx))
        ctx += length
    return t


def latency(slices, cost, K):
    t = _costs(slices, cost)
    return sum(t) + (K - 1) * max(t)


def latency_by_waits(slices, cost, K):
    """Right, written differently: stage k finishes slice i after slice i on stage k−1 and
    slice i−1 on stage k (the chain of waits, played out)."""
    done = [0.0] * K
    for t in _costs(slices, cost):
        for k in range(K):
            done[k] = max(done[k], done[k - 1] if k else 0.0) + t
    return done[-1]


def mask_by_positions(slices, i):
    """Right, written differently: compare absolute positions of queries and keys."""
    c = sum(slices[:i])
    q = torch.arange(c, c + slices[i])[:, None]
    return torch.arange(c + slices[i])[None, :] <= q


def test_pipeline_latency_check():
    check_pipeline_latency(latency)
    with fails(r"\[3, 3, 2\] on K=3 stages: got 8.0, expected 14"):
        check_pipeline_latency(lambda s, cost, K: sum(_costs(s, cost)))        # the published "T = 8"
    with fails("Σt alone: the pipeline fill is missing"):
        check_pipeline_latency(lambda s, cost, K: sum(_costs(s, cost)))
    with fails("each slice's cost was taken with no context"):
        check_pipeline_latency(lambda s, cost, K: latency(s, lambda l, c: cost(l, 0), K))  # no context
    with fails("K·max t, not \\(K−1\\)·max t"):
        check_pipeline_latency(lambda s, cost, K: sum(_costs(s, cost)) + K * max(_costs(s, cost)))
    with fails("K·Σt: the stages work one after another"):
        check_pipeline_latency(lambda s, cost, K: K * sum(_costs(s, cost)))
    with fails("not the first or the last"):
        check_pipeline_latency(lambda s, cost, K: sum(_costs(s, cost)) + (K - 1) * _costs(s, cost)[0])
    check_pipeline_latency(latency_by_waits)
    with fails("not written yet"):
        check_pipeline_latency(_stub)


def dp(seq, K, cost):
    best = (float("inf"), None)
    caps = sorted({cost(k, i) for k in range(1, seq + 1) for i in range(seq - k + 1)})
    for cap in caps:
        S, last = [0.0] + [float("inf")] * seq, [0] * (seq + 1)
        for i in range(1, seq + 1):
            for k in range(1, i + 1):
                t = cost(k, i - k)
                if t <= cap and S[i - k] + t < S[i]:
                    S[i], last[i] = S[i - k] + t, k
        if S[seq] + (K - 1) * cap < best[0]:
            cuts, i = [], seq
            while i:
                cuts.append(last[i])
                i -= last[i]
            best = (S[seq] + (K - 1) * cap, cuts[::-1])
    return best[1], best[0]


def test_dp_slicer_check():
    check_dp_slicer(dp)
    with fails("DP slicer"):
        check_dp_slicer(lambda seq, K, cost: ([1] * seq, latency([1] * seq, cost, K)))   # finest cut
    with fails("DP slicer"):
        check_dp_slicer(lambda seq, K, cost: ([seq], latency([seq], cost, K)))           # no cut
    with fails("DP slicer"):                             # Σt only
        check_dp_slicer(lambda seq, K, cost: (lambda s: (s, sum(_costs(s, cost))))(dp(seq, 1, cost)[0]))
    with fails("sum to"):
        check_dp_slicer(lambda seq, K, cost: ([seq, 1], 0.0))
    with fails("not written yet"):
        check_dp_slicer(_stub)


def mask(slices, i):
    start, length = sum(slices[:i]), slices[i]
    return torch.ones(length, start + length, dtype=torch.bool).tril(start)


def test_slice_mask_check():
    check_slice_mask(mask)
    with fails("shape"):                       # no cached context
        check_slice_mask(lambda s, i: torch.ones(s[i], s[i], dtype=torch.bool).tril())
    with fails(r"slices \[3, 3, 2\], slice 1: a top-left causal mask .* bottom-right"):  # SDPA's default
        check_slice_mask(lambda s, i: torch.ones(s[i], sum(s[:i + 1]), dtype=torch.bool).tril())
    with fails("the mask is inverted"):
        check_slice_mask(lambda s, i: ~mask(s, i))
    with fails("the 3 cached context tokens are masked"):
        check_slice_mask(lambda s, i: torch.cat([torch.zeros(s[i], sum(s[:i]), dtype=torch.bool),
                                                 torch.ones(s[i], s[i], dtype=torch.bool).tril()], 1))
    with fails("the mask is transposed"):
        check_slice_mask(lambda s, i: torch.ones(s[i], sum(s[:i + 1]), dtype=torch.bool).triu(sum(s[:i])))
    check_slice_mask(mask_by_positions)
    with fails(r"slices \[3, 3, 2\], slice 0: \d+ of 9 entries wrong, the first: query 2 of the "
               r"slice \(token 2\) and key 0 — got False, expected True"):   # only token t−1 and t
        check_slice_mask(lambda s, i: mask(s, i) & ~torch.ones(s[i], sum(s[:i + 1]), dtype=torch.bool)
                         .tril(sum(s[:i]) - 2))
    with fails("not written yet"):
        check_slice_mask(_stub)


# ---------------------------------------------------------------- issue 37: 08.2's mistakes
def dp_variant(fill=lambda K: K - 1, context=lambda k, i: i - k, reverse=True):
    """The paper's DP with one thing changed: the fill factor, the context a slice is costed
    with, or the rebuilt list left unreversed."""
    def slicer(seq, K, cost):
        best = (float("inf"), None)
        caps = sorted({cost(k, context(k, i)) for i in range(1, seq + 1) for k in range(1, i + 1)})
        for cap in caps:
            S, last = [0.0] + [float("inf")] * seq, [0] * (seq + 1)
            for i in range(1, seq + 1):
                for k in range(1, i + 1):
                    t = cost(k, context(k, i))
                    if t <= cap and S[i - k] + t < S[i]:
                        S[i], last[i] = S[i - k] + t, k
            if S[seq] + fill(K) * cap < best[0]:
                cuts, i = [], seq
                while i:
                    cuts.append(last[i])
                    i -= last[i]
                best = (S[seq] + fill(K) * cap, cuts[::-1] if reverse else cuts)
        return best[1], best[0]
    return slicer


def slicer_by_recursion(seq, K, cost):
    """Right, written differently: every slicing by recursion over the first slice, memoised
    on (start, cap) — no candidate caps, no DP table."""
    from functools import lru_cache

    @lru_cache(None)
    def cheapest(start, cap):        # (Σt, slices) of tokens start… with every t ≤ cap
        if start == seq:
            return 0.0, ()
        options = []
        for length in range(1, seq - start + 1):
            t = cost(length, start)
            if t <= cap:
                rest, cuts = cheapest(start + length, cap)
                options.append((t + rest, (length,) + cuts))
        return min(options, default=(float("inf"), ()))
    caps = {cost(l, c) for c in range(seq) for l in range(1, seq - c + 1)}
    T, slices = min((cheapest(0, cap)[0] + (K - 1) * cap, cheapest(0, cap)[1]) for cap in caps)
    return list(slices), T


@pytest.mark.parametrize("fn, pattern", [
    (dp_variant(fill=lambda K: K), "optimum of Σt \\+ K·max t: the fill is \\(K−1\\)"),
    (dp_variant(fill=lambda K: 0), "optimum of Σt alone"),
    (dp_variant(context=lambda k, i: 0), "no context, cost\\(l, 0\\)"),
    (dp_variant(context=lambda k, i: i), "counting the slice itself"),
    (dp_variant(reverse=False), "the best slicing reversed"),
    (lambda seq, K, cost: ([1] * seq, latency([1] * seq, cost, K)),
     "not optimal: slicing \\[2, 2, 2, 2\\] gives T = 16.5891 < yours 22.1665"),
    (lambda seq, K, cost: ([seq], dp(seq, K, cost)[1]), "is the optimum, but your slices \\[8\\] give"),
    (lambda seq, K, cost: ([0, seq], latency([seq], cost, K)), "a slice of length 0"),
    (lambda seq, K, cost: ([1] * (seq - 1) or [2], 1.0), "sum to 7, not to the sequence's 8 tokens"),
    (lambda seq, K, cost: (dp(seq, K, cost)[0], latency(dp(seq, K, cost)[0], cost, 1)),
     "reach the optimum .* but you return T"),
], ids=["K fill", "no fill", "no context", "context + l", "unreversed", "finest cut",
        "slices not from the best cap", "zero-length slice", "short of seq", "T of other objective"])
def test_dp_slicer_mistakes(fn, pattern):
    with fails(pattern):
        check_dp_slicer(fn)


def test_dp_slicer_right_by_recursion():
    check_dp_slicer(slicer_by_recursion)


def test_pipeline_latency_names_the_context_counting_the_slice():
    with fails(r"each slice's context counts the slice itself, cost\(lᵢ, cᵢ \+ lᵢ\)") as info:
        check_pipeline_latency(lambda s, cost, K: latency(
            s, lambda l, c: cost(l, c + l) if c + l <= sum(s) else cost(l, c), K))
    assert len(info.value.problems) == 1


def test_pipeline_latency_without_a_known_slip_shows_the_slice_times():
    with fails(r"latency of slices .* got .*, expected .* — with tᵢ = cost\(lᵢ, cᵢ\) = \[.*\], Σt = "
               r".* and \(K−1\)·max t = ") as info:
        check_pipeline_latency(lambda s, cost, K: latency(s, cost, K) + 0.5)
    assert "Σt alone" not in info.value.details


from picolib.grading.lesson08 import _LATENCY_SLIPS, _times  # noqa: E402


@pytest.mark.parametrize("name", list(_LATENCY_SLIPS))
def test_each_latency_slip_is_named_alone(name):
    rule = _LATENCY_SLIPS[name]
    with fails(re.escape(name)) as info:
        check_pipeline_latency(lambda s, cost, K: rule(_times(s, cost), K))
    assert len(info.value.problems) == 1 and "fit each" not in info.value.details


# ---------------------------------------------------------------- issue 60: 08.2's hints only when they fit
def greedy_slicer(seq, K, cost):
    """Wrong: for each cap, the longest slice that fits, then the next — greedy, not the DP."""
    best = (float("inf"), None)
    for cap in sorted({cost(l, c) for c in range(seq) for l in range(1, seq - c + 1)}):
        cuts, start = [], 0
        while start < seq and any(cost(l, start) <= cap for l in range(1, seq - start + 1)):
            cuts.append(max(l for l in range(1, seq - start + 1) if cost(l, start) <= cap))
            start += cuts[-1]
        if start == seq and latency(cuts, cost, K) < best[0]:
            best = (latency(cuts, cost, K), cuts)
    return best[1], best[0]


def best_uniform_slicer(seq, K, cost):
    """Wrong: the best of the uniform cuts only."""
    cuts = [[seq // n + (i < seq % n) for i in range(n)] for n in range(1, seq + 1)]
    best = min(cuts, key=lambda c: latency(c, cost, K))
    return best, latency(best, cost, K)


def slicer_by_search(seq, K, cost):
    """Right, written differently: every one of the 2^(seq−1) cuts priced, the cheapest kept."""
    import itertools
    cuts = []
    for bars in itertools.product((0, 1), repeat=seq - 1):
        ends = [i + 1 for i, b in enumerate(bars) if b] + [seq]
        cuts.append([b - a for a, b in zip([0] + ends, ends)])
    best = min(cuts, key=lambda c: latency(c, cost, K))
    return best, latency(best, cost, K)


_DP_HINTS = ("reversed", "optimum of", "no context", "counting the slice itself", "fit each")


@pytest.mark.parametrize("fn", [
    greedy_slicer, best_uniform_slicer,
    dp_variant(context=lambda k, i: k),                 # the slice's length taken as its context
    dp_variant(context=lambda k, i: i - k + 1),         # one token too many before each slice
    dp_variant(context=lambda k, i: max(i - k - 1, 0)),  # one token too few
], ids=["greedy", "best uniform", "context = length", "context + 1", "context − 1"])
def test_dp_slicer_gives_no_hint_that_does_not_fit(fn):
    """Greedy and wrong-context slicers fail, each case said as it is, with no slip named: before,
    a reversal or 'return Σt + (K−1)·max t' was hinted where it happened to match one case."""
    with fails(r"not optimal|reach the optimum .* not their Σt|below the optimum") as info:
        check_dp_slicer(fn)
    assert not any(h in info.value.details for h in _DP_HINTS), info.value.details


def test_dp_slicer_right_by_search():
    check_dp_slicer(slicer_by_search)
