"""Checks for lesson 11 (cluster planning).

- `check_all_reduce_time(fn)`: `fn(nbytes, n_gpus, bandwidth, alpha)` → seconds of a ring
  all-reduce of `nbytes` over `n_gpus` GPUs, each with `bandwidth` bytes/s to the network,
  α = `alpha` s per ring step (picolib.hardware.ring_time).
- `check_critical_tokens(fn)`: `fn(peak_flops, all_reduce_bandwidth, fsdp)` → tokens per GPU
  above which data parallelism (or FSDP) is compute-bound (picolib.hardware.critical_tokens_dp).
- `check_fits(fn)`: `fn(n_params, tp, pp, dp, zero, activation_bytes, hbm)` → (bytes per GPU,
  fits): bf16 mixed precision with Adam, ZeRO over dp (picolib.sharded_optim.zero_memory_bytes).
Each names the common slip when an answer matches it.
"""
from __future__ import annotations

from ..hardware import PRESETS, all_reduce_bandwidth, critical_tokens_dp, ring_time
from ..sharded_optim import zero_memory_bytes
from ._core import call_student, compare, report

__all__ = ["check_all_reduce_time", "check_critical_tokens", "check_fits"]


def _ratio(got, expected):
    try:
        return float(got) / expected
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def check_all_reduce_time(fn) -> None:
    """Across nodes (50 GB/s per GPU) and inside one (450 GB/s), small and large buffers."""
    problems, cases = [], ((1e9, 64, 50e9, 5e-6), (4e9, 1024, 50e9, 5e-6), (1e3, 256, 50e9, 5e-6),
                           (1e9, 8, 450e9, 2e-6), (2e8, 2, 50e9, 0.0))
    for nbytes, n, w, a in cases:
        expected = ring_time("all_reduce", nbytes, n, w, a)
        got = call_student(fn, nbytes, n, w, a)
        wrong = compare(f"B={nbytes:g} bytes, N={n}, W={w / 1e9:g} GB/s, α={a * 1e6:g} µs", got,
                        expected, atol=0, rtol=1e-6)
        if wrong:
            r = _ratio(got, expected)
            hints = {
                ring_time("reduce_scatter", nbytes, n, w, a): "that is one reduce-scatter: an "
                "all-reduce is a reduce-scatter and an all-gather, twice the steps and bytes",
                2 * nbytes / w + 2 * (n - 1) * a: "each rank sends 2(N−1)/N·B, not 2B",
                2 * (n - 1) / n * nbytes / w: "the latency term 2(N−1)·α is missing",
                2 * (n - 1) / n * nbytes / w + 2 * n * a: "a ring all-reduce takes 2(N−1) steps, not 2N",
            }
            for value, hint in hints.items():
                if r is not None and abs(float(got) - value) <= 1e-6 * abs(value):
                    wrong = [wrong[0] + f" — {hint}"]
                    break
        problems += wrong
    report("ring all-reduce time", problems, len(cases))


def check_critical_tokens(fn) -> None:
    """The source's numbers (H100 node, across the spine) and a GB200 NVL72 rack, DP and FSDP."""
    problems, checks = [], 0
    for hw, n in (("H100-SXM", 8), ("H100-SXM", 1024), ("GB200-NVL72", 72)):
        peak, bw = PRESETS[hw].bf16, all_reduce_bandwidth(hw, n)
        for fsdp in (False, True):
            checks += 1
            expected = critical_tokens_dp(hw, n, fsdp=fsdp)
            got = call_student(fn, peak, bw, fsdp)
            wrong = compare(f"C={peak / 1e12:g} TFLOP/s, W={bw / 1e9:g} GB/s, fsdp={fsdp}", got,
                            expected, atol=0, rtol=1e-6)
            r = _ratio(got, expected)
            if wrong and r is not None:
                for factor, hint in ((2.0, "2× too large: backward is 4·B·D·F FLOPs per weight "
                                           "matrix (two matmuls) against 2·D·F bytes of bf16 gradient"),
                                     (0.5, "2× too small: FSDP moves twice DP's bytes (all-gather the "
                                           "weights + reduce-scatter the gradients)" if fsdp else
                                           "2× too small: in-network reduction sends B per GPU, "
                                           "not 2B: W is the all-reduce bandwidth itself")):
                    if abs(r - factor) < 1e-6:
                        wrong = [wrong[0] + f" — {hint}"]
            problems += wrong
    report("critical tokens per GPU", problems, checks)


def _fits_reference(n_params, tp, pp, dp, zero, act, hbm):
    psi = n_params // (tp * pp)
    state = zero_memory_bytes(zero, psi, dp, 12, param_bytes=2, grad_bytes=2)
    total = sum(state.values()) + act
    return total, total <= hbm


def check_fits(fn) -> None:
    """Llama-3-70B-sized and 405B-sized cases, ZeRO 0-3, one that just fits and one that just
    does not (80 GB is 80·10⁹ bytes, as the datasheet counts)."""
    cases = ((70_553_706_496, 8, 4, 20, 1, 11_408_506_880, 80e9),
             (70_553_706_496, 8, 1, 80, 0, 2_852_126_720, 80e9),
             (405_853_388_800, 8, 16, 128, 1, 63_896_993_792, 80e9),
             (405_853_388_800, 8, 16, 128, 3, 0, 80e9),
             (8_000_000_000, 1, 1, 8, 2, 20_000_000_000, 80e9),
             (8_000_000_000, 1, 1, 8, 2, 50_000_000_000, 80e9),      # exactly 80 GB: fits
             (8_000_000_000, 1, 1, 8, 2, 50_000_000_001, 80e9))
    problems = []
    for n, tp, pp, dp, zero, act, hbm in cases:
        n -= n % (tp * pp * dp)                     # keep the shards whole: no padding
        expected = _fits_reference(n, tp, pp, dp, zero, act, hbm)
        got = call_student(fn, n, tp, pp, dp, zero, act, hbm)
        what = f"N={n:,}, tp={tp}, pp={pp}, dp={dp}, ZeRO-{zero}, activations {act / 1e9:g} GB"
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            problems.append(f"{what}: return (bytes, fits), got {got!r}")
            continue
        wrong = compare(what + ": bytes", got[0], float(expected[0]), atol=0.5, rtol=0) + \
            compare(what + ": fits", bool(got[1]), expected[1])
        psi = n // (tp * pp)
        if wrong and abs(float(got[0]) - (16 * psi + act)) < 1 and zero:
            wrong = [wrong[0] + " — that is plain DP: ZeRO-1 shards the optimizer state (12 bytes "
                     "per parameter with the fp32 master), ZeRO-2 the gradients too, ZeRO-3 all"]
        elif wrong and abs(float(got[0]) - (expected[0] - act)) < 1:
            wrong = [wrong[0] + " — the activations are missing"]
        problems += wrong
    report("does it fit in 80 GB", problems, len(cases))
