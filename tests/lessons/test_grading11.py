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
    with fails("FSDP's count is DP's: FSDP moves twice DP's bytes"):
        check_critical_tokens(lambda c, w, fsdp: c / (2 * w))
    with fails("2× too large"):
        check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * c / w)
    # a ring-priced all-reduce (2·2DF bytes against 4DF/C): named with its twin, not as FLOPs alone
    with fails("2× too large — one of two slips") as info:
        check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * (2 * 2 / w) / (4 / c))
    assert "ring's two passes" in info.value.details
    # wrong FLOPs (8 per weight per token): not told about in-network reduction
    with fails("2× too small — one of two slips") as info:
        check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * (2 / w) / (8 / c))
    assert "8 FLOPs per weight" in info.value.details and "in-network" not in info.value.details
    check_critical_tokens(lambda c, w, fsdp: c * 2 * (1 + fsdp) / (4 * w))   # right, written differently


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


# ---------------------------------------------- issue 37: one wrong answer per common mistake

def test_all_reduce_time_two_n_steps():
    with fails("2\\(N−1\\) steps, not 2N"):
        check_all_reduce_time(lambda b, n, w, a: 2 * n * a + 2 * (n - 1) / n * b / w)


def test_critical_tokens_w_counted_twice():
    with fails("2× too small — one of two slips"):
        check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * c / (4 * w))


def test_fits_more_mistakes():
    with fails("Adam's state is 12 bytes"):
        check_fits(lambda n, tp, pp, dp, z, a, hbm: (
            fits(n, tp, pp, dp, z, a, hbm)[0] - 4 * n / (tp * pp) / (dp if z else 1),) * 1
            + (True,))
    with fails("ZeRO-1's count, not ZeRO-2's"):  # ZeRO-2 that forgets to shard the gradients
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, 1 if z == 2 else z, a, hbm))
    with fails("use ≤, not <"):
        check_fits(lambda n, tp, pp, dp, z, a, hbm: (fits(n, tp, pp, dp, z, a, hbm)[0],
                                                     fits(n, tp, pp, dp, z, a, hbm)[0] < hbm))
    with fails("compared with 80 GiB \\(85.9·10⁹ bytes\\) whatever hbm is"):
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, z, a, 80 * 2**30))
    with fails("return \\(bytes, fits\\)"):
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, z, a, hbm)[0])


# --------------------------------------------- issue 38: the GPU chapter's problems 1 and 2

from picolib.grading.lesson11 import BOOK_LEVELS, LINK_LEVELS, check_sharded_all_reduce, check_spine_batch


def sharded_all_reduce(D, F, X, Y, levels):
    """The rule of the book: level i carries B·S_i/(max(Y, S_(i−1))·W_i), the slowest sets T."""
    nbytes, span, below, worst = 2 * D * F, X * Y, 1, 0.0
    for gpus, total in levels:
        if span > below:
            worst = max(worst, nbytes * gpus / (max(Y, below) * total))
        below = gpus
    return worst


def _levels_with(rule):
    def fn(D, F, X, Y, levels):
        out, below = [], 1
        for gpus, total in levels:
            if X * Y > below:
                out.append(rule(2 * D * F, gpus, total, Y, below))
            below = gpus
        return out
    return fn


def test_sharded_all_reduce():
    check_sharded_all_reduce(sharded_all_reduce)
    # written differently: B/Y per GPU in a node over one GPU's share of the switch
    check_sharded_all_reduce(lambda D, F, X, Y, lv: max(
        2 * D * F * s / (max(Y, b) * w) for (s, w), b in zip(lv, (1,) + tuple(x[0] for x in lv))
        if X * Y > b))
    with fails("not written yet"):
        check_sharded_all_reduce(stub)
    with fails("must send every shard"):
        check_sharded_all_reduce(lambda *a: max(_levels_with(lambda B, s, w, Y, b: B * s / (Y * b * w))(*a)))
    with fails("Y is missing"):
        check_sharded_all_reduce(lambda *a: max(_levels_with(lambda B, s, w, Y, b: B * s / (b * w))(*a)))
    with fails("the fastest level"):
        check_sharded_all_reduce(lambda *a: min(_levels_with(lambda B, s, w, Y, b: B * s / (max(Y, b) * w))(*a)))
    with fails("the sum of the levels"):
        check_sharded_all_reduce(lambda *a: sum(_levels_with(lambda B, s, w, Y, b: B * s / (max(Y, b) * w))(*a)))
    with fails("2 bytes per element"):
        check_sharded_all_reduce(lambda D, F, X, Y, lv: sharded_all_reduce(D, F, X, Y, lv) / 2)
    with fails("sends its bytes once"):
        check_sharded_all_reduce(lambda D, F, X, Y, lv: sharded_all_reduce(D, F, X, Y, lv) * 2)


def spine_batch(peak, levels, X, Y):
    w = 2 * 1 * 1 / sharded_all_reduce(1, 1, X, Y, levels)        # bytes/s for B = 2 bytes
    per_replica = Y * peak / (2 * w)
    return per_replica / Y, per_replica


def test_spine_batch():
    check_spine_batch(spine_batch)
    per_gpu, per_replica = spine_batch(989e12, BOOK_LEVELS, 4, 256)
    assert round(per_gpu, 1) == 77.3 and round(per_replica) == 19_780 and round(per_gpu) * 256 == 19_712
    per_gpu, per_replica = spine_batch(989e12, LINK_LEVELS, 4, 256)
    assert round(per_gpu, 1) == 38.6 and round(per_replica) == 9_890
    with fails("not written yet"):
        check_spine_batch(stub)
    with fails("rounded tokens per GPU first"):
        check_spine_batch(lambda c, lv, X, Y: (spine_batch(c, lv, X, Y)[0], round(spine_batch(c, lv, X, Y)[0]) * Y))
    with fails("divide by Y"):
        check_spine_batch(lambda c, lv, X, Y: (spine_batch(c, lv, X, Y)[1], spine_batch(c, lv, X, Y)[1] * Y))
    with fails("2× too large — one of two slips"):    # a ring's two passes, or 2 FLOPs a weight
        check_spine_batch(lambda c, lv, X, Y: tuple(2 * t for t in spine_batch(c, lv, X, Y)))
    with fails("2× too small — one of two slips") as info:   # 8 FLOPs a weight, or 1 byte
        check_spine_batch(lambda c, lv, X, Y: tuple(t / 2 for t in spine_batch(c, lv, X, Y)))
    assert "in-network" not in info.value.details
    import math
    with fails("tokens rounded up: tokens are a quantity, exact and never rounded"):
        check_spine_batch(lambda c, lv, X, Y: tuple(math.ceil(t) for t in spine_batch(c, lv, X, Y)))
    with fails("tokens per GPU: got 77, .*tokens per GPU rounded: tokens are a quantity"):
        check_spine_batch(lambda c, lv, X, Y: (round(spine_batch(c, lv, X, Y)[0]), spine_batch(c, lv, X, Y)[1]))
    with fails("not the slowest"):                       # the leaf's 12.8 TB/s instead of the spine's
        def leaf(c, lv, X, Y):
            below, ws = 1, []
            for s, w in lv:
                if X * Y > below:
                    ws.append(max(Y, below) * w / s)
                below = s
            return c / (2 * max(ws)), Y * c / (2 * max(ws))
        check_spine_batch(leaf)
    with fails("return \\(tokens per GPU"):
        check_spine_batch(lambda c, lv, X, Y: spine_batch(c, lv, X, Y)[0])


def fits_by_parts(n, tp, pp, dp, zero, act, hbm):
    """Right, written differently: bytes per parameter summed by stage, the verdict as a
    negation."""
    per = {0: 16, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[zero]
    total = per * n / (tp * pp) + act
    return total, not total > hbm


def test_fits_reads_hbm():
    check_fits(fits_by_parts)
    with fails("compared with 80·10⁹ bytes whatever hbm is: compare with the argument hbm") as info:
        check_fits(lambda n, tp, pp, dp, z, a, hbm: fits(n, tp, pp, dp, z, a, 80e9))
    assert len(info.value.problems) == 1 and "or " not in info.value.problems[0], info.value.details


def spine_batch_written_in(peak, levels, X, Y):
    """Wrong: the book's spine figure written in (6.4 TB/s per GPU at 256-way), C/(2W) right —
    2× off on the link-derived spine, so not a C/W mistake."""
    return peak / (2 * 6.4e12), Y * peak / (2 * 6.4e12)


def spine_batch_by_levels(peak, levels, X, Y):
    """Right, written differently: the slowest level's bandwidth per GPU, then C/(2W)."""
    reached = [(s, w, b) for (s, w), b in zip(levels, (1,) + tuple(s for s, _ in levels)) if X * Y > b]
    w = min(max(Y, b) * t / s for s, t, b in reached)
    return peak / w / 2, peak / w / 2 * Y


def test_spine_batch_names_a_slip_only_when_it_alone_fits():
    check_spine_batch(spine_batch_by_levels)
    with pytest.raises(ExerciseFailed) as info:
        check_spine_batch(spine_batch_written_in)
    assert "2× too large" not in info.value.details, info.value.details
    assert "tokens per GPU: got" in info.value.details


def test_critical_tokens_w_counted_twice_is_not_called_an_fsdp_mistake():
    with pytest.raises(ExerciseFailed) as info:
        check_critical_tokens(lambda c, w, fsdp: (2 if fsdp else 1) * c / (4 * w))
    assert "FSDP" not in info.value.details and "2× too small — one of two slips" in info.value.details
    assert len(info.value.problems) == 1


def test_all_reduce_time_names_a_slip_only_when_it_fits_every_case():
    # N steps of latency where 2(N−1) are due, and only beyond 8 GPUs: no single slip gives that
    with pytest.raises(ExerciseFailed) as info:
        check_all_reduce_time(lambda b, n, w, a: ring_all_reduce(b, n, w, a) + (2 * a if n > 8 else 0))
    assert " — " not in info.value.details, info.value.details
    check_all_reduce_time(lambda b, n, w, a: 2 * (n - 1) * (a + b / (n * w)))   # right, factored


# every known slip run through its check: the check names it (and only names another slip with
# it where the two give the same answers in every case)
from picolib.grading import lesson11 as _l11  # noqa: E402


def _named_alone_or_with_twins(check, name, student):
    with pytest.raises(ExerciseFailed) as info:
        check(student)
    (line,) = info.value.problems
    assert name in line, line
    return line


@pytest.mark.parametrize("name", list(_l11._RING_SLIPS))
def test_each_ring_slip_is_named(name):
    _named_alone_or_with_twins(check_all_reduce_time, name, _l11._RING_SLIPS[name])


@pytest.mark.parametrize("name", list(_l11._CRITICAL_SLIPS))
def test_each_critical_tokens_slip_is_named(name):
    factor = _l11._CRITICAL_SLIPS[name]
    line = _named_alone_or_with_twins(check_critical_tokens, name,
                                      lambda c, w, fsdp: factor(fsdp) * (2 if fsdp else 1) * c / (2 * w))
    assert "fit each" not in line, line


@pytest.mark.parametrize("name", list(_l11._sharded_variants(8192, 28672, 8, 1, BOOK_LEVELS)))
def test_each_sharded_all_reduce_slip_is_named(name):
    line = _named_alone_or_with_twins(check_sharded_all_reduce, name,
                                      lambda *case: _l11._sharded_variants(*case)[name])
    assert "fit each" not in line, line


@pytest.mark.parametrize("name", list(_l11._spine_slips(989e12, BOOK_LEVELS, 4, 256)))
def test_each_spine_slip_is_named(name):
    def student(*case):
        per_gpu, replica = _l11._spine_slips(*case)[name]
        return per_gpu, replica if replica is not None else per_gpu * case[3]
    line = _named_alone_or_with_twins(check_spine_batch, name, student)
    assert "fit each" not in line, line
