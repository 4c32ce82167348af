"""Tests for picolib.timeline: recording, emulation, merging across ranks, measures, export."""
import json
import time

import matplotlib
import pytest

matplotlib.use("Agg")

from picolib import launch  # noqa: E402
from picolib.timeline import (Timeline, busy_time, bubble_fraction, bubble_ratio,  # noqa: E402
                              gather, makespan, merge, overlap_time, plot_gantt,
                              to_chrome_trace)


def ev(rank, name, start, end, lane="compute", **meta):
    return {"rank": rank, "name": name, "lane": lane, "start": float(start), "end": float(end),
            "emulated": True, "meta": meta}


def afab(p, m, f=1.0, b=1.0):
    """All-forward-all-backward on p stages, m micro-batches, costs f and b (hand-built)."""
    out = []
    for s in range(p):
        for i in range(m):
            out.append(ev(s, "F", (s + i) * f, (s + i + 1) * f, mb=i))
            t = (m + p - 1) * f + (p - 1 - s + i) * b
            out.append(ev(s, "B", t, t + b, mb=i))
    return out


# --------------------------------------------------------------------------- recording

def test_span_records_name_lane_meta():
    tl = Timeline(rank=3)
    with tl.span("F", mb=2, chunk=1) as e:
        e["meta"]["bytes"] = 10
    with tl.span("allreduce", lane="comm"):
        pass
    f, a = tl.events
    assert (f["rank"], f["name"], f["lane"], f["meta"]) == (3, "F", "compute",
                                                            {"mb": 2, "chunk": 1, "bytes": 10})
    assert (a["name"], a["lane"], a["emulated"], f["emulated"]) == ("allreduce", "comm", False, False)
    assert f["end"] >= f["start"] and a["start"] >= f["end"]


def test_rank_defaults_to_zero_outside_a_group():
    assert Timeline().rank == 0


def test_emulated_span_lasts_cost_and_plain_span_is_not_padded():
    tl = Timeline(emulate={"F": 0.05})
    with tl.span("F"):
        pass
    with tl.span("B"):  # not in emulate: no padding
        pass
    with tl.span("B", cost=0.03):  # explicit cost wins
        pass
    with tl.span("F", cost=0.0):  # body slower than its cost: real time, no extra sleep
        time.sleep(0.02)
    f, b, b2, f2 = tl.events
    assert 0.05 <= f["end"] - f["start"] < 0.05 + 0.03 and f["emulated"] and f["cost"] == 0.05
    assert b["end"] - b["start"] < 0.01 and not b["emulated"]
    assert 0.03 <= b2["end"] - b2["start"] < 0.03 + 0.03 and b2["emulated"]
    assert 0.02 <= f2["end"] - f2["start"] < 0.02 + 0.03


def test_span_is_recorded_when_the_body_raises_and_add_checks_order():
    tl = Timeline(emulate={"F": 1.0})
    t = time.perf_counter()
    with pytest.raises(ZeroDivisionError):
        with tl.span("F"):
            1 / 0
    assert time.perf_counter() - t < 0.5  # no sleep after a failure
    tl.add("allreduce", 1.0, 2.5, lane="comm", bucket=0)
    with pytest.raises(ValueError):
        tl.add("allreduce", 2.0, 1.0)
    assert [e["name"] for e in tl.events] == ["F", "allreduce"]
    assert tl.events[1]["end"] - tl.events[1]["start"] == 1.5


def test_merge_shifts_to_zero_and_sorts():
    per_rank = [[ev(0, "F", 10.5, 11.0), ev(0, "B", 12.0, 13.0)],
                [ev(1, "F", 10.0, 10.5), ev(1, "B", 11.0, 12.0)]]
    out = merge(per_rank)
    assert [(e["rank"], e["name"], e["start"], e["end"]) for e in out] == [
        (1, "F", 0.0, 0.5), (0, "F", 0.5, 1.0), (1, "B", 1.0, 2.0), (0, "B", 2.0, 3.0)]
    assert per_rank[0][0]["start"] == 10.5  # inputs untouched
    assert merge(out) == out and merge([]) == []


def _staggered(stagger):
    import torch.distributed as dist
    tl = Timeline(emulate={"F": 0.05})
    dist.barrier()
    with tl.span("wait", cost=stagger * tl.rank):
        pass
    with tl.span("F", mb=tl.rank):
        pass
    return tl.events, gather(tl)


def test_events_from_launch_run_merge_with_ranks():
    results = launch.run(_staggered, 4, 0.1, timeout=30)
    events = merge([r[0] for r in results])
    assert sorted(e["rank"] for e in events) == [0, 0, 1, 1, 2, 2, 3, 3]
    fwd = [e for e in events if e["name"] == "F"]
    assert [e["rank"] for e in fwd] == [0, 1, 2, 3] and [e["meta"]["mb"] for e in fwd] == [0, 1, 2, 3]
    for e in fwd:
        assert abs(e["start"] - 0.1 * e["rank"]) < 0.05
        assert e["end"] - e["start"] >= 0.05
    gathered = results[0][1]
    assert [r[1] for r in results[1:]] == [None, None, None]
    assert [(e["rank"], e["name"]) for e in gathered] == [(e["rank"], e["name"]) for e in events]


# --------------------------------------------------------------------------- measures

def test_bubble_afab_is_exact():
    p, m = 4, 4
    events = afab(p, m)
    assert makespan(events) == 2 * (m + p - 1)
    assert all(busy_time(events, r) == 2 * m for r in range(p))
    assert bubble_ratio(events) == pytest.approx((p - 1) / m)  # 0.75
    assert bubble_fraction(events) == pytest.approx(3 / 7)
    p, m = 2, 8
    assert bubble_ratio(afab(p, m, f=0.5, b=1.0)) == pytest.approx((p - 1) / m)


def test_bubble_ignores_overlap_and_other_names():
    events = afab(4, 4)
    events.append(ev(0, "F", 0.5, 1.5))  # overlaps rank 0's F0 and F1: union unchanged
    events.append(ev(0, "W", 0.0, 1.0))  # W counts, but lies inside busy time
    events.append(ev(2, "allreduce", 13.0, 20.0, lane="comm"))  # not a compute name
    assert busy_time(events, 0) == 8 and busy_time(events, 0, names="F") == 4
    assert bubble_ratio(events) == pytest.approx(0.75)
    assert bubble_fraction(events) == pytest.approx(3 / 7)
    assert makespan(events) == 20 and makespan(events, names=("F", "B")) == 14
    events.append(ev(1, "B", 0.0, 1.0))  # really new busy time on rank 1: idle 6 -> 5
    assert bubble_ratio(events) == pytest.approx((6 + 5 + 6 + 6) / (8 + 9 + 8 + 8))


def test_overlap_time():
    events = [ev(0, "B", 0, 2, mb=0), ev(0, "B", 2, 4, mb=1), ev(0, "B", 5, 6, mb=2),
              ev(0, "allreduce", 1.0, 3.0, lane="comm"), ev(0, "allreduce", 2.5, 5.5, lane="comm"),
              ev(1, "allreduce", 0, 6, lane="comm")]
    # union of all-reduce on rank 0: [1, 5.5]; of B: [0, 4] and [5, 6] -> overlap 3 + 0.5
    assert overlap_time(events, 0, "allreduce", ("B", "W")) == pytest.approx(3.5)
    assert overlap_time(events, 0, ["B"], ["allreduce"]) == pytest.approx(3.5)
    assert overlap_time(events, 1, "allreduce", "B") == 0.0
    apart = [ev(2, "B", 0, 1), ev(2, "B", 5, 6), ev(2, "allreduce", 2, 3, lane="comm")]
    assert overlap_time(apart, 2, "B", "allreduce") == 0.0  # disjoint: nothing, not negative


# --------------------------------------------------------------------------- export

def test_chrome_trace(tmp_path):
    events = afab(2, 3) + [ev(1, "allreduce", 1.0, 3.25, lane="comm", bucket=object())]
    path = tmp_path / "trace.json"
    trace = to_chrome_trace(events, path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(trace))
    xs = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(events)
    for x, e in zip(xs, events, strict=True):
        assert x["dur"] == pytest.approx((e["end"] - e["start"]) * 1e6)
        assert x["ts"] == pytest.approx(e["start"] * 1e6)
        assert x["tid"] == e["rank"]
        assert x["pid"] == (0 if e["lane"] == "compute" else 1)
    assert xs[0]["name"] == "F0"
    names = {(m["pid"], m["tid"]): m["args"]["name"] for m in loaded["traceEvents"]
             if m["ph"] == "M" and m["name"] == "thread_name"}
    assert names == {(0, 0): "rank 0", (0, 1): "rank 1", (1, 1): "rank 1"}


def test_plot_gantt_one_patch_per_span():
    import matplotlib.pyplot as plt
    events = afab(4, 4) + [ev(3, "allreduce", 10, 13, lane="comm"), ev(0, "BW", 14, 15, mb=9),
                           ev(2, "custom", 0, 1)]
    ax = plot_gantt(events, title="AFAB", colors={"custom": "black"})
    assert len(ax.patches) == len(events)
    assert len(ax.get_yticks()) == 5  # 4 compute rows + rank 3's comm row
    assert ax.get_title() == "AFAB"
    texts = {t.get_text() for t in ax.texts}
    assert {"F0", "B3", "BW9"} <= texts
    plt.close(ax.figure)


def test_plot_gantt_names_drawn_in_one_colour_share_a_legend_entry():
    """Lesson 05 draws norms and residuals in one colour: one entry names both, not two alike."""
    import matplotlib.pyplot as plt
    events = [ev(0, "norm", 0, 1), ev(0, "attention", 1, 3), ev(0, "residual", 3, 4), ev(0, "MLP", 4, 6)]
    ax = plot_gantt(events, colors={"norm": "grey", "residual": "grey", "attention": "blue", "MLP": "blue"})
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["norm, residual", "attention, MLP"]
    ax = plot_gantt(events, colors={"norm": "grey", "residual": "red", "attention": "blue", "MLP": "green"})
    assert len(ax.get_legend().get_texts()) == 4
    plt.close("all")


def test_plot_gantt_stacks_overlapping_spans_and_shares_a_time_axis():
    """Two gathers in flight at once on one lane get a row each (ZeRO-3 prefetch); panels
    given one unit and the longest makespan share a time axis; nothing is shown."""
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    short = [ev(0, "F", 0.0, 0.4), ev(0, "all_gather", 0.1, 0.3, lane="comm"),
             ev(0, "all_gather", 0.2, 0.35, lane="comm"), ev(0, "all_gather", 0.36, 0.39, lane="comm")]
    long = [ev(0, "F", 0.0, 0.9), ev(0, "all_gather", 0.1, 0.2, lane="comm")]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 4), sharex=True, layout="constrained")
    shown = []
    fig.canvas.mpl_connect("draw_event", lambda event: shown.append(event))
    end = max(makespan(short), makespan(long))
    plot_gantt(short, ax=a, unit="ms", xmax=end, title="short step")
    plot_gantt(long, ax=b, unit="ms", xmax=end, title="long step")
    assert shown == [] and plt.fignum_exists(fig.number)        # drawn into, not shown
    assert len(a.get_yticks()) == 3                               # compute + two comm rows
    centres = sorted({p.get_y() + p.get_height() / 2 for p in a.patches if p.get_height() < 0.6})
    assert len(centres) == 2                                      # the overlapping gathers apart
    assert a.get_xlim() == b.get_xlim() == (0.0, 900.0)
    assert a.get_xlabel().startswith("time (ms)")
    assert problems(fig) == []
    with pytest.raises(ValueError, match="unit must be one of"):
        plot_gantt(short, unit="minutes")
    plt.close("all")


class _Work:
    def __init__(self, seconds):
        self.seconds, self.waited = seconds, False

    def wait(self):
        time.sleep(self.seconds)
        self.waited = True


def test_wait_records_an_async_operation_and_pads_it_to_its_cost():
    tl = Timeline(emulate={"kv": 0.05})
    t0 = time.perf_counter()
    work = _Work(0.0)
    ev = tl.wait("kv", work, t0, hop=1)
    assert work.waited and ev["emulated"] and ev["cost"] == 0.05 and ev["lane"] == "comm"
    assert 0.05 - 1e-9 <= ev["end"] - ev["start"] < 0.5 and ev["meta"] == {"hop": 1}
    slow = tl.wait("recv", _Work(0.03), time.perf_counter())      # not emulated: as it was
    assert not slow["emulated"] and 0.03 <= slow["end"] - slow["start"] < 0.5
    assert [e["name"] for e in tl.events] == ["kv", "recv"]


class _Flag:
    """A finished (or, with running=True, never-finished-until-waited) async operation."""

    def __init__(self, running=False, seconds=0.0):
        self.running, self.seconds = running, seconds

    def is_completed(self):
        return not self.running

    def wait(self):
        time.sleep(self.seconds)


def test_the_emulated_link_carries_one_operation_at_a_time():
    """Issue two ops at once on one lane and one on another: the lane's link runs them one
    after the other, the other lane's at once; each wait sleeps until its slot ends."""
    tl = Timeline(emulate={"ag": 0.04, "rs": 0.04})
    t0 = time.perf_counter()
    first, second = tl.issue("ag", "gather", unit=0), tl.issue("ag", "gather", unit=1)
    other = tl.issue("rs", "reduce")
    assert second["start"] == first["start"] + 0.04 and other["start"] < first["start"] + 0.01
    for e in (first, second, other):
        tl.complete(e, _Flag())
    waited = time.perf_counter() - t0
    assert waited >= 0.08 - 1e-9                        # the second op's slot ends at 2 × cost
    a, b, c = tl.events
    assert a["end"] == b["start"] and b["end"] == b["start"] + 0.04    # drawn in their slots
    assert c["end"] - c["start"] == pytest.approx(0.04) and c["lane"] == "reduce"
    third = tl.issue("ag", "gather")                   # the link is free again: starts now
    assert third["start"] >= b["end"]


def test_an_operation_that_outlasts_its_slot_is_drawn_to_its_end():
    tl = Timeline(emulate={"ag": 0.01})
    ev = tl.complete(tl.issue("ag", "gather"), _Flag(running=True, seconds=0.05))
    assert ev["emulated"] and ev["end"] - ev["start"] >= 0.05      # the real op, not the slot
    ev = tl.complete(tl.issue("ag", "gather"), _Flag(running=False, seconds=0.0))
    assert ev["end"] - ev["start"] == pytest.approx(0.01)


def test_costs_come_from_emulate_by_name_size_or_function():
    tl = Timeline(emulate={"attn": 0.2, "F": lambda length, context, **_: length + context / 10})
    assert tl.cost("attn") == 0.2 and tl.cost("attn", size=0.5) == 0.1 and tl.cost("W") is None
    assert tl.cost("F", length=3, context=20, label="x") == 5.0
    ev = tl.begin("attn", size=0.0, step=1)             # a step with no unmasked scores
    assert ev["cost"] == 0.0 and ev["meta"] == {"step": 1, "size": 0.0}
    assert tl.begin("F", cost=0.01, length=3, context=20)["cost"] == 0.01   # an explicit cost wins


def test_only_the_timeline_sleeps_for_an_emulated_cost():
    """One emulated link: the techniques name their ops; none sleeps or keeps a link itself."""
    import pathlib

    import picolib
    root = pathlib.Path(picolib.__file__).parent
    for name in ("data_parallel", "zero", "pipeline_parallel", "context_parallel", "terapipe"):
        text = (root / f"{name}.py").read_text()
        assert "sleep(" not in text and "emulate.get" not in text and "_link_free" not in text, name


def test_an_overrun_holds_the_link_until_it_ends():
    tl = Timeline(emulate={"ag": 0.01})
    late = tl.wait("ag", _Flag(running=True, seconds=0.05), time.perf_counter(), "gather")
    after = tl.wait("ag", _Flag(), time.perf_counter() - 0.05, "gather")   # issued meanwhile
    assert after["start"] == late["end"] and after["end"] == pytest.approx(late["end"] + 0.01)
