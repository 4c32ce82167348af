"""Checks for lesson 11 (cluster planning).

- `check_all_reduce_time(fn)`: `fn(nbytes, n_gpus, bandwidth, alpha)` → seconds of a ring
  all-reduce of `nbytes` over `n_gpus` GPUs, each with `bandwidth` bytes/s to the network,
  α = `alpha` s per ring step (picolib.hardware.ring_time).
- `check_critical_tokens(fn)`: `fn(peak_flops, all_reduce_bandwidth, fsdp)` → tokens per GPU
  above which data parallelism (or FSDP) is compute-bound (picolib.hardware.critical_tokens_dp).
- `check_fits(fn)`: `fn(n_params, tp, pp, dp, zero, activation_bytes, hbm)` → (bytes per GPU,
  fits): bf16 mixed precision with Adam, ZeRO over dp (picolib.sharded_optim.zero_memory_bytes).
- `check_sharded_all_reduce(fn)`: `fn(D, F, X, Y, levels)` → seconds of AllReduce over X GPUs
  of bf16[D, F_Y] (Y model-parallel GPUs between them), in-network reduction at every level;
  `levels` = ((S_i, W_i), ...) GPUs under one unit and its total switch bandwidth
  (picolib.hardware.all_reduce_bandwidth with inner=Y). The GPU chapter's problem 1.
- `check_spine_batch(fn)`: `fn(peak_flops, levels, X, Y)` → (tokens per GPU, tokens per model
  replica) above which that all-reduce hides behind backward. The GPU chapter's problem 2.
Each names the common slip when an answer matches it.
"""
from __future__ import annotations

import math

from ..hardware import (GPUS, Hardware, Level, all_reduce_bandwidth, critical_tokens_dp,
                        ring_time, superpod_levels)
from ..sharded_optim import zero_memory_bytes
from ._core import call_student, compare, explain, fits, report

__all__ = ["check_all_reduce_time", "check_critical_tokens", "check_fits", "check_sharded_all_reduce",
           "check_spine_batch", "BOOK_LEVELS", "LINK_LEVELS"]


def _ratio(got, expected):
    try:
        return float(got) / expected
    except (TypeError, ValueError, ZeroDivisionError):
        return None


_RING_SLIPS = {
    "that is one reduce-scatter: an all-reduce is a reduce-scatter and an all-gather, twice the "
    "steps and bytes": lambda b, n, w, a: ring_time("reduce_scatter", b, n, w, a),
    "each rank sends 2(N−1)/N·B, not 2B": lambda b, n, w, a: 2 * b / w + 2 * (n - 1) * a,
    "the latency term 2(N−1)·α is missing": lambda b, n, w, a: 2 * (n - 1) / n * b / w,
    "a ring all-reduce takes 2(N−1) steps, not 2N": lambda b, n, w, a: 2 * (n - 1) / n * b / w + 2 * n * a,
}


def _close_to(got, value) -> bool:
    return abs(float(got) - value) <= 1e-6 * abs(value)


def _named_slip(problems, answers, slips) -> list[str]:
    """The first problem with the slip that alone reproduces every answer (each that does),
    else the problems as they are."""
    hint = explain([why for why, rule in slips.items() if fits(rule, answers, _close_to)])
    return [f"{problems[0]} — {hint}"] if hint and problems else problems


def check_all_reduce_time(fn) -> None:
    """Across nodes (50 GB/s per GPU) and inside one (450 GB/s), small and large buffers."""
    problems, answers = [], []
    cases = ((1e9, 64, 50e9, 5e-6), (4e9, 1024, 50e9, 5e-6), (1e3, 256, 50e9, 5e-6),
             (1e9, 8, 450e9, 2e-6), (2e8, 2, 50e9, 0.0))
    for nbytes, n, w, a in cases:
        got = call_student(fn, nbytes, n, w, a)
        answers.append(((nbytes, n, w, a), got))
        problems += compare(f"B={nbytes:g} bytes, N={n}, W={w / 1e9:g} GB/s, α={a * 1e6:g} µs", got,
                            ring_time("all_reduce", nbytes, n, w, a), atol=0, rtol=1e-6)
    report("ring all-reduce time", _named_slip(problems, answers, _RING_SLIPS), len(cases))


_TWO_LARGE = ("2× too large — one of two slips, which a uniform factor cannot tell apart: the "
              "gradient priced as a ring's two passes (with in-network reduction each GPU sends its "
              "2·D·F bytes once), or backward counted as 2 FLOPs per weight per token (it is 4: the "
              "input gradient and the weight gradient)")
_TWO_SMALL = ("2× too small — one of two slips, which a uniform factor cannot tell apart: backward "
              "counted as 8 FLOPs per weight per token (the book's 2·2·2·B·D·F counts an MLP's two "
              "D × F matrices, against their 2·2·D·F bytes: 4 FLOPs per weight), or the bf16 "
              "gradient counted as 1 byte per weight (it is 2)")
_CRITICAL_SLIPS = {   # each as a factor on the right answer, by fsdp
    _TWO_LARGE: lambda fsdp: 2.0,
    _TWO_SMALL: lambda fsdp: 0.5,
    "FSDP's count is DP's: FSDP moves twice DP's bytes (all-gather the weights + reduce-scatter "
    "the gradients), so it needs twice the tokens": lambda fsdp: 0.5 if fsdp else 1.0,
    "FSDP's count is half DP's: FSDP moves twice the bytes, so it needs twice the tokens, not "
    "half": lambda fsdp: 0.25 if fsdp else 1.0,
}


def check_critical_tokens(fn) -> None:
    """The source's numbers (H100 node, across the spine) and a GB200 NVL72 rack, DP and FSDP."""
    problems, answers, checks = [], [], 0
    for hw, n in (("H100-SXM", 8), ("H100-SXM", 1024), ("GB200-NVL72", 72)):
        peak, bw = GPUS[hw].bf16, all_reduce_bandwidth(hw, n)
        for fsdp in (False, True):
            checks += 1
            expected = critical_tokens_dp(hw, n, fsdp=fsdp)
            got = call_student(fn, peak, bw, fsdp)
            answers.append(((expected, fsdp), got))
            problems += compare(f"C={peak / 1e12:g} TFLOP/s, W={bw / 1e9:g} GB/s, fsdp={fsdp}", got,
                                expected, atol=0, rtol=1e-6)
    slips = {why: (lambda expected, fsdp, factor=factor: factor(fsdp) * expected)
             for why, factor in _CRITICAL_SLIPS.items()}
    report("critical tokens per GPU", _named_slip(problems, answers, slips), checks)


def _fits_reference(n_params, tp, pp, dp, zero, act, hbm):
    psi = n_params // (tp * pp)
    state = zero_memory_bytes(zero, psi, dp, 12, param_bytes=2, grad_bytes=2)
    total = sum(state.values()) + act
    return total, total <= hbm


def _bytes_slips(n, tp, pp, dp, zero, act, hbm) -> dict:
    """The bytes the common slips give in one case, each with its diagnosis (None where the
    slip gives the right answer here)."""
    psi = n // (tp * pp)
    right = _fits_reference(n, tp, pp, dp, zero, act, hbm)[0]
    out = {
        "that is plain DP: ZeRO-1 shards the optimizer state (12 bytes per parameter with the "
        "fp32 master), ZeRO-2 the gradients too, ZeRO-3 all": 16 * psi + act if zero else None,
        "the activations are missing": right - act if act else None,
        "4 bytes per parameter short: Adam's state is 12 bytes (fp32 master 4 + two fp32 moments "
        "8), not 8": right - 4 * (psi if zero == 0 else psi / dp),
    }
    for z in (zero - 1, zero + 1):
        if 1 <= z <= 3:
            out[f"ZeRO-{z}'s count, not ZeRO-{zero}'s: ZeRO-1 shards the optimizer state, ZeRO-2 "
                "also the gradients, ZeRO-3 also the weights"] = _fits_reference(n, tp, pp, dp, z, act, hbm)[0]
    return out


# how a verdict goes wrong when the bytes are right, each as the rule it follows instead
_VERDICT_SLIPS = {
    "exactly hbm bytes fit: use ≤, not <": lambda total, hbm: total < hbm,
    "compared with 80·10⁹ bytes whatever hbm is: compare with the argument hbm (the check "
    "passes several memory sizes)": lambda total, hbm: total <= 80e9,
    "compared with 80 GiB (85.9·10⁹ bytes) whatever hbm is: compare with the argument hbm, "
    "in bytes as given": lambda total, hbm: total <= 80 * 2**30,
    "hbm read as GB and turned into GiB: it is in bytes already (80 GB = 80·10⁹)":
        lambda total, hbm: total <= hbm / 1e9 * 2**30,
}


def check_fits(fn) -> None:
    """Llama-3-70B-sized and 405B-sized cases, ZeRO 0-3, one that just fits and one that just
    does not, on memories of 80·10⁹ bytes (an H100, as the datasheet counts), 40·10⁹, 141·10⁹
    and 192·10⁹ — so a size written into the function shows."""
    cases = ((70_553_706_496, 8, 4, 20, 1, 11_408_506_880, 80e9),
             (70_553_706_496, 8, 1, 80, 0, 2_852_126_720, 80e9),
             (405_853_388_800, 8, 16, 128, 1, 63_896_993_792, 80e9),
             (405_853_388_800, 8, 16, 128, 3, 0, 80e9),
             (8_000_000_000, 1, 1, 8, 2, 20_000_000_000, 80e9),
             (8_000_000_000, 1, 1, 8, 2, 50_000_000_000, 80e9),      # exactly 80 GB: fits
             (8_000_000_000, 1, 1, 8, 2, 50_000_000_001, 80e9),
             (8_000_000_000, 1, 1, 8, 2, 20_000_000_000, 40e9),      # 50 GB: not in 40
             (70_553_706_496, 8, 1, 80, 0, 2_852_126_720, 141e9),    # 144 GB: not in 141
             (70_553_706_496, 8, 1, 32, 1, 50_000_000_000, 141e9),   # 89 GB: fits 141, not 80
             (405_853_388_800, 8, 8, 64, 3, 100_000_000_000, 192e9))  # 102 GB: fits 192, not 80
    problems, verdicts = [], []
    for n, tp, pp, dp, zero, act, hbm in cases:
        n -= n % (tp * pp * dp)                     # keep the shards whole: no padding
        expected = _fits_reference(n, tp, pp, dp, zero, act, hbm)
        got = call_student(fn, n, tp, pp, dp, zero, act, hbm)
        what = (f"N={n:,}, tp={tp}, pp={pp}, dp={dp}, ZeRO-{zero}, activations {act / 1e9:g} GB, "
                f"hbm={hbm:.4g}")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            problems.append(f"{what}: return (bytes, fits), got {got!r}")
            continue
        wrong = compare(what + ": bytes", got[0], float(expected[0]), atol=0.5, rtol=0)
        try:
            float(got[0])
        except (TypeError, ValueError):
            problems += wrong
            continue
        if wrong:
            hint = explain([why for why, value in _bytes_slips(n, tp, pp, dp, zero, act, hbm).items()
                            if value is not None and abs(float(got[0]) - value) < 1])
            problems += [wrong[0] + f" — {hint}"] if hint else wrong
            continue
        verdicts.append(((float(got[0]), hbm), bool(got[1])))
        problems += compare(what + ": fits", bool(got[1]), expected[1])
    if any(": fits" in p for p in problems):        # the bytes right, some verdicts not
        hint = explain([why for why, rule in _VERDICT_SLIPS.items()
                        if fits(rule, verdicts, lambda got, value: got == bool(value))])
        if hint:
            first = next(p for p in problems if ": fits" in p)
            problems = [p for p in problems if ": fits" not in p] + [f"{first} — {hint}"]
    report("does it fit in hbm bytes", problems, len(cases))


# ------------------------------------------- the GPU chapter's problems 1 and 2 (scaling)

# (GPUs under one unit, the unit's total switch bandwidth in bytes/s) of a 1,024-GPU H100
# SuperPod: the scaling book's (every switch priced at 64 × 25 GB/s, spine 25.6 TB/s) and the
# one lesson 00 derived from the InfiniBand switches' 64 × 400 Gb/s ports (spine 51.2 TB/s).
BOOK_LEVELS = tuple((lv.gpus, lv.total) for lv in GPUS["H100-SXM"].levels)
LINK_LEVELS = tuple((lv.gpus, lv.total) for lv in superpod_levels())


def _hw(levels) -> Hardware:
    h = GPUS["H100-SXM"]
    return Hardware("levels", h.bf16, h.fp8, h.memory, h.hbm_bandwidth,
                    tuple(Level(f"L{i}", s, w / s, w) for i, (s, w) in enumerate(levels)))


def _sharded_reference(D, F, X, Y, levels) -> float:
    return 2 * D * F / all_reduce_bandwidth(_hw(levels), X, inner=Y)


def _level_bandwidths(levels, X, Y, share=lambda Y, below: max(Y, below)) -> list[float]:
    """Each level the X·Y GPUs reach: its all-reduce bandwidth per GPU, share·W_i/S_i."""
    below, out = 1, []
    for gpus, total in levels:
        if X * Y > below:
            out.append(share(Y, below) * total / gpus)
        below = gpus
    return out


def _sharded_variants(D, F, X, Y, levels) -> dict:
    """What each common slip gives in one case, by its one-line diagnosis."""
    B = 2 * D * F
    right = lambda share: [B / w for w in _level_bandwidths(levels, X, Y, share)]
    times = right(lambda Y, below: max(Y, below))
    return {
        "B/Y at every level: beyond the node its switch must send every shard, all B bytes — use "
        "max(Y, S_(i−1)), not Y·S_(i−1)": max(right(lambda Y, below: Y * below)),
        "Y is missing: GPUs with different shards share each unit — level i carries "
        "B·S_i/(max(Y, S_(i−1))·W_i)": max(right(lambda Y, below: below)),
        "the fastest level: the slowest level the group reaches sets the time": min(times),
        "the sum of the levels: they overlap, the slowest one sets the time": sum(times),
        "half: bf16 is 2 bytes per element — B = 2·D·F": max(times) / 2,
        "twice: with in-network reduction each GPU sends its bytes once (no 2(N−1)/N ring)":
            max(times) * 2,
        "bits, not bytes? B = 2·D·F bytes against W in bytes/s": max(times) * 8,
    }


def check_sharded_all_reduce(fn) -> None:
    """Inside a node (the problem), across the leaf and the spine (its 'beyond a node'), the
    scaling book's levels and the link-derived ones. A slip is named when it alone gives every
    answer."""
    cases = ((8192, 28672, 8, 1, BOOK_LEVELS), (8192, 28672, 2, 4, BOOK_LEVELS),
             (4096, 16384, 1, 8, BOOK_LEVELS), (8192, 28672, 16, 64, BOOK_LEVELS),
             (8192, 28672, 4, 256, BOOK_LEVELS), (8192, 28672, 4, 256, LINK_LEVELS),
             (16384, 53248, 128, 8, BOOK_LEVELS))
    problems, answers = [], []
    for D, F, X, Y, levels in cases:
        got = call_student(fn, D, F, X, Y, levels)
        answers.append(((D, F, X, Y, levels), got))
        what = (f"D={D}, F={F}, X={X}, Y={Y}, "
                f"{'book' if levels == BOOK_LEVELS else 'link-derived'} levels")
        problems += compare(what, got, _sharded_reference(D, F, X, Y, levels), atol=0, rtol=1e-6)
    slips = {why: (lambda *case, why=why: _sharded_variants(*case)[why])
             for why in _sharded_variants(*cases[0])}
    report("all-reduce of a sharded array", _named_slip(problems, answers, slips), len(cases))


# One rule with lesson 12's exercises: a count of whole things is rounded up and says so; a
# quantity is exact.
ROUNDING = ("a count of whole things (rows, GPUs, tiles, micro-batches) is rounded up, and the "
            "statement says 'rounded up'; a quantity (tokens, bytes, seconds, FLOPs) is exact, "
            "never rounded")
_EXACT = "tokens are a quantity, exact and never rounded (" + ROUNDING + ")"


def _spine_reference(peak, levels, X, Y):
    per_replica = Y * peak / (2 * all_reduce_bandwidth(_hw(levels), X, inner=Y))
    return per_replica / Y, per_replica


def _spine_slips(peak, levels, X, Y) -> dict:
    """What each common slip returns in one case: (tokens per GPU, tokens per replica), the
    replica's count None where the slip says nothing about it."""
    per_gpu, per_replica = _spine_reference(peak, levels, X, Y)
    return {
        "you rounded tokens per GPU first, then multiplied by Y (the book's 77·256 = 19,712): "
        + _EXACT: (per_gpu, round(per_gpu) * Y),
        "tokens rounded up: " + _EXACT: (math.ceil(per_gpu), math.ceil(per_replica)),
        "tokens per GPU rounded: " + _EXACT: (round(per_gpu), per_replica),
        "per GPU is the replica's count — a model replica's Y GPUs share its tokens: divide "
        "by Y": (per_replica, per_replica * Y),
        _TWO_LARGE: (2 * per_gpu, None),
        _TWO_SMALL: (per_gpu / 2, None),
        "W of the fastest level the group reaches, not the slowest: the slowest sets W (the spine at "
        "256-way)": (peak / (2 * max(_level_bandwidths(levels, X, Y))), None),
        "Y is missing from W: a unit of S_(i−1) GPUs holds min(S_(i−1), Y) shards — level i "
        "gives max(Y, S_(i−1))·W_i/S_i per GPU": (
            peak / (2 * min(_level_bandwidths(levels, X, Y, lambda Y, below: below))), None),
        "the book's levels whatever `levels` is given: read W from the argument": (
            _spine_reference(peak, BOOK_LEVELS, X, Y)[0], None),
    }


def check_spine_batch(fn) -> None:
    """256-way model parallelism on 1,024 H100s (the book's spine and the link-derived one),
    64-way, 8-way and a GB200-like peak. A slip is named when it alone reproduces every answer."""
    cases = ((989e12, BOOK_LEVELS, 4, 256), (989e12, LINK_LEVELS, 4, 256),
             (989e12, BOOK_LEVELS, 16, 64), (2.5e15, BOOK_LEVELS, 4, 256), (989e12, BOOK_LEVELS, 128, 8),
             (989e12, LINK_LEVELS, 16, 64))
    problems, answers = [], []
    for peak, levels, X, Y in cases:
        per_gpu, per_replica = _spine_reference(peak, levels, X, Y)
        got = call_student(fn, peak, levels, X, Y)
        what = (f"C={peak / 1e12:g} TFLOP/s, X={X}, Y={Y}, "
                f"{'book' if levels == BOOK_LEVELS else 'link-derived'} levels")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            problems.append(f"{what}: return (tokens per GPU, tokens per model replica), got {got!r}")
            continue
        problems += compare(what + ": tokens per GPU", got[0], per_gpu, atol=0, rtol=1e-6) + \
            compare(what + ": tokens per replica", got[1], per_replica, atol=0, rtol=1e-6)
        answers.append(((peak, levels, X, Y), got))
    if problems and len(answers) == len(cases):
        def same(got, slip):
            close = lambda a, b: abs(float(a) - b) <= 1e-6 * abs(b)
            return close(got[0], slip[0]) and (slip[1] is None or close(got[1], slip[1]))
        names = list(_spine_slips(*cases[0]))
        hint = explain([name for name in names if fits(
            lambda *case, name=name: _spine_slips(*case)[name], answers, same)])
        if hint:
            problems = [f"{problems[0]} — {hint}"]
    report("smallest batch with the all-reduce at the spine", problems, len(cases))
