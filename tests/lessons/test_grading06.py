"""Lesson 06 checks: each accepts a correct answer and rejects plausible wrong ones."""
import re
import contextlib
import pytest
import torch

from picolib.grading import (ExerciseFailed, check_merge_partials, check_ring_pairs,
                             check_zigzag_positions)


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def merge(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return (o1 * (lse1 - lse).exp().unsqueeze(-1) + o2 * (lse2 - lse).exp().unsqueeze(-1)), lse


def merge_by_exp(o1, lse1, o2, lse2):
    """Right on small scores, inf on large ones: exp(lse) overflows."""
    w1, w2 = lse1.exp(), lse2.exp()
    lse = (w1 + w2).log()
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1), lse


def not_written(*args):
    raise NotImplementedError


def test_merge_check_rejects_an_overflowing_merge():
    with fails("not finite — exp\\(lse\\) overflows"):
        check_merge_partials(merge_by_exp)


def test_merge_check():
    check_merge_partials(merge)
    with fails("normalised by its own"):
        check_merge_partials(lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)))
    with fails(r"lse: \d+ of \d+ elements wrong, the first at \[0, 0, 0\]: got"):
        check_merge_partials(lambda o1, l1, o2, l2: (merge(o1, l1, o2, l2)[0], torch.maximum(l1, l2)))
    with fails("not written yet"):
        check_merge_partials(not_written)


def merge_by_softmax(o1, lse1, o2, lse2):
    """Right, written differently: the two weights are a softmax over (lse₁, lse₂)."""
    w = torch.stack((lse1, lse2)).softmax(0).unsqueeze(-1)
    return w[0] * o1 + w[1] * o2, torch.stack((lse1, lse2)).logsumexp(0)


def test_a_cast_gets_the_cast_hint_not_the_formula_hint():
    """06.1 (issue 60): a dtype cast was told its formula is wrong."""
    check_merge_partials(merge_by_softmax)
    with fails("o is torch.float32 and lse is torch.float32, the inputs torch.float64 — a cast") as info:
        check_merge_partials(lambda *a: tuple(t.float() for t in merge(*a)))
    assert "normalised by its own" not in info.value.details
    with fails("right to about 7 digits only") as info:     # float32 inside, float64 returned
        check_merge_partials(lambda *a: tuple(t.double() for t in merge(*(x.float() for x in a))))
    assert "normalised by its own" not in info.value.details


def zigzag(rank, n, seq):
    c = seq // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))


def test_zigzag_check():
    check_zigzag_positions(zigzag)
    check_zigzag_positions(lambda r, n, s: torch.tensor(zigzag(r, n, s)))
    with fails("that is the contiguous layout"):
        check_zigzag_positions(lambda r, n, s: list(range(r * s // n, (r + 1) * s // n)))
    with fails("rank 0, n=2"):       # chunks 2N−r instead of 2N−1−r
        check_zigzag_positions(lambda r, n, s: zigzag(r, n, s)[: s // (2 * n)]
                               + [p + s // (2 * n) for p in zigzag(r, n, s)[s // (2 * n):]])


def ring_pairs(rank, n, step, layout, direction=-1):
    ids = (lambda r: [r]) if layout == "contiguous" else (lambda r: [r, 2 * n - 1 - r])
    src = (rank + direction * step) % n
    return [(i, j, "full" if j < i else "diagonal") for i in ids(rank) for j in ids(src) if j <= i]


def test_ring_pairs_check():
    check_ring_pairs(ring_pairs)
    with fails("travel to the right"):
        check_ring_pairs(lambda r, n, k, layout: ring_pairs(r, n, k, layout, direction=+1))
    with fails("zigzag, n=2"):    # keeps the masked pairs too
        check_ring_pairs(lambda r, n, k, layout: ring_pairs(r, n, k, layout) + (
            [] if layout == "contiguous" or n == 1 else [(r, 2 * n - 1 - r, "masked")]))


def test_ring_pairs_names_a_slip_only_when_it_alone_fits():
    with fails("zig-zag chunks r and 2N−1−r") as info:        # contiguous chunk ids under zig-zag
        check_ring_pairs(lambda r, n, k, layout: ring_pairs(r, n, k, "contiguous"))
    assert "travel to the right" not in info.value.details
    # reversed only for the zig-zag layout: no single slip fits, so the cases are shown plainly
    with fails(r"zigzag, n=3, rank 0, step 1: got .*, expected") as info:
        check_ring_pairs(lambda r, n, k, layout: ring_pairs(r, n, k, layout,
                                                            direction=+1 if layout == "zigzag" else -1))
    assert " — " not in info.value.details


from picolib.grading.lesson06 import _PAIR_SLIPS  # noqa: E402


@pytest.mark.parametrize("name", list(_PAIR_SLIPS))
def test_each_ring_pairs_slip_is_named_alone(name):
    with pytest.raises(ExerciseFailed) as info:
        check_ring_pairs(_PAIR_SLIPS[name])
    (line,) = info.value.problems
    assert line.endswith(name), line
