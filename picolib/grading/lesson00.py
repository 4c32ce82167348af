"""Checks for lesson 00 (collectives).

- `check_ring_all_reduce(fn)`: `fn(tensor, group=None)` sums `tensor` over the ranks of
  `group` with a ring built from picolib.comm point-to-point calls; run on 2, 3 and 4 ranks,
  and on 4 ranks split into two groups of 2 (a `group` ignored is named).
- `check_all_reduce_from_rs_ag(fn)`: the same result from one `comm.reduce_scatter`
  followed by one `comm.all_gather`; run on 2 and 4 ranks, and on two groups of 2.
- `check_ring_bytes(fn)`: `fn(op, nbytes, n)` → bytes one rank sends in a ring collective.
- `check_ring_time(fn)`: `fn(op, nbytes, n, alpha, bandwidth)` → seconds under the α–β model.

The networking problems of the GPU chapter of *How to Scale Your Model*:
- `check_node_bandwidth(fn)`: a node's total bandwidth, ports or switches (3.6 TB/s for H100);
- `check_bisection_bandwidth(fn)`: across the worst cut, both directions (3.6 TB/s);
- `check_sharp_switch(fn)`: bytes through the switches of an in-network all-reduce (B·N each
  way, counted on real ranks) and its time;
- `check_all_gather_seconds(fn)`: an all-gather inside a node (65 µs, not the book's 9 µs);
- `check_su_all_gather(fn)`: bytes at the node and top switches of an all-gather in one SU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger, ring_sent_bytes
from ..launch import run
from ._core import (SUBGROUPS, call_student, compare, diagnose, explain, members, my_group,
                    on_world_not_group, report, run_student)

__all__ = ["check_ring_all_reduce", "check_all_reduce_from_rs_ag", "check_ring_bytes",
           "check_ring_time", "ring_time", "check_node_bandwidth", "check_bisection_bandwidth",
           "check_sharp_switch", "check_all_gather_seconds", "check_su_all_gather"]

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


# How many chunks of B/N a rank sent, explained for every N at once: a count that fits one of
# these at N = 3 (2 chunks: one step per pass, or one pass of N−1 steps) may fit another at N = 4,
# so a hint is given only when its rule holds on every N where the count is wrong.
STEP_HINTS = [
    (lambda c, n: c == n - 1,
     "N−1 chunks, half a ring all-reduce: one of the two passes (reduce-scatter, then all-gather) "
     "is missing"),
    (lambda c, n: c == 2,
     "2 chunks at every N: one step per pass; each pass (reduce-scatter, then all-gather) takes "
     "N−1 steps"),
    (lambda c, n: c == 2 * n - 3,
     "2(N−1) − 1 chunks: one step short; each pass takes N−1 steps (check the range of a loop)"),
]


def _step_hint(chunks_by_n: dict[int, float]) -> str:
    """The hint of `STEP_HINTS` whose rule fits the chunk count of every N where it is wrong
    ("" if none, or if several do)."""
    wrong = {n: c for n, c in chunks_by_n.items() if c != 2 * (n - 1)}
    fitting = [msg for rule, msg in STEP_HINTS if wrong and all(rule(c, n) for n, c in wrong.items())]
    return fitting[0] if len(fitting) == 1 else ""


def check_ring_all_reduce(fn, timeout: float | None = None) -> None:
    """Sum over 2, 3 and 4 ranks and over two groups of 2 out of 4, and the traffic of a
    ring: 2(N−1)/N · B per rank, sent through picolib.comm (send / exchange), so that the
    Ledger sees it. `timeout`: seconds before the ranks count as stuck."""
    problems, checks, runs = [], 0, []
    for label, size, inputs, expected, n, split in _cases(lambda k: _inputs(k, 12, seed=k),
                                                          (2, 3, 4)):
        results = _run(fn, size, inputs, "ring_all_reduce", split, timeout)
        runs.append((label, size, inputs, expected, n, split, results))
    chunks_by_n = {}
    for label, size, inputs, expected, n, split, results in runs:
        nbytes = inputs[0].numel() * inputs[0].element_size()
        for _, summary in results:
            sent = summary.get("send", {}).get("sent_bytes", 0)
            chunks_by_n[n] = chunks_by_n.get(n, sent / (nbytes / n))
    step_hint = _step_hint(chunks_by_n)
    for label, size, inputs, expected, n, split, results in runs:
        nbytes = inputs[0].numel() * inputs[0].element_size()
        want = ring_sent_bytes("all_reduce", nbytes, n)
        world = torch.stack(inputs).sum(0)
        per_rank = {}
        for rank, (out, summary) in enumerate(results):
            checks += 2
            ring = [inputs[m] for m in (members(rank) if split else range(size))]
            sent = summary.get("send", {}).get("sent_bytes", 0)
            mine = compare("result", out, expected[rank], atol=1e-5)
            if mine and isinstance(out, torch.Tensor) and out.shape == world.shape and \
                    torch.allclose(out, inputs[rank], atol=1e-5):
                mine = ["result: this rank's own input, unchanged: nothing was added (did the "
                        "reduce-scatter steps run, and add into the chunk?)"]
            elif mine and split and isinstance(out, torch.Tensor) and out.shape == world.shape \
                    and torch.allclose(out, world, atol=1e-5):
                mine = [on_world_not_group("result")]
            elif mine and sent == want:    # the right steps: a partial sum is a chunk index's fault
                story = _chunk_story(out, inputs, ring, n)
                mine = [mine[0] + (f" — {story}" if story else "")]
            if sent != want:
                why = ("the whole tensor each step instead of one chunk of B/N"
                       if sent == 2 * (n - 1) * nbytes else
                       "(N−1)·B, the whole tensor to every other rank; a ring passes chunks of "
                       "B/N to one neighbour" if sent == (n - 1) * nbytes else
                       "nothing through comm.send/comm.exchange" if not sent else
                       step_hint or
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


def _one_line_per_op(op: str, cases: list[dict], got: list, expected: list, hints,
                     deductions=()) -> list[str]:
    """[] if every case matches; else one line for `op`: the hint whose rule explains every
    wrong case (each of them when several do), else the first deduction that holds, else how
    many cases differ with an example. A case is a dict of the inputs (its label is its items);
    a hint is (rule(got, case) -> bool, message)."""
    wrong = [i for i, (g, e) in enumerate(zip(got, expected))
             if compare("", g, e, atol=1e-12, rtol=1e-6)]
    if not wrong:
        return []
    i = wrong[0]
    label = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in cases[i].items()
                      if k not in ("want", "steps", "W", "op") and not k.startswith("_"))
    example = f"e.g. {label}: got {got[i]!r}, expected {expected[i]!r}"
    fitting = []
    for rule, message in hints:
        try:
            if all(rule(got[j], cases[j]) for j in wrong):
                fitting.append(message)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
    if fitting:
        return [f"{op}: {explain(fitting)} ({example})"]
    for rule, message in deductions:
        if all(rule(got[j], cases[j]) for j in wrong):
            return [f"{op}: {message} ({example})"]
    try:
        grid = torch.tensor([float(g) for g in got], dtype=torch.float64)
    except (TypeError, ValueError):
        return [f"{op}: expected a number ({example})"]
    hint = diagnose(grid, torch.tensor([float(e) for e in expected], dtype=torch.float64),
                    atol=1e-12, rtol=1e-6)
    if "a sum where a mean" in hint:     # no mean in these formulas: say the factor, not a cause
        hint = hint.split(":")[0]
    return [f"{op}: {len(wrong)} of {len(cases)} cases wrong, {example}" + (f" — {hint}" if hint else "")]


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
]
# what the wrong cases alone prove when no known slip fits them
TIME_DEDUCTIONS = [
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
        problems += _one_line_per_op(op, cases, got, expected, TIME_HINTS, TIME_DEDUCTIONS)
    report("ring time (α–β)", problems, checks)


# ------------------------------------------------- networking problems of the GPU chapter
# (How to Scale Your Model, "GPUs"): each answer is compared with picolib.hardware and with a
# second derivation (a count of links, routes or messages), and a wrong one is named in a line.

def _grid(name: str, fn, cases: list[dict], reference, hints, keys=None) -> tuple[list[str], int]:
    """Call `fn(**case inputs)` on every case; one line per key (or one for a number) naming
    the first hint that explains every wrong case."""
    got = [call_student(fn, **{k: v for k, v in c.items() if not k.startswith("_")})
           for c in cases]
    want = [reference(c) for c in cases]
    if keys is None:
        return _one_line_per_op(name, cases, got, want, hints), len(cases)
    problems = []
    for key in keys:
        if not all(isinstance(g, dict) and key in g for g in got):
            return [f"{name}: return a dict with the keys {list(keys)} (got {got[0]!r})"], len(cases)
        problems += _one_line_per_op(f"{name}[{key!r}]", cases, [g[key] for g in got],
                                     [w[key] for w in want], hints.get(key, []))
    return problems, len(cases) * len(keys)


def _unit_hints(kind="bytes/s"):
    return [(lambda g, c: _close(g, c["_want"] / 1e9) or _close(g, c["_want"] / 1e12),
             f"{kind}, please (not GB/s or TB/s): 450e9, not 450")]


NODE_CASES = [  # the H100 node; a node whose switches bind; smaller and bigger nodes
    {"gpus": 8, "per_gpu": 450e9, "switches": 4, "switch_bw": 64 * 25e9},
    {"gpus": 8, "per_gpu": 450e9, "switches": 2, "switch_bw": 64 * 25e9},
    {"gpus": 4, "per_gpu": 300e9, "switches": 6, "switch_bw": 1.2e12},
    {"gpus": 16, "per_gpu": 900e9, "switches": 4, "switch_bw": 3.2e12},
]


def node_bandwidth(gpus: int, per_gpu: float, switches: int, switch_bw: float) -> float:
    """Total bytes/s a switched node moves (one direction): the GPUs' ports or the switches,
    whichever carries less."""
    return min(gpus * per_gpu, switches * switch_bw)


NODE_HINTS = [
    (lambda g, c: _close(g, c["switches"] * c["switch_bw"]),
     "the switches' capacity; every byte also passes a GPU port, and the GPUs' ports carry "
     "only gpus·per_gpu"),
    (lambda g, c: _close(g, c["gpus"] * c["per_gpu"]),
     "the GPUs' ports only; when the switches carry less than the ports, the switches bound it"),
    (lambda g, c: _close(g, c["gpus"] * c["per_gpu"] + c["switches"] * c["switch_bw"]),
     "a sum; a byte crosses a GPU port AND a switch, so the smaller of the two bounds the node"),
    (lambda g, c: _close(g, 2 * c["_want"]),
     "twice the answer: count one direction (a port's 450 GB/s is per direction)"),
] + _unit_hints()


def check_node_bandwidth(fn) -> None:
    """`fn(gpus, per_gpu, switches, switch_bw)` → the node's total bandwidth in bytes/s (one
    direction). Reference: `node_bandwidth`; for the H100 node also picolib's preset."""
    from ..hardware import GPUS
    assert node_bandwidth(**NODE_CASES[0]) == GPUS["H100-SXM"].levels[0].total
    cases = [dict(c, _want=node_bandwidth(**c)) for c in NODE_CASES]
    problems, checks = _grid("node bandwidth", fn, cases, lambda c: c["_want"], NODE_HINTS)
    report("node bandwidth", problems, checks)


def bisection_bandwidth(gpus: int, per_gpu: float) -> float:
    """Bisection bandwidth of a non-blocking switched node, both directions counted (the GPU
    chapter's convention): half the GPUs send across at per_gpu each, and the other half back."""
    return 2 * (gpus // 2) * per_gpu


def _bisection_by_pairs(gpus: int, per_gpu: float) -> float:
    """A second count: the bytes/s that cross the worst cut when every GPU streams to a
    partner on the other side (the busiest pattern a cut sees), summed message by message."""
    left, right = range(gpus // 2), range(gpus // 2, gpus)
    flows = [(a, b) for a, b in zip(left, right)] + [(b, a) for a, b in zip(left, right)]
    return sum(per_gpu for _ in flows)      # each GPU's port sends at per_gpu, one flow each


BISECTION_HINTS = [
    (lambda g, c: _close(g, c["_want"] / 2),
     "one direction only; the exercise (like the GPU chapter) counts both directions across the cut"),
    (lambda g, c: _close(g, 2 * c["_want"]),
     "twice the answer: only half the GPUs sit on each side of the cut"),
    (lambda g, c: _close(g, c["_want"] / c["gpus"] * 2) or _close(g, c["per_gpu"]),
     "one GPU's port; the cut is crossed by every GPU on one side (and back)"),
] + _unit_hints()


def check_bisection_bandwidth(fn) -> None:
    """`fn(gpus, per_gpu)` → bytes/s across the worst cut of the node into two halves, both
    directions counted. Reference: `bisection_bandwidth`, checked against a count of flows."""
    cases = []
    for gpus, per_gpu in ((8, 450e9), (4, 300e9), (16, 900e9), (2, 50e9)):
        assert bisection_bandwidth(gpus, per_gpu) == _bisection_by_pairs(gpus, per_gpu)
        cases.append({"gpus": gpus, "per_gpu": per_gpu, "_want": bisection_bandwidth(gpus, per_gpu)})
    problems, checks = _grid("bisection bandwidth", fn, cases, lambda c: c["_want"], BISECTION_HINTS)
    report("bisection bandwidth", problems, checks)


def sharp_switch(nbytes: float, n: int, per_gpu: float, switch_total: float) -> dict:
    """A single-node all-reduce with in-network reduction: bytes into and out of the switches
    (each GPU sends its B once and receives the B-byte sum once: B·N each way) and the seconds
    it takes, set by the slower of a GPU's port (B/per_gpu) and the switches (B·N/switch_total)."""
    return {"in": nbytes * n, "out": nbytes * n,
            "seconds": max(nbytes / per_gpu, nbytes * n / switch_total)}


def _switch_worker(n_gpus, numel):
    """Ranks 0…N−1 are GPUs, rank N plays the switch (as in the lesson): the ledger counts
    what the switch receives and sends."""
    from .. import comm
    me, switch = dist.get_rank(), n_gpus
    with Ledger() as ledger:
        if me == switch:
            parts = [torch.empty(numel) for _ in range(n_gpus)]
            comm.exchange(recvs=[(p, g) for g, p in enumerate(parts)])
            total = torch.stack(parts).sum(0)
            comm.exchange(sends=[(total, g) for g in range(n_gpus)])
        else:
            x = torch.ones(numel)
            comm.exchange(sends=[(x, switch)])
            comm.exchange(recvs=[(x, switch)])
    return ledger.total("sent_bytes"), sum(r.nbytes for r in ledger.records if r.op == "recv")


def switch_bytes_measured(n_gpus: int = 3, numel: int = 64) -> tuple[int, int, int]:
    """(B, bytes the stand-in switch received, bytes it sent), counted on real ranks."""
    res = run(_switch_worker, n_gpus + 1, n_gpus, numel)
    sent, received = res[n_gpus]
    return numel * 4, received, sent


SHARP_HINTS = {
    "in": [(lambda g, c: _close(g, c["nbytes"]), "one GPU's B; the switch receives B from each of N GPUs"),
           (lambda g, c: _close(g, c["nbytes"] * (c["n"] - 1)),
            "(N−1)·B: every GPU sends its B, none is left out (the switch holds no data of its own)")],
    "out": [(lambda g, c: _close(g, c["nbytes"]), "B once; the switch sends the sum to each of N GPUs"),
            (lambda g, c: _close(g, c["nbytes"] * (c["n"] - 1)),
             "(N−1)·B: every GPU needs the sum, its own contribution is not in it until the switch adds it")],
    "seconds": [
        (lambda g, c: _close(g, c["nbytes"] * c["n"] / c["switch_total"]),
         "the switches' share only (B·N over their total, the book's 'B·N/W'); a GPU's own port "
         "carries B at per_gpu and is the slower of the two here"),
        (lambda g, c: _close(g, c["nbytes"] / c["per_gpu"]),
         "a GPU's port only; when the switches are slower (B·N/switch_total larger), they set the time"),
        (lambda g, c: _close(g, 2 * c["_want"]["seconds"]),
         "twice the time: sending B up and receiving the sum happen at once (full duplex)"),
    ],
}


def check_sharp_switch(fn) -> None:
    """`fn(nbytes, n, per_gpu, switch_total)` → {"in", "out", "seconds"}: the bytes through the
    switches of a single-node all-reduce with in-network reduction, and its time. The byte
    counts are confirmed on real ranks (one playing the switch, as in the lesson)."""
    b, received, sent = switch_bytes_measured(3)
    assert received == sent == 3 * b, (received, sent, b)      # measured: B·N each way
    cases = [dict(nbytes=1e9, n=8, per_gpu=450e9, switch_total=4 * 64 * 25e9),
             dict(nbytes=2 ** 25, n=8, per_gpu=450e9, switch_total=4 * 64 * 25e9),
             dict(nbytes=1e6, n=4, per_gpu=300e9, switch_total=0.6e12),     # switches bind
             dict(nbytes=float(b), n=3, per_gpu=100e9, switch_total=1e12)]
    for c in cases:
        c["_want"] = sharp_switch(c["nbytes"], c["n"], c["per_gpu"], c["switch_total"])
    problems, checks = _grid("sharp_switch", fn, cases, lambda c: c["_want"], SHARP_HINTS,
                             keys=("in", "out", "seconds"))
    report("the switch in an in-network all-reduce", problems, checks)


def all_gather_seconds(shape, itemsize: int, n: int, per_gpu: float) -> float:
    """A ring all-gather inside a node of `n` GPUs of an array of `shape` with `itemsize`
    bytes per element: every GPU receives (N−1)/N of its bytes through its own port."""
    from ..hardware import ring_time as hw_ring_time
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    return hw_ring_time("all_gather", nbytes, n, per_gpu, alpha=0)


AG_HINTS = [
    (lambda g, c: _close(g, c["_B"] / (c["n"] * c["per_gpu"])),
     "B/(N·W) — the published 9 µs: dividing by the node's total forgets that each GPU must "
     "receive (N−1)/N of B through its own port"),
    (lambda g, c: _close(g, c["_B"] / c["per_gpu"]),
     "all of B; each GPU already holds its own 1/N, so it receives (N−1)/N·B"),
    (lambda g, c: _close(g * c["itemsize"], c["_want"]),
     "elements, not bytes: multiply by the bytes per element"),
    (lambda g, c: _close(g, 8 * c["_want"]),
     "8× the answer at every N: bits, not bytes — itemsize and per_gpu are both in bytes"),
    (lambda g, c: _close(g, c["_want"] * 1e6) or _close(g, c["_want"] * 1e3),
     "seconds, please (not µs or ms)"),
]


def check_all_gather_seconds(fn) -> None:
    """`fn(shape, itemsize, n, per_gpu)` → seconds of a ring all-gather inside a node
    (bandwidth term only). Reference: picolib.hardware.ring_time with α = 0, and the count
    of the bytes one GPU receives, (N−1) chunks of B/N."""
    cases = []
    for shape, itemsize, n, w in (((1024, 16384), 2, 8, 450e9), ((4096, 4096), 4, 8, 450e9),
                                  ((512, 768), 2, 4, 300e9), ((1 << 20,), 1, 2, 50e9)):
        b = itemsize
        for d in shape:
            b *= d
        want = all_gather_seconds(shape, itemsize, n, w)
        assert abs(want - (n - 1) * (b // n) / w) <= 1e-12 * want   # (N−1) chunks of B/N
        cases.append({"shape": shape, "itemsize": itemsize, "n": n, "per_gpu": w, "_B": b,
                      "_want": want})
    problems, checks = _grid("all-gather seconds", fn, cases, lambda c: c["_want"], AG_HINTS)
    report("all-gather inside a node", problems, checks)


def su_all_gather(nbytes: float, m: int, n: int, w_node: float, w_top: float) -> dict:
    """An all-gather of B bytes over M nodes × N GPUs under one top (leaf) switch level, each
    GPU starting with B/(MN): bytes into and out of one node's switches and the top level,
    and the seconds, the slower level setting the pace (each level's output over its bandwidth)."""
    node_in = nbytes / m + nbytes * (m - 1) / m          # its GPUs' shards + the other nodes'
    node_out = nbytes / m + n * (nbytes - nbytes / (m * n))   # up to the top + to each GPU
    top_in, top_out = nbytes, nbytes * (m - 1)             # every node's B/M; to each the rest
    return {"node_in": node_in, "node_out": node_out, "top_in": top_in, "top_out": top_out,
            "seconds": max(node_out / w_node, top_out / w_top)}


def _su_routes(m: int, n: int, shard: float) -> dict:
    """A second count: route every shard to every GPU that lacks it (up to the node switch;
    across the top level once per other node, then down that node's switch to each GPU) and
    add the bytes each switch level receives and sends."""
    tally = {"node_in": 0.0, "node_out": 0.0, "top_in": 0.0, "top_out": 0.0}
    node = 0                                               # the node whose switch we count
    for src_node in range(m):
        for _ in range(n):                                 # one shard per GPU
            if src_node == node:
                tally["node_in"] += shard                  # from its GPU into the node switch
                tally["node_out"] += shard * (n - 1)       # to the node's other GPUs
                if m > 1:
                    tally["node_out"] += shard             # up to the top, once
            else:
                tally["node_in"] += shard                  # down from the top, once
                tally["node_out"] += shard * n             # to each of the node's GPUs
            if m > 1:
                tally["top_in"] += shard                   # every shard goes up once
                tally["top_out"] += shard * (m - 1)        # and down to each other node
    return tally


SU_HINTS = {
    "node_in": [(lambda g, c: _close(g, c["nbytes"] / c["m"]),
                 "only the node's own shards; the other nodes' (M−1)/M·B come in from the top too")],
    "node_out": [(lambda g, c: _close(g, c["nbytes"] * (c["n"] - 1) / c["m"] + c["nbytes"] / c["m"]),
                  "only the node's own shards; every GPU needs all of B but its own B/(MN)"),
                 (lambda g, c: _close(g, c["nbytes"]),
                  "B once; each of the N GPUs needs its own copy of B − B/(MN)")],
    "top_out": [(lambda g, c: _close(g, c["nbytes"]),
                 "B once; each of the M nodes needs the other nodes' (M−1)/M·B: (M−1)·B in all")],
    "top_in": [],
    "seconds": [(lambda g, c: _close(g, c["_want"]["node_out"] / c["w_node"]),
                 "the node level's time; the top level is slower here: (M−1)·B/w_top"),
                (lambda g, c: _close(g, c["_want"]["top_out"] / c["w_top"]),
                 "the top level's time; the node level is slower here: N·B/w_node")],
}


def check_su_all_gather(fn) -> None:
    """`fn(nbytes, m, n, w_node, w_top)` → {"node_in", "node_out", "top_in", "top_out",
    "seconds"}. Reference: `su_all_gather`, its bytes checked against a count of every
    shard's route (`_su_routes`)."""
    cases = []
    for b, m, n, w_node, w_top in ((2 ** 25, 32, 8, 3.6e12, 12.8e12), (1e9, 32, 8, 3.6e12, 12.8e12),
                                   (1e6, 2, 4, 1.2e12, 0.1e12), (6e6, 3, 2, 1e12, 1e12)):
        want = su_all_gather(b, m, n, w_node, w_top)
        routed = _su_routes(m, n, b / (m * n))
        assert all(abs(routed[k] - want[k]) <= 1e-9 * b * m * n for k in routed), (routed, want)
        cases.append({"nbytes": b, "m": m, "n": n, "w_node": w_node, "w_top": w_top, "_want": want})
    problems, checks = _grid("su_all_gather", fn, cases, lambda c: c["_want"], SU_HINTS,
                             keys=("node_in", "node_out", "top_in", "top_out", "seconds"))
    report("all-gather inside one scalable unit", problems, checks)
