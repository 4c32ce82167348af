"""Checks for lesson 12 (inside one accelerator): the roofline's time bound, the bytes
attention moves naively and in tiles, FP8 quantization with a scale per tensor, row or tile;
and the chip's anatomy (the GPU chapter's practice problems 1-4): CUDA cores, vector FLOP/s,
the rows a matmul needs to be compute-bound, registers and SMEM per GPU."""
from __future__ import annotations

import math
import random

import torch

from ..attention_io import naive_bytes, tiled_bytes
from ..low_precision import fake_quantize
from ..roofline import op_time
from ._core import call_student, compare, differing, explain, fits, report

__all__ = ["check_roofline_time", "check_attention_bytes", "check_fp8_quantize", "check_cuda_cores",
           "check_vector_flops", "check_critical_rows", "check_on_chip_bytes"]


def _close(got, expected, rel: float = 1e-9) -> bool:
    try:
        return abs(float(got) - expected) <= rel * abs(expected) + 1e-30
    except (TypeError, ValueError):
        return False


def _fits(rule, answers) -> bool:
    """Whether `rule` reproduces every answer (a rule may return a tuple: any of its values)."""
    def close(got, value):
        return any(_close(got, v, 1e-6) for v in (value if isinstance(value, tuple) else (value,)))
    return fits(rule, answers, close)


def _named(rules, answers) -> str:
    """The mistake that alone reproduces every answer, or each that does (explain)."""
    return explain([k for k, rule in rules.items() if _fits(rule, answers)])


def check_roofline_time(fn) -> None:
    """`fn(flops, nbytes, peak, bandwidth) -> seconds`: the least time the roofline allows."""
    rng, problems, answers, cases = random.Random(12), [], [], 0
    shapes = [(2e12, 1e9, 989e12, 3.35e12), (1e6, 4e6, 1e11, 2e10), (5e9, 1e7, 1e11, 2e10)]
    for _ in range(9):
        shapes.append((10 ** rng.uniform(5, 13), 10 ** rng.uniform(5, 11), 10 ** rng.uniform(10, 15),
                       10 ** rng.uniform(9, 13)))
    for args in shapes:
        cases += 1
        got = call_student(fn, *args)
        line = compare(f"F={args[0]:.3g} FLOPs, B={args[1]:.3g} bytes, C={args[2]:.3g}, W={args[3]:.3g}",
                       got, op_time(*args), atol=0.0, rtol=1e-9)
        problems += line
        answers.append((args, got))
    if problems:
        rules = {
            "the two times are added: the roofline takes the larger one (memory and arithmetic "
            "overlap; the slower of the two sets the time)": lambda f, b, c, w: f / c + b / w,
            "the smaller of the two times: the bound is the larger — an operation waits for "
            "whichever is slower": lambda f, b, c, w: min(f / c, b / w),
            "FLOPs divided by the bandwidth and bytes by the peak: FLOPs go with C (FLOP/s), "
            "bytes with W (bytes/s)": lambda f, b, c, w: max(f / w, b / c),
            "the bytes are ignored: a memory-bound operation takes bytes / W": lambda f, b, c, w: f / c,
            "the FLOPs are ignored: a compute-bound operation takes FLOPs / C": lambda f, b, c, w: b / w,
        }
        hint = _named(rules, answers)                                     # every answer
        problems = [f"{hint} — {problems[0]}"] if hint else problems
    report("roofline time", problems, passed=cases)


def check_attention_bytes(fn) -> None:
    """`fn(s, d, block, elem, tiled) -> bytes` that one head's attention moves between slow
    memory and the chip: naive (S and P through slow memory) or tiled with blocks of
    `block` rows (Q and O once, K and V once per query block)."""
    cases_in = [(1024, 128, 128, 2), (4096, 64, 64, 2), (1000, 64, 128, 4), (131072, 128, 128, 2),
                (300, 32, 64, 4)]
    problems, answers, lines, cases = [], {True: [], False: []}, {True: [], False: []}, 0
    for s, d, block, elem in cases_in:
        for tiled in (False, True):
            cases += 1
            expected = tiled_bytes(s, d, block, elem) if tiled else naive_bytes(s, d, elem)
            got = call_student(fn, s, d, block, elem, tiled)
            line = compare(f"s={s} d={d} block={block} elem={elem} tiled={tiled}", got, float(expected),
                           atol=0.5, rtol=1e-12)
            answers[tiled].append(((s, d, block, elem), got))
            if line:
                problems += line
                lines[tiled] += line
    if problems:
        naive_rules = {
            "naive: S and P are each written *and read back*: 4s² numbers, not 2s²":
                lambda s, d, b, e: e * (4 * s * d + 2 * s * s),
            "naive: the s×s matrices are missing: S and P each go to slow memory and back (4s²)":
                lambda s, d, b, e: e * 4 * s * d,
            "naive: Q, K, V are read and O written once each: 4sd, not 3sd":
                lambda s, d, b, e: e * (3 * s * d + 4 * s * s),
            "numbers counted, not bytes: multiply by elem (bytes per number)":
                lambda s, d, b, e: 4 * s * d + 4 * s * s,
        }
        tiled_rules = {
            "tiled: every query block reads K *and* V once: (s/B)·2sd, not (s/B)·sd":
                lambda s, d, b, e: e * (2 * s * d + math.ceil(s / b) * s * d),
            "tiled: Q is read and O written once (2sd); only K and V are re-read per query block":
                lambda s, d, b, e: e * (math.ceil(s / b) * 2 * s * d),
            "tiled: a last, partial block is still a block: the number of query blocks is "
            "ceil(s/B), not s/B": lambda s, d, b, e: e * (2 * s * d + s / b * 2 * s * d),
            "tiled: the number of query blocks rounded down: a last, partial block is still a "
            "block — ceil(s/B), not floor": lambda s, d, b, e: e * (2 * s * d + (s // b) * 2 * s * d),
            "tiled: the s×s matrices never leave the chip: no s² term":
                lambda s, d, b, e: e * (2 * s * d + math.ceil(s / b) * 2 * s * d + 4 * s * s),
            "numbers counted, not bytes: multiply by elem (bytes per number)":
                lambda s, d, b, e: 2 * s * d + math.ceil(s / b) * 2 * s * d,
        }
        named = []
        for tiled, rules in ((False, naive_rules), (True, tiled_rules)):
            if lines[tiled]:
                hint = _named(rules, answers[tiled])                  # right answers too
                named += [f"{hint} — {lines[tiled][0]}"] if hint else lines[tiled]
        problems = named
    report("attention bytes", problems, passed=cases)


def _samples():
    g = torch.Generator().manual_seed(12)
    plain = torch.randn(8, 256, generator=g)
    spread = torch.randn(6, 512, generator=g) * torch.logspace(-3, 2, 512)   # channels 1e-3 … 1e2
    rows = torch.randn(16, 384, generator=g) * torch.logspace(-2, 3, 16)[:, None] * 3
    return {"plain (8×256)": plain, "spread channels (6×512)": spread, "spread rows (16×384)": rows}


def check_fp8_quantize(fn) -> None:
    """`fn(x, group) -> tensor`: x rounded to FP8 e4m3 with one scale (amax / 448) per
    tensor, per row or per 1×128 tile, returned in fp32 (the codes times their scales)."""
    problems, cases = [], 0
    for name, x in _samples().items():
        for group in ("tensor", "row", "tile"):
            cases += 1
            expected = fake_quantize(x, group, "e4m3")
            got = call_student(fn, x.clone(), group)
            what = f"{name}, group={group!r}"
            if not isinstance(got, torch.Tensor):
                problems.append(f"{what}: expected a tensor, got {type(got).__name__}")
                continue
            if tuple(got.shape) != tuple(x.shape):
                problems.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(x.shape)} — return "
                                "the dequantized tensor in x's shape")
                continue
            got = got.float()
            if torch.equal(got, expected):
                continue
            problems.append(_fp8_hint(what, x, group, got, expected))
    report("FP8 quantization", problems, passed=cases)


def _same(a, b) -> bool:
    """Equal element by element, NaN where the other has NaN too: a cast past e4m3's largest
    value gives NaN in some torch versions and saturates in others."""
    return b is not None and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _fp8_hint(what, x, group, got, expected) -> str:
    """The line for a wrong answer: every known slip that gives exactly these values (all of
    them when several do), else which element differs."""
    per = {"tensor": "one scale for the whole tensor", "row": "one scale per row",
           "tile": "one scale per 1×128 tile"}
    want = {"tensor": "one amax over the whole tensor", "row": "one amax per row (last dimension)",
            "tile": "one amax per 1×128 piece of each row"}[group]
    slips = {"x cast to FP8 without a scale — values beyond 448 overflow and small ones lose their "
             "digits: divide by a scale amax/448 before the cast": x.float().to(torch.float8_e4m3fn).float()}
    for other in ("tensor", "row", "tile"):
        if other != group:
            slips[f"{per[other]}; group={group!r} wants {want}"] = fake_quantize(x, other, "e4m3")
    slips.update({
        "these are e5m2 values — the exercise asks for torch.float8_e4m3fn (largest 448)":
            fake_quantize(x, group, "e5m2"),
        "the scale used 57,344 (e5m2's largest) with e4m3 codes: scale = amax / 448 for "
        "float8_e4m3fn": _quantize_with(x, group, 57344.0),
        "amax taken as the largest value, not the largest |value|: a negative extreme then "
        "overflows (use x.abs().amax())": _quantize_with(x, group, 448.0, signed_max=True),
        "these are the FP8 codes — multiply them by their scale to return x's values":
            _quantize_with(x, group, 448.0, rescale=False),
    })
    hint = explain([why for why, value in slips.items() if _same(got, value)])
    if hint:
        return f"{what}: {hint}"
    if torch.isnan(got).any():
        return f"{what}: NaN in the result — a scale of 0 (a group of zeros keeps the scale 1)?"
    return (f"{what}: against FP8 e4m3 with one scale amax/448 per {group}, "
            + differing(got, expected, atol=0, rtol=0))


def _quantize_with(x, group, fmax, signed_max=False, rescale=True):
    from ..low_precision import as_groups
    try:
        g = as_groups(x.float(), group)
    except ValueError:
        return None
    amax = (g.amax(dim=1, keepdim=True) if signed_max else g.abs().amax(dim=1, keepdim=True))
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    codes = (g / scale).to(torch.float8_e4m3fn).float()
    return (codes * scale if rescale else codes).reshape(x.shape)



# ------------------------------------------------------------------ inside one GPU
# (SMs, subpartitions per SM, fp32 lanes per subpartition, fp32 clock in Hz): an H100 SXM, an
# A100 (108 SMs, 1.41 GHz), a V100 (80 SMs, 4 subpartitions of 16 fp32 lanes, 1.53 GHz) and a
# made-up chip, so that no single product of the inputs fits a wrong rule by accident
_CHIPS = [(132, 4, 32, 1.98e9), (108, 4, 16, 1.41e9), (80, 4, 16, 1.53e9), (7, 3, 8, 1.0e9)]


def _diagnose(answers, expected_rule, rules, fmt):
    """One line naming the mistake that fits every answer, else the first differing case."""
    problems = [f"{args}: got {got!r}, expected {fmt(expected_rule(*args))}"
                for args, got in answers if not _close(got, expected_rule(*args), 1e-6)]
    if not problems:
        return []
    hint = _named(rules, answers)
    return [f"{hint} — {problems[0]}"] if hint else problems


def check_cuda_cores(fn) -> None:
    """`fn(sms, subpartitions, lanes) -> int`: the fp32 lanes ("CUDA cores") of a whole GPU."""
    answers = [(a[:3], call_student(fn, *a[:3])) for a in _CHIPS]
    rules = {
        "that is one SM's lanes: multiply by the SMs too (per GPU, not per SM)":
            lambda sm, sub, ln: sub * ln,
        "each SM has `subpartitions` SIMD units of `lanes` lanes: multiply by the subpartitions":
            lambda sm, sub, ln: sm * ln,
        "lanes counted once per SM, not per subpartition: the SM's count is subpartitions × lanes":
            lambda sm, sub, ln: sm * sub,
    }
    problems = _diagnose(answers, lambda sm, sub, ln: sm * sub * ln, rules, lambda v: f"{v:,}")
    report("CUDA cores", problems, passed=len(answers))


def check_vector_flops(fn) -> None:
    """`fn(sms, subpartitions, lanes, clock) -> FLOP/s`: the fp32 lanes' peak, counting a
    fused multiply-add as 2 FLOPs (as the datasheet does)."""
    answers = [(a, call_student(fn, *a)) for a in _CHIPS]
    rules = {
        "an FMA (multiply and add in one instruction) counts 2 FLOPs: ×2 — the datasheet's 67 "
        "TFLOP/s for an H100 counts it so": lambda sm, sub, ln, f: sm * sub * ln * f,
        "that is one SM's rate: multiply by the SMs (per GPU, not per SM)":
            lambda sm, sub, ln, f: sub * ln * 2 * f,
        "each SM has `subpartitions` SIMD units: multiply by the subpartitions":
            lambda sm, sub, ln, f: sm * ln * 2 * f,
        "the clock is in Hz (cycles per second), already: no conversion":
            lambda sm, sub, ln, f: sm * sub * ln * 2 * f / 1e9,
        "FLOPs per cycle, not per second: multiply by the clock":
            lambda sm, sub, ln, f: sm * sub * ln * 2,
    }
    problems = _diagnose(answers, lambda sm, sub, ln, f: sm * sub * ln * 2 * f, rules,
                         lambda v: f"{v:.4g}")
    report("vector FLOP/s", problems, passed=len(answers))


# (peak FLOP/s, HBM bytes/s, bytes per element): H100 bf16, B200 bf16, H100 FP8, H100 fp32
# (the fp32 lanes), V100 fp16
_MATMULS = [(989e12, 3.35e12, 2), (2.25e15, 8e12, 2), (1979e12, 3.35e12, 1), (67e12, 3.35e12, 4),
            (125e12, 0.9e12, 2)]


def check_critical_rows(fn) -> None:
    """`fn(peak, bandwidth, elem) -> rows`: the fewest rows B of x for x[B, D] @ W[D, F] (D, F
    large, so the weight's bytes dominate) to reach the ridge: 2BDF FLOPs over elem·DF bytes
    reaches peak / bandwidth when B ≥ elem · peak / (2 · bandwidth) — rows are a count, and the
    course's rule (stated in the exercise, shared with lesson 11's exercise 5) rounds a count up:
    its ceiling (295.2 → 296 for an H100 in bf16); exactly that is accepted."""
    answers = [(a, call_student(fn, *a)) for a in _MATMULS]
    rows = lambda c, w, e: e * c / (2 * w)
    up = lambda bound: (lambda c, w, e: (bound(c, w, e), math.ceil(bound(c, w, e))))  # raw or whole
    rules = {
        "not a whole number: B counts rows, and a count is rounded up (the statement's rule) — "
        "the ceiling of elem·peak / (2·bandwidth) (295.2 → 296)": rows,
        "rounded to the nearest: 295 rows fall short of 295.2 — the fewest whole rows that reach "
        "the ridge is the ceiling, 296": lambda c, w, e: round(rows(c, w, e)),
        "rounded down: ⌊B⌋ rows stay below the ridge — round up (ceil)":
            lambda c, w, e: math.floor(rows(c, w, e)),
        "a multiply-add is 2 FLOPs: the matmul does 2BDF, so B = elem·peak / (2·bandwidth), not "
        "elem·peak / bandwidth": up(lambda c, w, e: e * c / w),
        "that is the ridge in FLOPs per byte (peak / bandwidth): rows need the bytes per element, "
        "B = elem·peak / (2·bandwidth) — the two agree only in 16 bits": up(lambda c, w, e: c / w),
        "bytes per element fixed at 4 (fp32): use elem — a bf16 weight is 2 bytes, FP8 1":
            up(lambda c, w, e: 2 * c / w),
        "bandwidth over peak: the ridge is peak / bandwidth (FLOP/s over bytes/s)":
            up(lambda c, w, e: e * w / (2 * c)),
    }
    problems = _diagnose(answers, lambda c, w, e: math.ceil(rows(c, w, e)), rules, lambda v: f"{v:,}")
    report("critical rows", problems, passed=len(answers))


# (SMs, SMEM bytes per SM, 32-bit registers per subpartition, subpartitions): H100, A100
# (192 KiB of L1/SMEM, 16,384 registers a subpartition), a made-up chip
_MEMORY = [(132, 256 * 2**10, 16384, 4), (108, 192 * 2**10, 16384, 4), (10, 100 * 2**10, 1000, 3)]


def check_on_chip_bytes(fn) -> None:
    """`fn(sms, smem_per_sm, registers_per_subpartition, subpartitions) -> (smem, registers)`:
    bytes of SMEM and of registers in the whole GPU (a register holds 32 bits)."""
    answers, problems = [], []
    for args in _MEMORY:
        got = call_student(fn, *args)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            problems.append(f"{args}: expected a pair (smem bytes, register bytes), got {got!r}")
            continue
        answers.append((args, got))
    if problems:
        report("on-chip bytes", problems[:1], passed=len(_MEMORY))
    smem = [(a, g[0]) for a, g in answers]
    regs = [(a, g[1]) for a, g in answers]
    problems += _diagnose(smem, lambda sm, s, r, sub: sm * s, {
        "SMEM: that is one SM's; multiply by the SMs (per GPU, not per SM)": lambda sm, s, r, sub: s,
        "SMEM is per SM, not per subpartition: SMs × smem_per_sm": lambda sm, s, r, sub: sm * s * sub,
    }, lambda v: f"{v:,}")
    problems += _diagnose(regs, lambda sm, s, r, sub: sm * sub * r * 4, {
        "registers: 32 bits each — multiply the count by 4 bytes": lambda sm, s, r, sub: sm * sub * r,
        "registers: that is one SM's; multiply by the SMs (per GPU, not per SM)":
            lambda sm, s, r, sub: sub * r * 4,
        "registers: each subpartition has its own register file — multiply by the subpartitions":
            lambda sm, s, r, sub: sm * r * 4,
        "registers: 32 bits are 4 bytes, not 32": lambda sm, s, r, sub: sm * sub * r * 32,
    }, lambda v: f"{v:,}")
    report("on-chip bytes", problems, passed=len(_MEMORY))
