"""Checks for lesson 00 (collectives).

- `check_ring_all_reduce(fn)`: `fn(tensor, group=None)` sums `tensor` over the ranks of
  `group` with a ring built from picolib.comm point-to-point calls; run on 2, 3 and 4 ranks,
  and on 4 ranks split into two groups of 2 (a `group` ignored is named).
- `check_all_reduce_from_rs_ag(fn)`: the same result from one `comm.reduce_scatter`
  followed by one `comm.all_gather`; run on 2 and 4 ranks, and on two groups of 2.
- `check_ring_bytes(fn)`: `fn(op, nbytes, n)` → bytes one rank sends in a ring collective.
- `check_ring_time(fn)`: `fn(op, nbytes, n, alpha, bandwidth)` → seconds under the α–β model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger, ring_sent_bytes
from ._core import (SUBGROUPS, call_student, compare, members, my_group, on_world_not_group,
                    report, run_student)

__all__ = ["check_ring_all_reduce", "check_all_reduce_from_rs_ag", "check_ring_bytes",
           "check_ring_time", "ring_time"]

RING_OPS = ("reduce_scatter", "all_gather", "all_reduce")


def _inputs(world_size: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(world_size)]


def _student_worker(fn, inputs, split):
    """Runs on each rank: the student's function on this rank's input, inside a Ledger, on
    the world or (split) on this rank's sub-group."""
    group = my_group(split)
    x = inputs[dist.get_rank()].clone()
    with Ledger() as ledger:
        out = fn(x, group=group)
    out = x if out is None else out  # an in-place answer may return nothing
    return out, ledger.summary()


def _run(fn, world_size, inputs, name, split=False, timeout=None):
    return run_student(_student_worker, world_size, fn, inputs, split, name=name,
                       timeout=timeout)


def _cases(make_inputs, sizes):
    """(label, world size, inputs, expected per rank, group size, split) for every world size
    and for 4 ranks split into `SUBGROUPS` (each group sums its own two inputs)."""
    for n in sizes:
        inputs = make_inputs(n)
        total = torch.stack(inputs).sum(0)
        yield f"N={n}", n, inputs, [total] * n, n, False
    inputs = make_inputs(4)
    yield (f"group of 2 in {list(SUBGROUPS)}", 4, inputs,
           [torch.stack([inputs[m] for m in members(r)]).sum(0) for r in range(4)], 2, True)


def _chunk_story(out, inputs, rank_inputs_of, n) -> str:
    """Which ranks' inputs each chunk of a wrong ring result holds: names a partial sum or a
    chunk never written back ("" when no chunk fits a subset)."""
    if not isinstance(out, torch.Tensor) or out.numel() != inputs[0].numel():
        return ""
    import itertools
    own = rank_inputs_of
    parts = []
    for c, got in enumerate(out.view(-1).chunk(n)):
        found = None
        for size in range(n, 0, -1):
            for subset in itertools.combinations(range(n), size):
                if torch.allclose(got, sum(own[i].view(-1).chunk(n)[c] for i in subset), atol=1e-5):
                    found = subset
                    break
            if found:
                break
        parts.append(found)
    if any(p is None for p in parts):
        return ""
    partial = [c for c, p in enumerate(parts) if len(p) < n]
    if not partial:
        return ""
    c = partial[0]
    return (f"chunk {c} holds the sum of {len(parts[c])} of the {n} inputs (positions "
            f"{list(parts[c])} in the ring), chunks {[i for i in range(n) if len(parts[i]) == n]} are "
            "complete: a chunk index is off by one, or a received chunk was never written into "
            "the tensor (receive into a view, or add into one)")


def _per_n(n: int, per_rank: dict[int, list[str]], label: str | None = None) -> list[str]:
    """One line per kind of problem for N ranks: the same mistake on every rank is said once."""
    label = label or f"N={n}"
    out, seen = [], {}
    for rank, problems in per_rank.items():
        for p in problems:
            seen.setdefault(p, []).append(rank)
    for p, ranks in seen.items():
        who = "every rank" if len(ranks) == n else f"rank{'s' if len(ranks) > 1 else ''} {ranks}"
        out.append(f"{label}, {who}: {p}")
    return out


def check_ring_all_reduce(fn, timeout: float | None = None) -> None:
    """Sum over 2, 3 and 4 ranks and over two groups of 2 out of 4, and the traffic of a
    ring: 2(N−1)/N · B per rank, sent through picolib.comm (send / exchange), so that the
    Ledger sees it. `timeout`: seconds before the ranks count as stuck."""
    problems, checks = [], 0
    for label, size, inputs, expected, n, split in _cases(lambda k: _inputs(k, 12, seed=k),
                                                          (2, 3, 4)):
        results = _run(fn, size, inputs, "ring_all_reduce", split, timeout)
        nbytes = inputs[0].numel() * inputs[0].element_size()
        want = ring_sent_bytes("all_reduce", nbytes, n)
        world = torch.stack(inputs).sum(0)
        per_rank = {}
        for rank, (out, summary) in enumerate(results):
            checks += 2
            ring = [inputs[m] for m in (members(rank) if split else range(size))]
            mine = compare("result", out, expected[rank], atol=1e-5)
            if mine and isinstance(out, torch.Tensor) and out.shape == world.shape and \
                    torch.allclose(out, inputs[rank], atol=1e-5):
                mine = ["result: this rank's own input, unchanged: nothing was added (did the "
                        "reduce-scatter steps run, and add into the chunk?)"]
            elif mine and split and isinstance(out, torch.Tensor) and out.shape == world.shape \
                    and torch.allclose(out, world, atol=1e-5):
                mine = [on_world_not_group("result")]
            elif mine:
                story = _chunk_story(out, inputs, ring, n)
                mine = [mine[0] + (f" — {story}" if story else "")]
            sent = summary.get("send", {}).get("sent_bytes", 0)
            if sent != want:
                why = ("the whole tensor each step instead of one chunk of B/N"
                       if sent == 2 * (n - 1) * nbytes else
                       "(N−1)·B, the whole tensor to every other rank; a ring passes chunks of "
                       "B/N to one neighbour" if sent == (n - 1) * nbytes else
                       "only half: the all-gather steps are missing" if 2 * sent == want else
                       "nothing through comm.send/comm.exchange" if not sent else
                       f"{sent / (nbytes / n):g} chunks of B/N instead of 2(N−1) = {2 * (n - 1)}")
                mine.append(f"sent {sent} bytes, a ring sends 2(N−1)/N·B = {want} "
                            f"(B = {nbytes}): {why}")
            others = sorted(set(summary) - {"send", "recv"})
            if others:
                mine.append(f"called {others}; build the ring from point-to-point calls only")
            per_rank[rank] = mine
        problems += _per_n(size, per_rank, label)
    report("ring all-reduce", problems, checks)


def check_all_reduce_from_rs_ag(fn, timeout: float | None = None) -> None:
    """All-reduce = one reduce-scatter + one all-gather: same values, same bytes; on 2 and 4
    ranks and on two groups of 2 out of 4."""
    problems, checks = [], 0
    for label, size, inputs, expected, n, split in _cases(lambda k: _inputs(k, 8, seed=10 + k),
                                                          (2, 4)):
        results = _run(fn, size, inputs, "all_reduce_from_rs_ag", split, timeout)
        nbytes = inputs[0].numel() * inputs[0].element_size()
        world = torch.stack(inputs).sum(0)
        per_rank = {}
        for rank, (out, summary) in enumerate(results):
            checks += 3
            mine = compare("result", out, expected[rank], atol=1e-5)
            if mine and isinstance(out, torch.Tensor) and out.numel() * n == world.numel():
                mine = [f"result: shape {tuple(out.shape)} is one shard, not the whole sum "
                        f"{tuple(world.shape)}: all-gather the shards after the reduce-scatter"]
            elif mine and split and isinstance(out, torch.Tensor) and out.shape == world.shape \
                    and torch.allclose(out, world, atol=1e-5):
                mine = [on_world_not_group("result")]
            elif mine and isinstance(out, torch.Tensor) and out.shape == world.shape and \
                    torch.allclose(out, inputs[rank], atol=1e-5):
                mine = ["result: this rank's own input: the gathered buffer was never returned "
                        "(return the all-gather's output, or copy it into tensor)"]
            calls = {op: s["calls"] for op, s in summary.items()}
            if calls != {"reduce_scatter": 1, "all_gather": 1}:
                mine.append(f"collectives called {calls}; expected exactly one "
                            "comm.reduce_scatter and one comm.all_gather")
            sent = sum(s["sent_bytes"] for s in summary.values())
            want = ring_sent_bytes("all_reduce", nbytes, n)
            if sent != want:
                mine.append(f"{sent} bytes on the wire; an all-reduce of {nbytes} bytes "
                            f"sends {want}")
            per_rank[rank] = mine
        problems += _per_n(size, per_rank, label)
    report("all-reduce from reduce-scatter + all-gather", problems, checks)


def _one_line_per_op(op: str, cases: list[dict], got: list, expected: list, hints) -> list[str]:
    """[] if every case matches; else one line for `op`: the first hint whose rule explains
    every wrong case, or compare()'s diagnosis of the whole grid. A case is a dict of the
    inputs (its label is its items); a hint is (rule(got, case) -> bool, message)."""
    wrong = [i for i, (g, e) in enumerate(zip(got, expected))
             if compare("", g, e, atol=1e-12, rtol=1e-6)]
    if not wrong:
        return []
    i = wrong[0]
    label = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in cases[i].items() if k not in ("want", "steps", "W", "op"))
    example = f"e.g. {label}: got {got[i]!r}, expected {expected[i]!r}"
    for rule, message in hints:
        try:
            if all(rule(got[j], cases[j]) for j in wrong):
                return [f"{op}: {message} ({example})"]
        except (TypeError, ValueError, ZeroDivisionError):
            continue
    try:
        grid = torch.tensor([float(g) for g in got], dtype=torch.float64)
    except (TypeError, ValueError):
        return [f"{op}: expected a number ({example})"]
    line = compare(op, grid, torch.tensor([float(e) for e in expected], dtype=torch.float64),
                   atol=1e-12, rtol=1e-6)
    return [f"{line[0]} ({example})"]


def _close(a, b) -> bool:
    return abs(float(a) - float(b)) <= 1e-6 * max(1e-12, abs(float(b)))


BYTES_HINTS = [
    (lambda g, c: c["N"] == 1 and not _close(g, 0),
     "one rank alone has no one to send to: 0 bytes"),
    (lambda g, c: _close(g, c["B"] * (c["N"] - 1) * (2 if c["op"] == "all_reduce" else 1)),
     "each step sends one chunk of B/N bytes, not the whole buffer"),
    (lambda g, c: _close(g, c["B"] / c["N"]),
     "B/N is one step; the ring takes N−1 steps (2(N−1) for all-reduce)"),
    (lambda g, c: c["op"] == "all_reduce" and _close(2 * g, c["want"]),
     "half the bytes: an all-reduce is a reduce-scatter AND an all-gather, 2(N−1) steps"),
    (lambda g, c: c["op"] != "all_reduce" and _close(g, 2 * c["want"]),
     "twice the bytes: only the all-reduce goes around the ring twice"),
    (lambda g, c: _close(g, c["B"] * (2 if c["op"] == "all_reduce" else 1)),
     "a rank never sends the chunk it ends up owning: (N−1)/N of B per pass, not all of B"),
]


def check_ring_bytes(fn) -> None:
    """Bytes one rank sends for reduce-scatter, all-gather and all-reduce of `nbytes` on `n`
    ranks (the ring algorithm; `nbytes` is the full buffer and divides by n here)."""
    problems, checks = [], 0
    for op in RING_OPS:
        cases, got, expected = [], [], []
        for nbytes in (96, 48 * 1024):
            for n in (1, 2, 3, 4, 8, 16):
                checks += 1
                want = ring_sent_bytes(op, nbytes, n)
                cases.append({"op": op, "B": nbytes, "N": n, "want": want})
                got.append(call_student(fn, op, nbytes, n))
                expected.append(want)
        problems += _one_line_per_op(op, cases, got, expected, BYTES_HINTS)
    report("ring bytes per rank", problems, checks)


def ring_time(op: str, nbytes: int, n: int, alpha: float, bandwidth: float) -> float:
    """α–β model of a ring collective: steps·α + (bytes this rank sends)/bandwidth, where a
    reduce-scatter or all-gather takes N−1 steps and an all-reduce 2(N−1)."""
    if op not in RING_OPS:
        raise ValueError(f"op must be one of {RING_OPS}, not {op!r}")
    steps = (n - 1) * (2 if op == "all_reduce" else 1)
    return steps * alpha + ring_sent_bytes(op, nbytes, n) / bandwidth


TIME_HINTS = [
    (lambda g, c: c["N"] == 1 and not _close(g, 0),
     "one rank alone takes no step and sends nothing: 0 s"),
    (lambda g, c: _close(g, c["steps"] * c["α"] + c["B"] / c["N"] / c["W"]),
     "the bandwidth term counts one chunk of B/N; a rank sends one chunk per step"),
    (lambda g, c: _close(g, c["want"] - c["steps"] * c["α"] + c["α"]),
     "one α per collective; the α–β model pays α on every step of the ring"),
    (lambda g, c: c["op"] == "all_reduce" and _close(g, c["want"] - c["steps"] * c["α"] / 2),
     "latency of N−1 steps: an all-reduce takes 2(N−1) (reduce-scatter, then all-gather)"),
    (lambda g, c: _close(g, c["want"] - c["steps"] * c["α"]),
     "the latency term is missing: every step costs α"),
    (lambda g, c: _close(g, c["steps"] * c["α"] + c["B"] * (2 if c["op"] == "all_reduce" else 1)
                         / c["W"]),
     "the bandwidth term uses all of B; a rank sends (N−1)/N·B per pass"),
    (lambda g, c: _close(g, c["want"] * 1e6) or _close(g, c["want"] * 1e3),
     "seconds, please (not µs or ms)"),
    (lambda g, c: c["α"] > 0,
     "right whenever α = 0, so the latency term is wrong: a ring takes N−1 steps (2(N−1) for an "
     "all-reduce), each costing α"),
    (lambda g, c: True,
     "wrong even with α = 0, so the bandwidth term is wrong: a rank sends (N−1)/N·B per pass "
     "(two passes for an all-reduce) at `bandwidth` bytes/s"),
]


def check_ring_time(fn) -> None:
    """Seconds for a ring collective under the α–β model (see `ring_time`)."""
    problems, checks = [], 0
    for op in RING_OPS:
        cases, got, expected = [], [], []
        for nbytes in (1024, 1 << 30):
            for n in (1, 2, 8, 64):
                for alpha in (0.0, 5e-6):
                    checks += 1
                    want = ring_time(op, nbytes, n, alpha, 450e9)
                    steps = (n - 1) * (2 if op == "all_reduce" else 1)
                    cases.append({"op": op, "B": nbytes, "N": n, "α": alpha, "W": 450e9,
                                  "steps": steps, "want": want})
                    got.append(call_student(fn, op, nbytes, n, alpha, 450e9))
                    expected.append(want)
        problems += _one_line_per_op(op, cases, got, expected, TIME_HINTS)
    report("ring time (α–β)", problems, checks)
