"""Lesson 12 checks: each passes right answers (the reference and ones written differently)
and fails each typical wrong one with a one-line diagnosis that names it."""
import contextlib
import math
import re

import pytest
import torch

from picolib.grading import (ExerciseFailed, check_attention_bytes, check_fp8_quantize,
                             check_roofline_time)


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def _not_written(*args):
    raise NotImplementedError


# ------------------------------------------------------------------ roofline time
def test_roofline_time_right_answers_pass():
    check_roofline_time(lambda f, b, c, w: max(f / c, b / w))
    check_roofline_time(lambda f, b, c, w: (b / w if f / b < c / w else f / c))   # by the ridge


@pytest.mark.parametrize("fn, pattern", [
    (lambda f, b, c, w: f / c + b / w, "the two times are added"),
    (lambda f, b, c, w: min(f / c, b / w), "the smaller of the two times"),
    (lambda f, b, c, w: max(f / w, b / c), "FLOPs go with C"),
    (lambda f, b, c, w: f / c, "the bytes are ignored"),
    (lambda f, b, c, w: b / w, "the FLOPs are ignored"),
], ids=["sum", "min", "swapped", "compute only", "memory only"])
def test_roofline_time_names_each_mistake(fn, pattern):
    with fails(pattern) as info:
        check_roofline_time(fn)
    assert len(info.value.problems) == 1 and "fit each" not in info.value.details


def test_roofline_time_not_written():
    with fails("not written yet"):
        check_roofline_time(_not_written)


# ------------------------------------------------------------------ attention bytes
def attention_bytes(s, d, block, elem, tiled):
    if not tiled:
        return elem * (4 * s * d + 4 * s * s)
    return elem * (2 * s * d + math.ceil(s / block) * 2 * s * d)


def attention_bytes_loop(s, d, block, elem, tiled):
    """Right, written differently: walk the blocks and add what each loads and stores."""
    if not tiled:
        return elem * sum([s * d, s * d, s * s, s * s, s * s, s * s, s * d, s * d])
    total = 0
    for start in range(0, s, block):
        rows = min(block, s - start)
        total += rows * d + 2 * s * d + rows * d     # Q block in, K and V stream, O block out
    return elem * total


def test_attention_bytes_right_answers_pass():
    check_attention_bytes(attention_bytes)
    check_attention_bytes(attention_bytes_loop)


def _naive(rule):
    return lambda s, d, b, e, tiled: attention_bytes(s, d, b, e, True) if tiled else rule(s, d, b, e)


def _tiled(rule):
    return lambda s, d, b, e, tiled: rule(s, d, b, e) if tiled else attention_bytes(s, d, b, e, False)


@pytest.mark.parametrize("fn, pattern", [
    (_naive(lambda s, d, b, e: e * (4 * s * d + 2 * s * s)), "naive: S and P are each written \\*and read back\\*"),
    (_naive(lambda s, d, b, e: e * 4 * s * d), "naive: the s×s matrices are missing"),
    (_naive(lambda s, d, b, e: e * (3 * s * d + 4 * s * s)), "naive: Q, K, V are read and O written once"),
    (_tiled(lambda s, d, b, e: e * (2 * s * d + math.ceil(s / b) * s * d)), "tiled: every query block reads K \\*and\\* V"),
    (_tiled(lambda s, d, b, e: e * math.ceil(s / b) * 2 * s * d), "tiled: Q is read and O written once"),
    (_tiled(lambda s, d, b, e: e * (2 * s * d + s / b * 2 * s * d)), "a last, partial block is still a block"),
    (_tiled(lambda s, d, b, e: attention_bytes(s, d, b, e, True) + 4 * e * s * s), "never leave the chip"),
    (lambda s, d, b, e, tiled: attention_bytes(s, d, b, e, tiled) // e, "numbers counted, not bytes"),
], ids=["naive 2s²", "naive no s²", "naive 3sd", "tiled K only", "tiled Q re-read", "partial block",
        "tiled s²", "numbers not bytes"])
def test_attention_bytes_names_each_mistake(fn, pattern):
    with fails(pattern) as info:
        check_attention_bytes(fn)
    assert len(info.value.problems) <= 2      # one line per part (naive, tiled) that is wrong
    assert "fit each" not in info.value.details


# ------------------------------------------------------------------ FP8 quantization
def _fp8(x, group, fmax=448.0, dtype=torch.float8_e4m3fn, tile=128, abs_max=True, rescale=True,
         scaled=True):
    g = {"tensor": x.reshape(1, -1), "row": x.reshape(-1, x.shape[-1]), "tile": x.reshape(-1, tile)}[group]
    amax = (g.abs() if abs_max else g).amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)) if scaled else torch.ones_like(amax)
    codes = (g / scale).to(dtype).float()
    return (codes * scale if rescale else codes).reshape(x.shape)


def fp8_by_tiles(x, group):
    """Right, written differently: unflatten into (rows, tiles, 128) for the tile case."""
    if group != "tile":
        return _fp8(x, group)
    t = x.reshape(-1, x.shape[-1] // 128, 128)
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    return ((t / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def test_fp8_quantize_right_answers_pass():
    check_fp8_quantize(lambda x, group: _fp8(x, group))
    check_fp8_quantize(fp8_by_tiles)


@pytest.mark.parametrize("fn, pattern", [
    (lambda x, g: _fp8(x, g, scaled=False), "cast to FP8 without a scale"),
    (lambda x, g: _fp8(x, g) * float("nan"), "NaN in the result"),
    (lambda x, g: _fp8(x, "tensor"), "one scale for the whole tensor; group='row' wants one amax per row"),
    (lambda x, g: _fp8(x, "row"), "one scale per row; group='tile' wants one amax per 1×128 piece"),
    (lambda x, g: _fp8(x, g, dtype=torch.float8_e5m2, fmax=57344.0), "these are e5m2 values"),
    (lambda x, g: _fp8(x, g, fmax=57344.0), "the scale used 57,344"),
    (lambda x, g: _fp8(x, g, abs_max=False), "not the largest \\|value\\|"),
    (lambda x, g: _fp8(x, g, rescale=False), "these are the FP8 codes — multiply them by their scale"),
    (lambda x, g: _fp8(x, g)[..., :-1], "return the dequantized tensor in x's shape"),
], ids=["no scale", "nan", "per tensor", "per row", "e5m2", "e5m2 max", "signed max", "codes", "shape"])
def test_fp8_quantize_names_each_mistake(fn, pattern):
    with fails(pattern) as info:
        check_fp8_quantize(fn)
    assert "fit each" not in info.value.details


def test_fp8_quantize_not_written_and_wrong_type():
    with fails("not written yet"):
        check_fp8_quantize(_not_written)
    with fails("expected a tensor"):
        check_fp8_quantize(lambda x, g: x.tolist())


# ------------------------------------------------------------------ inside one GPU (problems 1-4)
from picolib.grading import (check_critical_rows, check_cuda_cores, check_on_chip_bytes,  # noqa: E402
                             check_vector_flops)


def test_chip_anatomy_right_answers_pass():
    check_cuda_cores(lambda sm, sub, ln: sm * sub * ln)
    check_cuda_cores(lambda sm, sub, ln: sum(ln for _ in range(sm * sub)))          # counted
    check_vector_flops(lambda sm, sub, ln, f: sm * sub * ln * 2 * f)
    check_vector_flops(lambda sm, sub, ln, f: (sm * sub * ln) * f * 2.0)
    check_critical_rows(lambda c, w, e: math.ceil(e * c / (2 * w)))
    check_critical_rows(lambda c, w, e: -(-(c / w) // (2 / e)))                    # ridge / (FLOPs per byte per row), rounded up
    check_on_chip_bytes(lambda sm, s, r, sub: (sm * s, sm * sub * r * 4))
    check_on_chip_bytes(lambda sm, s, r, sub: [s * sm, r * 32 // 8 * sub * sm])


def test_chip_anatomy_blanks_fail():
    for check in (check_cuda_cores, check_vector_flops, check_critical_rows, check_on_chip_bytes):
        with fails("not written yet"):
            check(_not_written)


@pytest.mark.parametrize("check, fn, pattern", [
    (check_cuda_cores, lambda sm, sub, ln: sub * ln, "per GPU, not per SM"),
    (check_cuda_cores, lambda sm, sub, ln: sm * ln, "multiply by the subpartitions"),
    (check_cuda_cores, lambda sm, sub, ln: sm * sub, "subpartitions × lanes"),
    (check_vector_flops, lambda sm, sub, ln, f: sm * sub * ln * f, "an FMA .* counts 2 FLOPs"),
    (check_vector_flops, lambda sm, sub, ln, f: sub * ln * 2 * f, "per GPU, not per SM"),
    (check_vector_flops, lambda sm, sub, ln, f: sm * ln * 2 * f, "multiply by the subpartitions"),
    (check_vector_flops, lambda sm, sub, ln, f: sm * sub * ln * 2 * f / 1e9, "already: no conversion"),
    (check_vector_flops, lambda sm, sub, ln, f: sm * sub * ln * 2, "multiply by the clock"),
    (check_critical_rows, lambda c, w, e: e * c / w, "a multiply-add is 2 FLOPs"),
    (check_critical_rows, lambda c, w, e: c / w, "that is the ridge in FLOPs per byte"),
    (check_critical_rows, lambda c, w, e: 2 * c / w, "fixed at 4 \\(fp32\\)"),
    (check_critical_rows, lambda c, w, e: e * w / (2 * c), "bandwidth over peak"),
    (check_critical_rows, lambda c, w, e: math.ceil(e * c / w), "a multiply-add is 2 FLOPs"),
    (check_critical_rows, lambda c, w, e: e * c / (2 * w), "not a whole number: B counts rows"),
    (check_critical_rows, lambda c, w, e: round(e * c / (2 * w)), "rounded to the nearest: 295 rows fall short"),
    (check_critical_rows, lambda c, w, e: int(e * c / (2 * w)), "rounded down: ⌊B⌋ rows stay below"),
    (check_on_chip_bytes, lambda sm, s, r, sub: (s, sm * sub * r * 4), "SMEM: that is one SM's"),
    (check_on_chip_bytes, lambda sm, s, r, sub: (sm * s * sub, sm * sub * r * 4), "SMEM is per SM, not per subpartition"),
    (check_on_chip_bytes, lambda sm, s, r, sub: (sm * s, sm * sub * r), "multiply the count by 4 bytes"),
    (check_on_chip_bytes, lambda sm, s, r, sub: (sm * s, sub * r * 4), "registers: that is one SM's"),
    (check_on_chip_bytes, lambda sm, s, r, sub: (sm * s, sm * r * 4), "its own register file"),
    (check_on_chip_bytes, lambda sm, s, r, sub: (sm * s, sm * sub * r * 32), "4 bytes, not 32"),
], ids=["cores per SM", "cores no subpartitions", "cores no lanes", "no FMA", "flops per SM",
        "flops no subpartitions", "clock as GHz", "no clock", "rows no FMA", "rows = ridge", "rows fp32",
        "rows swapped", "rows no FMA ceil", "rows unrounded", "rows rounded", "rows floored", "smem per SM", "smem per subpartition", "register words", "registers per SM",
        "registers no subpartitions", "register bits"])
def test_chip_anatomy_names_each_mistake(check, fn, pattern):
    with fails(pattern) as info:
        check(fn)
    assert len(info.value.problems) == 1 and "fit each" not in info.value.details


def test_on_chip_bytes_wants_a_pair():
    with fails("expected a pair"):
        check_on_chip_bytes(lambda sm, s, r, sub: sm * s)


def test_a_rounded_down_block_count_is_named_as_such():
    with fails("number of query blocks rounded down: a last, partial block is still a block") as info:
        check_attention_bytes(lambda s, d, b, e, tiled: e * (2 * s * d + (s // b) * 2 * s * d)
                              if tiled else attention_bytes(s, d, b, e, False))
    assert "Q is read and O written once" not in info.value.details


def test_fp8_with_an_unknown_mistake_says_which_element_differs():
    with fails(r"group='tensor': against FP8 e4m3 with one scale amax/448 per tensor, \d+ of 2048 "
               r"elements wrong, the first at \[\d+, \d+\]: got -?[\d.e+-]+, expected") as info:
        check_fp8_quantize(lambda x, g: _fp8(x, g, fmax=440.0))
    assert "values differ" not in info.value.details
