"""Checks for lesson 05 (sequence parallelism).

- `check_gather_sequence(fn)`: `fn(x, group=None)` turns this rank's (b, s/tp, h) slice of the
  sequence into the whole (b, s, h), with one `comm.all_gather`; run on 2 and 3 ranks and two groups of 2.
- `check_reduce_scatter_sequence(fn)`: `fn(x, group=None)` sums the ranks' (b, s, h) partial
  outputs and returns this rank's (b, s/tp, h) tokens, with one `comm.reduce_scatter`.
- `check_sp_norm_weight_grad(fn)`: `fn(x, grad_out, eps, group=None)` → the gradient of a
  sequence-parallel RMSNorm's (replicated) weight: Σ over this rank's tokens of
  grad_out · x·rsqrt(mean(x²) + eps), all-reduced (summed) over the TP group.
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
from ._core import (SUBGROUPS, call_student, compare, explain, members, my_group,
                    on_world_not_group, report, run_student, world_calls)

__all__ = ["check_gather_sequence", "check_reduce_scatter_sequence", "check_sp_norm_weight_grad",
           "check_sp_activation_bytes",
           "check_tokens_per_day"]


def _full(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4 * n, 5, generator=g), [torch.randn(3, 4 * n, 5, generator=g) for _ in range(n)]


def _seq_worker(fn, data, op, split=False):
    group = my_group(split)
    team = members(dist.get_rank())[0] if split else 0
    full, partials = data[team]                      # each group its own sequence
    r, n = dist.get_rank(group), dist.get_world_size(group)
    x = full.chunk(n, 1)[r].clone() if op == "all_gather" else partials[r].clone()
    with Ledger() as led:
        out = call_student(fn, x, group=group)
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, led.summary(), world_calls(led) if split else []


def _seq_hint(op, out, full, partials, n, r) -> str:
    """The usual mistakes of moving the sequence dim through a dim-0 collective."""
    b, s, h = full.shape
    if op == "all_gather":
        blocks = torch.cat(full.chunk(n, 1), 0)          # what all_gather leaves: (n·b, s/n, h)
        if out.shape == blocks.shape:
            return ("returned all_gather's buffer (tp·b, s/tp, h) as it is: move the rank blocks "
                    "into the sequence dim (view (tp, b, s/tp, h), transpose(0, 1), reshape)")
        if out.shape == full.shape and torch.allclose(out, blocks.reshape(b, s, h), atol=1e-5):
            return ("the rank blocks were reshaped straight into (b, s, h): they lie along dim 0, "
                    "so view (tp, b, s/tp, h) and transpose(0, 1) before the reshape")
        return ""
    total = torch.stack(partials).sum(0)
    if out.shape == total.shape:
        return ("returned the whole (b, s, h) sum: reduce-scatter keeps this rank's s/tp tokens "
                "only")
    if out.shape == total.chunk(n, 1)[r].shape and torch.allclose(
            out, total.reshape(n * b, s // n, h).chunk(n, 0)[r].reshape(out.shape), atol=1e-5):
        return ("x was viewed as (tp·b, s/tp, h) directly: that splits the batch, not the "
                "sequence — view (b, tp, s/tp, h) and move tp first (transpose(0, 1)) before "
                "the reduce-scatter")
    return ""


def _check_seq(fn, op, title, timeout=None):
    problems, checks = [], 0
    for n, split in ((2, False), (3, False), (4, True)):
        m = 2 if split else n
        data = [_full(m, seed=n + 10 * t) for t in range(n if split else 1)]
        name = getattr(fn, "__name__", "your function")
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        for r, (out, summary, world) in enumerate(run_student(
                _seq_worker, n, fn, data, op, split, name=name, timeout=timeout)):
            checks += 2
            team = members(r)[0] if split else 0
            gr = members(r).index(r) if split else r
            full, partials = data[team]
            if world:
                problems.append(f"{label} rank {r}: " + on_world_not_group(f"the group of your {world[0]}"))
                continue
            expected = full if op == "all_gather" else torch.stack(partials).sum(0).chunk(m, 1)[gr]
            wrong = compare(f"{label} rank {r}: result", out, expected, atol=1e-5)
            hint = _seq_hint(op, out, full, partials, m, gr) if wrong and isinstance(
                out, torch.Tensor) else ""
            problems += [f"{label} rank {r}: result — {hint}"] if hint else wrong
            calls = {k: v["calls"] for k, v in summary.items()}
            if calls != {op: 1}:
                problems.append(f"{label} rank {r}: picolib.comm calls {calls}, expected one {op}")
        if problems:
            break                                     # the same mistake again on more ranks
    report(title, problems, checks)


def check_gather_sequence(fn, timeout: float | None = None) -> None:
    """(b, s/tp, h) slices, rank r holding tokens [r·s/tp, (r+1)·s/tp) → the whole sequence;
    on 2 and 3 ranks and on 4 ranks split into two groups of 2 (each its own sequence)."""
    _check_seq(fn, "all_gather", "all-gather along the sequence", timeout)


def check_reduce_scatter_sequence(fn, timeout: float | None = None) -> None:
    """(b, s, h) partial sums → this rank's tokens of the total; on 2 and 3 ranks and on 4
    ranks split into two groups of 2."""
    _check_seq(fn, "reduce_scatter", "reduce-scatter along the sequence", timeout)


def _norm_worker(fn, data, eps, split=False):
    group = my_group(split)
    team = members(dist.get_rank())[0] if split else 0
    x, dy = data[team]
    r, n = dist.get_rank(group), dist.get_world_size(group)
    with Ledger() as led:
        out = call_student(fn, x.chunk(n, 1)[r].clone(), dy.chunk(n, 1)[r].clone(), eps,
                           group=group)
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, led.summary(), world_calls(led) if split else []


def _normed(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def check_sp_norm_weight_grad(fn, timeout: float | None = None) -> None:
    """The weight gradient equals the dense norm's (autograd on the whole sequence), on every
    rank, with one all-reduce of h numbers: on 2 and 3 ranks and on 4 ranks split into two
    groups of 2, each group its own sequence."""
    problems, checks = [], 0
    # eps differs per case (an eps written in, not read from the argument, shows), and every
    # token's x has its own scale down to 1e-3·3, where mean(x²) is below eps: eps matters
    for n, split, eps in ((2, False, 1e-5), (3, False, 1e-3), (4, True, 1e-4)):
        m = 2 if split else n
        g = torch.Generator().manual_seed(20 + n)
        scale = torch.logspace(-3, 0, 4 * m)[torch.randperm(4 * m, generator=g)].view(1, -1, 1)
        data = [(torch.randn(2, 4 * m, 6, generator=g) * 3 * scale,
                 torch.randn(2, 4 * m, 6, generator=g)) for _ in range(n if split else 1)]
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        results = run_student(_norm_worker, n, fn, data, eps, split, name=getattr(
            fn, "__name__", "your function"), timeout=timeout)
        for r, (out, summary, world) in enumerate(results):
            checks += 2
            team = members(r)[0] if split else 0
            gr = members(r).index(r) if split else r
            x, dy = data[team]
            w = torch.ones(6, requires_grad=True)          # the dense norm, by autograd
            (_normed(x, eps) * w).backward(dy)
            want = w.grad
            where = f"{label} rank {r}"
            if world:
                problems.append(f"{where}: " + on_world_not_group(f"the group of your {world[0]}"))
                continue
            wrong = compare(f"{where}: weight gradient (eps={eps:g})", out, want, atol=1e-4)
            if wrong and isinstance(out, torch.Tensor) and out.shape == want.shape:
                mx, mdy = x.chunk(m, 1)[gr], dy.chunk(m, 1)[gr]
                mistakes = {
                    "this rank's s/tp tokens only — the weight is replicated but each rank saw "
                    "other tokens: all-reduce (sum) the local sums over the TP group":
                        (mdy * _normed(mx, eps)).sum((0, 1)),
                    f"{m}× too small — a mean over the ranks (op=\"avg\" or a division by tp): the "
                    "gradient is a sum over all tokens, and each rank holds a partial sum": want / m,
                    "Σ grad_out·x — the weight multiplies the normalised x·rsqrt(mean(x²) + eps), "
                    "not x": (dy * x).sum((0, 1)),
                    "eps left out — x̂ = x·rsqrt(mean(x²) + eps): on tokens with small x, eps "
                    "matters": (dy * _normed(x, 0.0)).sum((0, 1)),
                    f"eps taken as 1e-5, not the argument eps = {eps:g}":
                        (dy * _normed(x, 1e-5)).sum((0, 1)) if eps != 1e-5 else None,
                    "eps added outside the square root — x̂ = x·rsqrt(mean(x²) + eps)":
                        (dy * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)).sum((0, 1)),
                }
                hint = explain([why for why, value in mistakes.items() if value is not None
                                and torch.allclose(out, value, atol=1e-4)])
                wrong = [f"{where}: weight gradient: {hint}"] if hint else wrong
            problems += wrong
            calls = {k: v["calls"] for k, v in summary.items()}
            if calls != {"all_reduce": 1}:
                problems.append(f"{where}: picolib.comm calls {calls or 'none'}, expected one "
                                "all_reduce (of h numbers)")
            elif summary["all_reduce"]["nbytes"] != 4 * 6:
                problems.append(f"{where}: the all-reduce moved {summary['all_reduce']['nbytes']} "
                                "bytes; reduce the (h,) local sum, 24 bytes here, not the tokens")
        if problems:
            break
    report("the sequence-parallel norm's weight gradient", problems, checks)


def _bytes_hint(got, s, b, h, f, a, tp, sp) -> str:
    """One line naming a common slip in the activation count ("" when none fits)."""
    right = activation_bytes_per_layer(s, b, h, f, a, tp, "tp+sp" if sp else "tp")
    other = activation_bytes_per_layer(s, b, h, f, a, tp, "tp" if sp else "tp+sp")
    try:
        got = float(got)
    except (TypeError, ValueError):
        return ""
    slips = {
        "that is the count for sp=" + str(not sp) + ": under plain TP the norms' inputs, x·rstd, "
        "rstd and the norm outputs are whole on every rank; under TP+SP they are split like the "
        "rest": other if tp > 1 else None,
        "the s×s causal mask is missing (a bool tensor: 1 byte per entry, never split)": right - s * s,
        "the causal mask is bool: 1 byte per entry, not 4": right + 3 * s * s,
        "the softmax probabilities (a·s² per sequence, split by heads) are missing":
            right - 4 * a * s * s * b // tp,
    }
    hits = [why for why, value in slips.items() if value is not None and abs(got - value) < 0.5]
    if abs(got - 4 * right) < 2 or abs(got * 4 - right) < 2:
        hits.append("off by 4: count floats × 4 bytes (fp32), the mask in bytes")
    return explain(hits)


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
