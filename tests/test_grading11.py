"""Lesson 11 checks: each passes a right answer and fails the stub and plausible wrong ones."""
import re
import contextlib
import pytest

from picolib.grading import ExerciseFailed
from picolib.grading.lesson11 import check_all_reduce_time, check_critical_tokens, check_fits


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def stub(*args):
    raise NotImplementedError


def ring_all_reduce(nbytes, n, w, alpha):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / w


def test_all_reduce_time():
    check_all_reduce_time(ring_all_reduce)
    with fails("not written yet"):
        check_all_reduce_time(stub)
    with fails("one reduce-scatter"):
        check_all_reduce_time(lambda b, n, w, a: (n - 1) * a + (n - 1) / n * b / w)
    with fails("latency term"):
        check_all_reduce_time(lambda b, n, w, a: 2 * (n - 1) / n * b / w)
    with fails("not 2B"):
        check_all_reduce_time(lambda b, n, w, a: 2 * (n - 1) * a + 2 * b / w)


def test_critical_tokens():
    check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * c / (2 * w))
    with fails("not written yet"):
        check_critical_tokens(stub)
    with fails("FSDP moves twice"):
        check_critical_tokens(lambda c, w, fsdp: c / (2 * w))
    with fails("2× too large"):
        check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * c / w)


def fits(n, tp, pp, dp, zero, act, hbm):
    psi = n / (tp * pp)
    weights, grads, opt = 2 * psi, 2 * psi, 12 * psi
    if zero >= 1:
        opt /= dp
    if zero >= 2:
        grads /= dp
    if zero == 3:
        weights /= dp
    total = weights + grads + opt + act
    return total, total <= hbm


def test_fits():
    check_fits(fits)
    with fails("not written yet"):
        check_fits(stub)
    with fails("plain DP"):
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, 0, a, hbm))
    with fails("activations are missing"):
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, z, 0, hbm))
    with fails("fits"):              # 80 GiB instead of 80 GB
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, z, a, 80 * 2**30))
