"""Checks for lesson 00 (collectives).

- `check_ring_all_reduce(fn)`: `fn(tensor, group=None)` sums `tensor` over the ranks with a
  ring built from picolib.comm point-to-point calls; run on 2, 3 and 4 ranks.
- `check_all_reduce_from_rs_ag(fn)`: the same result from one `comm.reduce_scatter`
  followed by one `comm.all_gather`; run on 2 and 4 ranks.
- `check_ring_bytes(fn)`: `fn(op, nbytes, n)` → bytes one rank sends in a ring collective.
- `check_ring_time(fn)`: `fn(op, nbytes, n, alpha, bandwidth)` → seconds under the α–β model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger, ring_sent_bytes
from ._core import call_student, compare, report, run_student

__all__ = ["check_ring_all_reduce", "check_all_reduce_from_rs_ag", "check_ring_bytes",
           "check_ring_time", "ring_time"]

RING_OPS = ("reduce_scatter", "all_gather", "all_reduce")


def _inputs(world_size: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(world_size)]


def _student_worker(fn, inputs):
    """Runs on each rank: the student's function on this rank's input, inside a Ledger."""
    x = inputs[dist.get_rank()].clone()
    with Ledger() as ledger:
        out = fn(x)
    out = x if out is None else out  # an in-place answer may return nothing
    return out, ledger.summary()


def _run(fn, world_size, inputs, name):
    return run_student(_student_worker, world_size, fn, inputs, name=name)


def check_ring_all_reduce(fn) -> None:
    """Sum over 2, 3 and 4 ranks, and the traffic of a ring: 2(N−1)/N · B per rank, sent
    through picolib.comm (send / exchange), so that the Ledger sees it."""
    problems, checks = [], 0
    for n in (2, 3, 4):
        inputs = _inputs(n, 12, seed=n)
        expected = torch.stack(inputs).sum(0)
        results = _run(fn, n, inputs, "ring_all_reduce")
        nbytes = inputs[0].numel() * inputs[0].element_size()
        want = ring_sent_bytes("all_reduce", nbytes, n)
        for rank, (out, summary) in enumerate(results):
            checks += 2
            problems += compare(f"N={n} rank {rank}: result", out, expected, atol=1e-5)
            sent = summary.get("send", {}).get("sent_bytes", 0)
            if sent != want:
                problems.append(f"N={n} rank {rank}: sent {sent} bytes through comm.send/"
                                f"comm.exchange; a ring sends 2(N−1)/N·B = {want} "
                                f"(B = {nbytes} bytes)")
            others = sorted(set(summary) - {"send", "recv"})
            if others:
                problems.append(f"N={n} rank {rank}: called {others}; build the ring from "
                                "point-to-point calls only")
    report("ring all-reduce", problems, checks)


def check_all_reduce_from_rs_ag(fn) -> None:
    """All-reduce = one reduce-scatter + one all-gather: same values, same bytes."""
    problems, checks = [], 0
    for n in (2, 4):
        inputs = _inputs(n, 8, seed=10 + n)
        expected = torch.stack(inputs).sum(0)
        results = _run(fn, n, inputs, "all_reduce_from_rs_ag")
        nbytes = inputs[0].numel() * inputs[0].element_size()
        for rank, (out, summary) in enumerate(results):
            checks += 3
            problems += compare(f"N={n} rank {rank}: result", out, expected, atol=1e-5)
            calls = {op: s["calls"] for op, s in summary.items()}
            if calls != {"reduce_scatter": 1, "all_gather": 1}:
                problems.append(f"N={n} rank {rank}: collectives called {calls}; expected "
                                "exactly one comm.reduce_scatter and one comm.all_gather")
            sent = sum(s["sent_bytes"] for s in summary.values())
            want = ring_sent_bytes("all_reduce", nbytes, n)
            if sent != want:
                problems.append(f"N={n} rank {rank}: {sent} bytes on the wire; an all-reduce "
                                f"of {nbytes} bytes sends {want}")
    report("all-reduce from reduce-scatter + all-gather", problems, checks)


def check_ring_bytes(fn) -> None:
    """Bytes one rank sends for reduce-scatter, all-gather and all-reduce of `nbytes` on `n`
    ranks (the ring algorithm; `nbytes` is the full buffer and divides by n here)."""
    problems, checks = [], 0
    for op in RING_OPS:
        for nbytes in (96, 48 * 1024):
            for n in (1, 2, 3, 4, 8, 16):
                checks += 1
                got = call_student(fn, op, nbytes, n)
                problems += compare(f"{op}, B={nbytes}, N={n}", got,
                                    ring_sent_bytes(op, nbytes, n))
    report("ring bytes per rank", problems, checks)


def ring_time(op: str, nbytes: int, n: int, alpha: float, bandwidth: float) -> float:
    """α–β model of a ring collective: steps·α + (bytes this rank sends)/bandwidth, where a
    reduce-scatter or all-gather takes N−1 steps and an all-reduce 2(N−1)."""
    if op not in RING_OPS:
        raise ValueError(f"op must be one of {RING_OPS}, not {op!r}")
    steps = (n - 1) * (2 if op == "all_reduce" else 1)
    return steps * alpha + ring_sent_bytes(op, nbytes, n) / bandwidth


def check_ring_time(fn) -> None:
    """Seconds for a ring collective under the α–β model (see `ring_time`)."""
    problems, checks = [], 0
    for op in RING_OPS:
        for nbytes in (1024, 1 << 30):
            for n in (1, 2, 8, 64):
                for alpha in (0.0, 5e-6):
                    checks += 1
                    got = call_student(fn, op, nbytes, n, alpha, 450e9)
                    problems += compare(f"{op}, B={nbytes}, N={n}, α={alpha:g}", got,
                                        ring_time(op, nbytes, n, alpha, 450e9),
                                        atol=1e-12, rtol=1e-6)
    report("ring time (α–β)", problems, checks)
