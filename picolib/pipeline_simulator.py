"""Check a pipeline schedule and play it on ideal devices (lesson 07).

`validate` rejects a schedule with a missing or doubled op, a backward before its forward,
a W before its B, or an order that deadlocks; `simulate` gives every rank's timeline for
per-op costs, as timeline events, so `picolib.timeline.plot_gantt` and `bubble_ratio` work
on it as on a measured run; `comm_latency` reads the hand-over time off a measured run.

The communication model is the executor's (pipeline_parallel.py): sends are eager (never
wait), a receive waits until the producer has finished. So a schedule deadlocks exactly
when every unfinished rank waits for an op that comes later in another rank's list.

Overlapped chunks (DualPipe's "F&B", `Schedule.overlap`): with `overlap=True` the two ops
run as one chunk — it starts when both inputs are there and lasts `cost["F&B"]` (default
F + BW: no speed-up, only the joint start). With `overlap=False` they are two ordinary ops,
which is how picolib's executor runs them: set a measured run beside `overlap=False` (with
F = B = W the joint start doubles DualPipeV's idle time, (p−1)c → 2(p−1)c per rank).
"""
from __future__ import annotations

from .pipeline_schedules import Op, Schedule

__all__ = ["ScheduleError", "check_ops", "validate", "simulate", "comm_latency"]


class ScheduleError(ValueError):
    """The schedule cannot run: the message names the op and the ranks involved."""


def _needs(op: Op, sched: Schedule) -> list[Op]:
    """The ops of other stages whose output `op` consumes (the same stage's are ordering)."""
    if op.kind == "F":
        prev = sched.prev_stage(op.stage)
        return [] if prev is None else [Op("F", prev, op.mb)]
    nxt = sched.next_stage(op.stage)
    if op.kind in ("B", "BW") and nxt is not None:
        return [Op("B", nxt, op.mb)]             # stands for "B or BW" of the next stage
    return []


def check_ops(sched: Schedule):
    """Raise ScheduleError unless every rank's ops are well formed: known kinds, stages and
    micro-batches in range, each op once and on its stage's rank, every F with its backward
    (the checks that need no simulation)."""
    S, m = sched.n_stages, sched.n_micro
    where: dict = {}
    for r, seq in enumerate(sched.ops):
        for i, op in enumerate(seq):
            if op.kind not in ("F", "B", "W", "BW"):
                raise ScheduleError(f"rank {r}: unknown op kind {op.kind!r} in {op}")
            if not (0 <= op.stage < S and 0 <= op.mb < m):
                raise ScheduleError(f"rank {r}: {op} is outside {S} stages × {m} micro-batches")
            if op.mb not in sched.micro_batches(op.stage):
                raise ScheduleError(f"rank {r}: micro-batch {op.mb} does not pass through "
                                    f"stage {op.stage} (another pipeline's) in {op}")
            if sched.stage_ranks[op.stage] != r:
                raise ScheduleError(f"rank {r}: {op} belongs to rank {sched.stage_ranks[op.stage]}")
            if (op.kind, op.stage, op.mb) in where:
                raise ScheduleError(f"rank {r}: {op} appears twice")
            where[(op.kind, op.stage, op.mb)] = i
    for r, pairs in enumerate(sched.overlap):
        for i in pairs:
            seq = sched.ops[r]
            if not (0 <= i < len(seq) - 1 and seq[i].kind == "F" and seq[i + 1].kind != "F"
                    and seq[i].stage != seq[i + 1].stage):
                raise ScheduleError(f"rank {r}: overlap at {i} must pair an F with the next "
                                    f"op, a backward of another stage")
    for s in range(S):
        r = sched.stage_ranks[s]
        for mb in sched.micro_batches(s):
            f, bw = where.get(("F", s, mb)), where.get(("BW", s, mb))
            b, w = where.get(("B", s, mb)), where.get(("W", s, mb))
            if f is None:
                raise ScheduleError(f"rank {r}: missing F(s{s},mb{mb})")
            if bw is not None and (b is not None or w is not None):
                raise ScheduleError(f"rank {r}: stage {s} mb {mb} has both BW and a split B/W")
            if bw is None and (b is None or w is None):
                miss = "BW (or B and W)" if b is None and w is None else ("B" if b is None else "W")
                raise ScheduleError(f"rank {r}: missing {miss} of stage {s}, micro-batch {mb}")
            first_back = bw if bw is not None else b
            if first_back < f:
                raise ScheduleError(f"rank {r}: backward of stage {s} mb {mb} comes before its F")
            if w is not None and w < b:
                raise ScheduleError(f"rank {r}: W(s{s},mb{mb}) comes before its B")


def simulate(sched: Schedule, cost=None, check: bool = True, overlap: bool = True,
             comm: float | None = None) -> list[dict]:
    """Run the schedule on ideal devices: each op starts when its rank is free and its input
    has arrived (producer's end + comm cost if it crossed ranks). `cost` is a dict with
    "F", "B", "W" (and "BW", default B + W; "F&B", default F + BW; "comm", default 0),
    time per op, or a function op -> time (e.g. each op's duration in a measured run: a
    replay); `comm`, if given, is the hand-over time for either form. With `overlap`, each pair in `sched.overlap` is
    one chunk: it starts when both its inputs are there and lasts cost["F&B"] (drawn as its
    F then its backward, sharing the time in proportion to their costs). Returns timeline
    events (rank, name, start, end, meta: stage, chunk, mb), ready for
    timeline.plot_gantt / bubble_ratio. Raises ScheduleError on a deadlock, naming what
    each stuck rank waits for."""
    if check:
        check_ops(sched)
    c = {"F": 1.0, "B": 1.0, "W": 1.0, "comm": 0.0, **(cost if isinstance(cost, dict) else {})}
    if comm is not None:
        c["comm"] = comm
    c.setdefault("BW", c["B"] + c["W"])
    op_cost = cost if callable(cost) else (lambda op: c[op.kind])
    end: dict = {}           # (kind-class, stage, mb) -> end time; B and BW both file as "B"
    pos, free = [0] * sched.n_ranks, [0.0] * sched.n_ranks
    events = []
    progress = True
    while progress:
        progress = False
        for r, seq in enumerate(sched.ops):
            while pos[r] < len(seq):
                paired = overlap and pos[r] in sched.overlap[r]
                chunk = seq[pos[r]:pos[r] + (2 if paired else 1)]
                ready = free[r]
                needs = [need for op in chunk for need in _needs(op, sched)]
                keys = [(need.kind, need.stage, need.mb) for need in needs]
                if any(key not in end for key in keys):
                    break
                for need, key in zip(needs, keys):
                    hop = c["comm"] if sched.stage_ranks[need.stage] != r else 0.0
                    ready = max(ready, end[key] + hop)
                costs = [op_cost(op) for op in chunk]
                total = c.get("F&B", sum(costs)) if paired and not callable(cost) else sum(costs)
                start = ready
                for op, share in zip(chunk, costs):
                    finish = start + total * share / sum(costs) if sum(costs) else start
                    end[("B" if op.kind == "BW" else op.kind, op.stage, op.mb)] = ready + total
                    events.append({"rank": r, "name": op.kind, "lane": "compute", "start": start,
                                   "end": finish, "emulated": True,
                                   "meta": {"stage": op.stage, "chunk": sched.chunk(op.stage),
                                            "mb": op.mb, "overlapped": paired}})
                    start = finish
                free[r], pos[r], progress = ready + total, pos[r] + len(chunk), True
    stuck = [(r, seq[pos[r]:pos[r] + (2 if overlap and pos[r] in sched.overlap[r] else 1)])
             for r, seq in enumerate(sched.ops) if pos[r] < len(seq)]
    if stuck:
        def missing(ops):
            return next(n for op in ops for n in _needs(op, sched)
                        if (n.kind, n.stage, n.mb) not in end)
        waits = "; ".join(f"rank {r} waits at {ops[0]} for {missing(ops)} on rank "
                          f"{sched.stage_ranks[missing(ops).stage]}" for r, ops in stuck)
        raise ScheduleError(f"deadlock: {waits}")
    return sorted(events, key=lambda e: (e["start"], e["rank"]))


def comm_latency(events, sched: Schedule) -> float:
    """Median hand-over time between ranks in measured events: for each op that had to wait
    for another rank's output, its start minus the later of (producer's end, its rank's
    previous end). Feed it to `simulate(cost={..., "comm": ...})`."""
    end, prev, gaps = {}, {}, []
    for e in sorted(events, key=lambda e: e["end"]):
        kind = "B" if e["name"] == "BW" else e["name"]
        end[(kind, e["meta"]["stage"], e["meta"]["mb"])] = e["end"]
    for e in sorted(events, key=lambda e: e["start"]):
        op = Op(e["name"], e["meta"]["stage"], e["meta"]["mb"])
        for need in _needs(op, sched):
            src = end.get((need.kind, need.stage, need.mb))
            if sched.stage_ranks[need.stage] != e["rank"] and src is not None \
                    and src > prev.get(e["rank"], float("-inf")):
                gaps.append(e["start"] - src)
        prev[e["rank"]] = e["end"]
    gaps.sort()
    return gaps[len(gaps) // 2] if gaps else 0.0


def validate(sched: Schedule) -> Schedule:
    """Raise ScheduleError if the schedule misses or doubles an op, runs a backward before
    its forward or a W before its B, or deadlocks; return it unchanged otherwise."""
    check_ops(sched)
    simulate(sched, check=False)
    return sched
