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
    with fails("must be positive and sum"):
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
    with fails("values differ"):               # only token t−1 and t
        check_slice_mask(lambda s, i: mask(s, i) & ~torch.ones(s[i], sum(s[:i + 1]), dtype=torch.bool)
                         .tril(sum(s[:i]) - 2))
    with fails("not written yet"):
        check_slice_mask(_stub)
