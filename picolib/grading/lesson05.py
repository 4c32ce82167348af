"""Checks for lesson 05 (sequence parallelism).

- `check_gather_sequence(fn)`: `fn(x, group=None)` turns this rank's (b, s/tp, h) slice of the
  sequence into the whole (b, s, h), with one `comm.all_gather`; run on 2 and 4 ranks.
- `check_reduce_scatter_sequence(fn)`: `fn(x, group=None)` sums the ranks' (b, s, h) partial
  outputs and returns this rank's (b, s/tp, h) tokens, with one `comm.reduce_scatter`.
- `check_sp_activation_bytes(fn)`: `fn(s, b, h, f, a, tp, sp)` → bytes one TinyLlama layer
  saves per rank (fp32, eager attention) under TP (`sp=False`) or TP+SP (`sp=True`).
- `check_tokens_per_day(fn)`: `fn(n_gpus, flops_per_gpu, n_params)` → tokens trained per
  day at 6·N FLOPs per token.

Ranks that never finish (a collective one rank skips) fail the check after `_core.TIMEOUT`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..sequence_parallel import activation_bytes_per_layer
from ._core import call_student, compare, report, run_student

__all__ = ["check_gather_sequence", "check_reduce_scatter_sequence", "check_sp_activation_bytes",
           "check_tokens_per_day"]


def _full(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4 * n, 5, generator=g), [torch.randn(3, 4 * n, 5, generator=g) for _ in range(n)]


def _seq_worker(fn, full, partials, op):
    r = dist.get_rank()
    x = full.chunk(dist.get_world_size(), 1)[r].clone() if op == "all_gather" else partials[r].clone()
    with Ledger() as led:
        out = fn(x)
    return out, led.summary()


def _check_seq(fn, op, title):
    problems, checks = [], 0
    for n in (2, 4):
        full, partials = _full(n, seed=n)
        total = torch.stack(partials).sum(0)
        name = getattr(fn, "__name__", "your function")
        for r, (out, summary) in enumerate(run_student(_seq_worker, n, fn, full, partials, op,
                                                        name=name)):
            checks += 2
            expected = full if op == "all_gather" else total.chunk(n, 1)[r]
            problems += compare(f"N={n} rank {r}: result", out, expected, atol=1e-5)
            calls = {k: v["calls"] for k, v in summary.items()}
            if calls != {op: 1}:
                problems.append(f"N={n} rank {r}: picolib.comm calls {calls}, expected one {op}")
    report(title, problems, checks)


def check_gather_sequence(fn) -> None:
    """(b, s/tp, h) slices, rank r holding tokens [r·s/tp, (r+1)·s/tp) → the whole sequence."""
    _check_seq(fn, "all_gather", "all-gather along the sequence")


def check_reduce_scatter_sequence(fn) -> None:
    """(b, s, h) partial sums → this rank's tokens of the total."""
    _check_seq(fn, "reduce_scatter", "reduce-scatter along the sequence")


def _bytes_hint(got, s, b, h, f, a, tp, sp) -> str:
    """One line naming a common slip in the activation count ("" when none fits)."""
    right = activation_bytes_per_layer(s, b, h, f, a, tp, "tp+sp" if sp else "tp")
    other = activation_bytes_per_layer(s, b, h, f, a, tp, "tp" if sp else "tp+sp")
    try:
        got = float(got)
    except (TypeError, ValueError):
        return ""
    if tp > 1 and abs(got - other) < 0.5:
        return ("that is the count for sp=" + str(not sp) + ": under plain TP the norms' inputs, "
                "x·rstd, rstd and the norm outputs are whole on every rank; under TP+SP they are "
                "split like the rest")
    if abs(got - (right - s * s)) < 0.5:
        return "the s×s causal mask is missing (a bool tensor: 1 byte per entry, never split)"
    if abs(got - (right + 3 * s * s)) < 0.5:
        return "the causal mask is bool: 1 byte per entry, not 4"
    if abs(got - (right - 4 * a * s * s * b // tp)) < 0.5:
        return "the softmax probabilities (a·s² per sequence, split by heads) are missing"
    if abs(got - 4 * right) < 2 or abs(got * 4 - right) < 2:
        return "off by 4: count floats × 4 bytes (fp32), the mask in bytes"
    return ""


def check_sp_activation_bytes(fn) -> None:
    """Exact bytes for several sizes and tp, against picolib's measured-and-verified formula."""
    problems, checks = [], 0
    for s, b, h, f, a, tp in ((32, 2, 128, 256, 4, 2), (64, 1, 64, 176, 8, 4), (16, 3, 32, 64, 2, 1),
                              (48, 2, 96, 128, 6, 2)):
        for sp in (False, True):
            checks += 1
            expected = activation_bytes_per_layer(s, b, h, f, a, tp, "tp+sp" if sp else "tp")
            got = call_student(fn, s, b, h, f, a, tp, sp)
            what = f"s={s} b={b} h={h} f={f} a={a} tp={tp} sp={sp}"
            wrong = compare(what, got, expected, atol=0.5)
            hint = _bytes_hint(got, s, b, h, f, a, tp, sp) if wrong else ""
            problems += [w + (f" — {hint}" if hint else "") for w in wrong]
    report("saved activation bytes per layer", problems, checks)


def check_tokens_per_day(fn) -> None:
    """640 H100 at 450 TFLOP/s on a 70B model: 59.2 B tokens/day; and two other clusters."""
    problems = []
    for gpus, flops, n in ((640, 450e12, 70e9), (8, 400e12, 8e9), (1024, 300e12, 405e9)):
        expected = gpus * flops / (6 * n) * 86_400
        got = call_student(fn, gpus, flops, n)
        wrong = compare(f"{gpus} GPUs × {flops / 1e12:g} TFLOP/s, {n / 1e9:g}B params", got,
                        expected, atol=0, rtol=1e-6)
        try:
            ratio = float(got) / expected
        except (TypeError, ValueError):
            ratio = 0.0
        for r, hint in ((3.0, "3× too many: 2N FLOPs per token is the forward alone; backward "
                              "costs twice the forward (input and weight gradients)"),
                        (1.5, "1.5× too many: backward needs two matmuls per weight (input and "
                              "weight gradients), 4N, not 2N"),
                        (1 / 86_400, "that is tokens per second: a day has 86,400 s"),
                        (3 / 86_400, "tokens per second, and the forward alone")):
            if wrong and abs(ratio / r - 1) < 1e-3:
                wrong = [wrong[0] + f" — {hint}"]
        problems += wrong
    report("tokens per day", problems, 3)
