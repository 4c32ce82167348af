"""Checks for lesson 04 (tensor parallelism).

- `check_shards(column_shard, row_shard)`: `column_shard(weight, rank, world)` → the rows of
  an nn.Linear weight (out, in) that rank owns; `row_shard(...)` → its columns; both raise a
  ValueError naming the numbers when the size does not divide.
- `check_conjugate_pair(CopyToTP, ReduceFromTP)`: two autograd Functions, `.apply(x, group)`:
  f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward),
  through picolib.comm; run on 2 and 3 ranks.
- `check_vocab_parallel_loss(fn)`: `fn(local_logits, targets, vocab_start, group=None)` → the
  mean cross-entropy from vocab-sharded logits, equal to F.cross_entropy with the right
  gradients, without gathering the logits; run on 2 and 4 ranks.

Ranks that never finish (a collective one rank skips) fail the check after `_core.TIMEOUT`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import Ledger
from ._core import call_student, compare, report, run_student

__all__ = ["check_shards", "check_conjugate_pair", "check_vocab_parallel_loss"]


def check_shards(column_shard, row_shard) -> None:
    """Exact slices for several shapes and world sizes; y = x Wᵀ rebuilt from the shards."""
    problems, checks = [], 0
    g = torch.Generator().manual_seed(4)
    for out_f, in_f, world in ((6, 4, 2), (8, 12, 4), (5, 3, 1), (12, 9, 3)):
        w, x = torch.randn(out_f, in_f, generator=g), torch.randn(2, in_f, generator=g)
        y = x @ w.t()
        cols = [call_student(column_shard, w, r, world) for r in range(world)]
        rows = [call_student(row_shard, w, r, world) for r in range(world)]
        for r in range(world):
            checks += 2
            problems += compare(f"column_shard(W {tuple(w.shape)}, rank {r}, world {world})",
                                cols[r], w[r * out_f // world:(r + 1) * out_f // world], atol=0)
            problems += compare(f"row_shard(W {tuple(w.shape)}, rank {r}, world {world})",
                                rows[r], w[:, r * in_f // world:(r + 1) * in_f // world], atol=0)
        if not problems:
            checks += 2
            problems += compare(f"world {world}: concatenated column outputs", torch.cat(
                [x @ c.t() for c in cols], -1), y, atol=1e-6)
            problems += compare(f"world {world}: summed row outputs", sum(
                x.chunk(world, -1)[r] @ rows[r].t() for r in range(world)), y, atol=1e-6)
    for fn, name, shape in ((column_shard, "column_shard", (6, 4)), (row_shard, "row_shard", (4, 6))):
        checks += 1
        try:
            call_student(fn, torch.zeros(shape), 0, 4)
            problems.append(f"{name}: W {shape} over 4 ranks should raise a ValueError (6 % 4 != 0)")
        except ValueError as e:
            if "6" not in str(e) or "4" not in str(e):
                problems.append(f"{name}: the ValueError should name both numbers (6 and 4): {e}")
    report("column and row shards", problems, checks)


def _name(fn) -> str:
    return getattr(fn, "__name__", "your function")


def _pair_worker(f_cls, g_cls):
    r = dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    with Ledger() as f_fwd:
        fx = f_cls.apply(x, None)
    with Ledger() as f_bwd:
        fx.backward(torch.full((3,), float(r + 1)))
    y = torch.full((3,), float(r + 1), requires_grad=True)
    with Ledger() as g_fwd:
        gy = g_cls.apply(y, None)
    with Ledger() as g_bwd:
        gy.backward(torch.full((3,), float(r + 1)))
    return (fx.detach(), x.grad, gy.detach(), y.grad,
            [led.count("all_reduce") for led in (f_fwd, f_bwd, g_fwd, g_bwd)])


def check_conjugate_pair(copy_to_tp, reduce_from_tp) -> None:
    """Rank r feeds r+1 forward and r+1 as the upstream gradient: f returns r+1 and passes
    back Σ(r+1); g returns Σ(r+1) and passes back r+1. One comm.all_reduce each, where due."""
    problems, checks = [], 0
    for n in (2, 3):
        total = float(n * (n + 1) // 2)
        pair = f"{_name(copy_to_tp)} / {_name(reduce_from_tp)}"
        results = run_student(_pair_worker, n, copy_to_tp, reduce_from_tp, name=pair)
        for r, (fx, fgrad, gy, ggrad, counts) in enumerate(results):
            mine = torch.full((3,), float(r + 1))
            checks += 5
            problems += compare(f"N={n} rank {r}: f forward", fx, mine)
            problems += compare(f"N={n} rank {r}: f backward (all-reduce)", fgrad, torch.full((3,), total))
            problems += compare(f"N={n} rank {r}: g forward (all-reduce)", gy, torch.full((3,), total))
            problems += compare(f"N={n} rank {r}: g backward (identity)", ggrad, mine)
            if counts != [0, 1, 1, 0]:
                problems.append(f"N={n} rank {r}: comm.all_reduce calls (f fwd, f bwd, g fwd, g bwd) = "
                                f"{counts}, expected [0, 1, 1, 0]")
    report("the conjugate pair f / g", problems, checks)


def _loss_worker(fn, logits, targets):
    r, n = dist.get_rank(), dist.get_world_size()
    v = logits.shape[-1]
    local = logits.chunk(n, -1)[r].clone().requires_grad_()
    with Ledger() as led:
        loss = fn(local, targets, r * v // n)
    loss.backward()
    return loss.detach(), local.grad, led.summary()


def check_vocab_parallel_loss(fn) -> None:
    """Loss and logit gradients equal to F.cross_entropy; no all-gather, and fewer bytes
    communicated than the logits themselves."""
    problems, checks = [], 0
    g = torch.Generator().manual_seed(5)
    for n in (2, 4):
        logits = (torch.randn(3, 6, 32, generator=g) * 5).requires_grad_()
        targets = torch.randint(0, 32, (3, 6), generator=g)
        ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        ref.backward()
        results = run_student(_loss_worker, n, fn, logits.detach(), targets, name=_name(fn))
        for r, (loss, grad, summary) in enumerate(results):
            checks += 3
            problems += compare(f"N={n} rank {r}: loss", loss, ref.detach(), atol=1e-5)
            if grad is None:
                problems.append(f"N={n} rank {r}: no gradient reached the local logits")
            else:
                problems += compare(f"N={n} rank {r}: gradient of the local logits", grad,
                                    logits.grad.chunk(n, -1)[r], atol=1e-6)
            moved = sum(s["nbytes"] for s in summary.values())
            if "all_gather" in summary or moved >= logits.numel() * 4 // n:
                problems.append(f"N={n} rank {r}: communicated {summary} — reduce max, sum-exp and "
                                "target logit (b·s numbers each) instead of gathering logits")
            if not summary:
                problems.append(f"N={n} rank {r}: no picolib.comm collective was called")
    report("vocab-parallel cross-entropy", problems, checks)
