"""DualPipe(V)'s bubble settled by a count independent of the simulator (lesson 07b, issue 25).

`_tick_play` plays a schedule's op lists on ideal devices in whole time steps (integer op
costs): each tick, a free rank starts its next op if the ops it consumes have ended. An
overlapped F&B pair runs either as the executor runs it — its F, then its backward, each
starting as soon as its own input is there ("sequential") — or as DeepSeek's overlapped
chunk, which starts when both inputs are there and releases both outputs at its end
("joint"). It shares nothing with pipeline_simulator.py but the op lists. Against it:

- the simulator, idle time per rank, both modes, several schedules, p and m, unequal costs;
- the rules derived by hand from the schedule at F = B = W = c per op of a stage:
  DualPipeV sequential: every rank idles (p−1)c. The turn rank p−1 waits (p−1)·F for its
  first input, then never waits (its stage p−1 feeds its own stage p), and all ranks end
  together; joint: 2(p−1)c, the extra (p−1)c being the F&B chunks' wait for their second
  input — DeepSeek's (PP/2−1)(F&B + B_full − 3W) with PP = 2p stages, F&B = 3c, B_full = 2c.
  DualPipe: the same with p/2 for p. With the half-size stages DualPipeV really has
  (c = ½ of a p-stage cut's op), joint DualPipeV idles exactly ZB-H1's (p−1)(F+B−W), and
  sequential half of it.
"""
from __future__ import annotations

import pytest

from picolib.pipeline_schedules import Op, make_schedule
from picolib.pipeline_simulator import simulate
from picolib.timeline import bubble_ratio


def _tick_play(sched, cost, joint):
    """Idle ticks per rank (from 0 to the last op's end) with integer costs
    cost = {"F", "B", "W"} (BW = B + W; an F&B chunk lasts F + its backward)."""
    dur = {"F": cost["F"], "B": cost["B"], "W": cost["W"], "BW": cost["B"] + cost["W"]}
    out_at = {}                                     # (kind, stage, mb) -> tick its output exists

    def inputs(op):
        if op.kind == "F":
            prev = sched.prev_stage(op.stage)
            return [] if prev is None else [("F", prev, op.mb)]
        if op.kind in ("B", "BW"):
            nxt = sched.next_stage(op.stage)
            return [] if nxt is None else [("back", nxt, op.mb)]
        return []

    def key(op):
        return ("back" if op.kind in ("B", "BW") else op.kind, op.stage, op.mb)

    R = sched.n_ranks
    pos, free_at, busy_ticks = [0] * R, [0] * R, [[] for _ in range(R)]
    t, total = 0, sum(len(s) for s in sched.ops)
    started = 0
    while started < total:
        for r, seq in enumerate(sched.ops):
            if free_at[r] > t or pos[r] >= len(seq):
                continue
            chunk = seq[pos[r]:pos[r] + (2 if joint and pos[r] in sched.overlap[r] else 1)]
            if any(out_at.get(k, t + 1) > t for op in chunk for k in inputs(op)):
                continue
            length = sum(dur[op.kind] for op in chunk)
            end = t
            for op in chunk:
                end += dur[op.kind]
                out_at[key(op)] = t + length if len(chunk) == 2 else end
            busy_ticks[r].append((t, t + length))
            free_at[r], pos[r], started = t + length, pos[r] + len(chunk), started + len(chunk)
        t += 1
        if t > 100_000:
            raise AssertionError("tick play did not finish (deadlock)")
    span = max(free_at)
    return [span - sum(b - a for a, b in busy_ticks[r]) for r in range(R)]


def _sim_idle(sched, cost, joint):
    ev = simulate(sched, cost, overlap=joint)
    span = max(e["end"] for e in ev)
    return [round(span - sum(e["end"] - e["start"] for e in ev if e["rank"] == r), 9)
            for r in range(sched.n_ranks)]


CASES = [("dualpipev", p, m) for p in (2, 3, 4, 6) for m in (2 * p, 2 * p + 3)] + \
        [("dualpipe", p, m) for p in (2, 4, 6) for m in (2 * p, 2 * p + 4)] + \
        [("zb_h1", 4, 8), ("1f1b", 4, 8), ("afab", 3, 5)]
COSTS = [{"F": 1, "B": 1, "W": 1}, {"F": 2, "B": 1, "W": 1}, {"F": 1, "B": 2, "W": 1},
         {"F": 1, "B": 1, "W": 2}, {"F": 3, "B": 2, "W": 1}]


@pytest.mark.parametrize("name, p, m", CASES)
@pytest.mark.parametrize("joint", [False, True])
def test_simulator_equals_tick_count(name, p, m, joint):
    sched = make_schedule(name, p, m)
    for cost in COSTS:
        assert _sim_idle(sched, cost, joint) == _tick_play(sched, cost, joint), (name, p, m, cost)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_dualpipev_idle_by_the_hand_rule(p):
    unit = {"F": 1, "B": 1, "W": 1}
    for m in (2 * p, 2 * p + 1, 2 * p + 5):
        s = make_schedule("dualpipev", p, m)
        assert _tick_play(s, unit, joint=False) == [p - 1] * p            # as the executor runs it
        assert _tick_play(s, unit, joint=True) == [2 * (p - 1)] * p       # F&B chunks (DeepSeek)
        if p % 2 == 0 and m % 2 == 0:
            d = make_schedule("dualpipe", p, m)
            assert _tick_play(d, unit, joint=False) == [p // 2 - 1] * p
            assert _tick_play(d, unit, joint=True) == [2 * (p // 2 - 1)] * p


def test_dualpipev_against_zb_h1_at_equal_model_cuts():
    """Issue 25's "6 idle units where ZB-H1 has 3": F = B = W = 1 per op of a *stage*, and a
    DualPipeV rank runs two stages of half the size. At the same model cut (DualPipeV's ops
    half as long; ticks of ½: costs 1 against ZB-H1's 2) joint DualPipeV idles what ZB-H1
    does, and the bubble (idle / busy) is the same; run as the executor runs it, half."""
    p, m = 4, 8
    zb = _tick_play(make_schedule("zb_h1", p, m), {"F": 2, "B": 2, "W": 2}, joint=False)
    v = make_schedule("dualpipev", p, m)
    assert zb == [2 * (p - 1)] * p
    assert _tick_play(v, {"F": 1, "B": 1, "W": 1}, joint=True) == zb
    assert _tick_play(v, {"F": 1, "B": 1, "W": 1}, joint=False) == [z // 2 for z in zb]
    half = {"F": 0.5, "B": 0.5, "W": 0.5}
    assert bubble_ratio(simulate(v, half)) == pytest.approx(bubble_ratio(simulate(make_schedule("zb_h1", p, m))))
    assert bubble_ratio(simulate(v, half, overlap=False)) == pytest.approx(1 / 16)


@pytest.mark.parametrize("name, p, m", [("dualpipev", 4, 8), ("dualpipev", 5, 13), ("dualpipe", 6, 14)])
def test_overlapped_pairs_follow_deepseeks_phases(name, p, m):
    """DeepSeek's reference: rank r (of the half, for DualPipe) runs m'−2p'+r+1 steady rounds
    of two F&B chunks and p'−r−1 more in phase 5 — except the turn rank p'−1, whose first
    steady F and B run one after the other ("we don't overlap these two chunks")."""
    s = make_schedule(name, p, m)
    pp, mm = (p, m) if name == "dualpipev" else (p // 2, m // 2)
    for rank, pairs in enumerate(s.overlap):
        r = rank if name == "dualpipev" else min(rank, p - 1 - rank)
        assert len(pairs) == 2 * (mm - 2 * pp + r + 1) + (pp - r - 1) - (r == pp - 1), rank
        seq = s.ops[rank]
        assert all(seq[i].kind == "F" and seq[i + 1].kind == "BW" for i in pairs)


def test_tick_count_catches_a_wrong_op_list():
    """The count is not a copy of a rule: run rank 0's first two forwards in the other order
    (micro-batch 1 before 0, still a valid schedule) and the count, like the simulator, sees
    the later ranks wait for micro-batch 0 — no longer p−1 per rank."""
    s = make_schedule("dualpipev", 4, 8)
    seq = s.ops[0]
    assert seq[:2] == [Op("F", 0, 0), Op("F", 0, 1)]
    seq[0], seq[1] = seq[1], seq[0]
    unit = {"F": 1, "B": 1, "W": 1}
    count = _tick_play(s, unit, joint=False)
    assert count != [3] * 4 and count == _sim_idle(s, unit, joint=False)


@pytest.mark.parametrize("p, m", [(4, 8), (6, 12), (8, 16), (8, 24)])
def test_dualpipe_is_dualpipev_on_half_the_ranks(p, m):
    """Lesson 07b §2: every DualPipe rank's ops, rewritten as DualPipeV's (its chunk 0 → stage
    min(r, p−1−r), its chunk 1 → the V's way back, up micro-batch m/2 + i → i), equal the ops
    of rank min(r, p−1−r) of DualPipeV with p/2 ranks and m/2 micro-batches, op for op."""
    d, v = make_schedule("dualpipe", p, m), make_schedule("dualpipev", p // 2, m // 2)
    for r in range(p):
        h, chunk0 = min(r, p - 1 - r), (r if r < p // 2 else 2 * p - 1 - r)
        as_v = [(o.kind, h if o.stage == chunk0 else p - 1 - h, o.mb % (m // 2)) for o in d.ops[r]]
        assert as_v == [(o.kind, o.stage, o.mb) for o in v.ops[h]], (p, m, r)
        assert d.overlap[r] == v.overlap[h]
