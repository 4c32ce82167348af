"""Per-rank timelines: record spans, merge the ranks, draw a Gantt chart, measure bubbles.

    tl = Timeline(emulate={"F": 0.02, "B": 0.04})      # one recorder per rank
    with tl.span("F", mb=3):                            # an event: rank, name, lane, times, meta
        y = stage(x)
    return tl.events                                    # plain dicts, through launch.run
    ...
    events = merge(run(worker, 4))                      # one list, t = 0 at the first start
    plot_gantt(events); bubble_fraction(events); to_chrome_trace(events, "trace.json")

Lessons 02 (all-reduce hidden behind backward), 03 (ZeRO prefetch) and 07 (pipeline
schedules) draw their timelines with it. Times come from `time.perf_counter()`, a
monotonic clock that forked ranks on one machine share, so spans of different ranks can
be set side by side.

Cost emulation. On a laptop 8 ranks share 2 cores, so the wall clock of a span measures
the OS scheduler more than the schedule. With `emulate={"F": 0.02}` (or `span(cost=...)`)
a span runs its body and then sleeps until `start + cost`: its duration is
max(cost, real time), and sleeping ranks leave the cores to the others. Pick costs well
above the real compute time and the figure shows the schedule as it would be on
dedicated devices; each event records `emulated` and `cost` (so a lesson can check that
no body overran its cost), and a lesson says which mode a figure used. On a GPU, spans time the host: synchronise inside the span to time the kernels.

The emulated link, the one mechanism every technique uses. Each lane is a resource: a
span occupies the rank's own lane while it runs; an asynchronous operation (`issue`, then
`complete` or `wait`) occupies its lane's link for its cost, from its issue or from the end
of the previous operation on that link, whichever is later, and waiting for it sleeps until
the link is done with it (and the real operation is done too). The operation is drawn in
its slot on the link, longer only when the real one was still running at the slot's end
(a late peer; the link is then busy until it ends).
A technique only names its ops (and their lane and size); the costs come from `emulate`:
a number is seconds per op (times the op's `size`, default 1), a function takes the op's
meta as keyword arguments and returns seconds.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

import torch.distributed as dist

from .style import COLLECTIVES, OPS

__all__ = ["Timeline", "merge", "gather", "plot_gantt", "pick_unit", "to_chrome_trace",
           "busy_time", "makespan", "bubble_fraction", "bubble_ratio", "overlap_time", "COLORS"]

COMPUTE = ("F", "B", "W", "BW")

# Fixed colours from the course's visual language (picolib.style), so a name looks the same
# in every lesson. Comm names are matched without case, "_" or "-" ("all_reduce" == "AllReduce").
COLORS = {**{k: v for k, v in OPS.items()},
          **{k.replace("_", ""): v for k, v in COLLECTIVES.items()}}
_SPARE = ["#BBBBBB", "#DDAA33", "#BB5566", "#004488", "#999933", "#882255"]
UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


class Timeline:
    """Records the spans of one rank. Pass it explicitly; `events` are picklable dicts."""

    def __init__(self, rank: int | None = None, emulate: dict[str, float] | None = None):
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank, self.emulate, self._events = rank, dict(emulate or {}), []
        self._link_free = {}   # the emulated link of each lane: when it is free

    def cost(self, name: str, size: float = 1, **meta) -> float | None:
        """The emulated cost of op `name` in seconds, None when it is not emulated:
        `emulate[name]` × size for a number, `emulate[name](**meta)` for a function."""
        c = self.emulate.get(name)
        if c is None:
            return None
        return float(c(**meta)) if callable(c) else c * size

    def _event(self, name, lane, start, cost, size, meta):
        if cost is None:
            cost = self.cost(name, size, **meta)
        if size != 1:
            meta = dict(meta, size=size)
        return {"rank": self.rank, "name": name, "lane": lane, "start": float(start),
                "end": None, "emulated": cost is not None, "cost": cost, "meta": dict(meta)}

    def begin(self, name: str, lane: str = "compute", cost: float | None = None,
              size: float = 1, start: float | None = None, **meta) -> dict:
        """Open a span now (or at `start`): this rank works on its lane. Close it with `end`."""
        return self._event(name, lane, time.perf_counter() if start is None else start,
                           cost, size, meta)

    def end(self, ev: dict) -> dict:
        """Close a span from `begin`: with a cost, sleep until start + cost; record it."""
        if ev["cost"] is not None:
            _sleep_until(ev["start"] + ev["cost"])
        ev["end"] = time.perf_counter()
        self._events.append(ev)
        return ev

    @contextmanager
    def span(self, name: str, lane: str = "compute", cost: float | None = None, **meta):
        """Time the body as event `name`. With a cost (argument, else `self.cost(name)`; a
        `size=` scales it) the span sleeps until start + cost. Yields the event dict; the
        body may add to its meta."""
        ev = self.begin(name, lane, cost, **meta)
        try:
            yield ev
        except BaseException:          # recorded as far as it got, without the sleep
            ev["end"] = time.perf_counter()
            self._events.append(ev)
            raise
        self.end(ev)

    def add(self, name: str, start: float, end: float, lane: str = "compute", **meta):
        """Record an interval measured elsewhere (e.g. an async all-reduce: issue → wait)."""
        if end < start:
            raise ValueError(f"span {name!r} ends ({end}) before it starts ({start})")
        ev = {"rank": self.rank, "name": name, "lane": lane, "start": float(start),
              "end": float(end), "emulated": False, "cost": None, "meta": dict(meta)}
        self._events.append(ev)
        return ev

    def issue(self, name: str, lane: str = "comm", cost: float | None = None, size: float = 1,
              start: float | None = None, **meta) -> dict:
        """An asynchronous operation issued now (or at `start`) on `lane`'s link. Emulated,
        it occupies the link for its cost from its issue or the end of the previous one,
        whichever is later. Returns the pending event: pass it to `complete`."""
        issued = time.perf_counter() if start is None else start
        ev = self._event(name, lane, issued, cost, size, meta)
        if ev["cost"] is not None:
            ev["start"] = max(issued, self._link_free.get(lane, 0.0))
            self._link_free[lane] = ev["start"] + ev["cost"]
        return ev

    def complete(self, ev: dict, work=None, done: float | None = None) -> dict:
        """Wait for an operation from `issue` (`work.wait()`) and record it. Not emulated: it
        ends when the wait returns (or at `done`, when the caller saw it finish earlier).
        Emulated: the wait sleeps until the link is done with it; it is drawn in its slot,
        ending later only if the real operation was still running at the slot's end (a late
        peer): then it holds the link until it ends."""
        running = work is not None and not getattr(work, "is_completed", lambda: False)()
        if work is not None:
            work.wait()
        now = time.perf_counter()
        if ev["cost"] is None:
            ev["end"] = now if done is None else done
        else:
            slot_end = ev["start"] + ev["cost"]
            if running and now > slot_end:   # the real operation was still running at its end:
                ev["end"] = now                # drawn to its end, and it held the link till then
                self._link_free[ev["lane"]] = max(self._link_free.get(ev["lane"], 0.0), now)
            else:
                _sleep_until(slot_end)
                ev["end"] = slot_end
        self._events.append(ev)
        return ev

    def wait(self, name: str, work, start: float, lane: str = "comm", cost: float | None = None,
             done: float | None = None, **meta):
        """`work.wait()` for an async operation issued at `start`: `issue` and `complete` in
        one call, so a lane's link takes its operations in the order they are waited for
        (DDP's buckets, ZeRO's collectives, lesson 06's K/V hops: their issue order)."""
        return self.complete(self.issue(name, lane, cost, start=start, **meta), work, done)

    @property
    def events(self) -> list[dict]:
        return [dict(e, meta=dict(e["meta"])) for e in self._events]


def _sleep_until(t: float):
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)


def merge(per_rank_events) -> list[dict]:
    """One list sorted by (start, rank), shifted so the earliest start is 0.
    Takes the list of lists that `launch.run` returns (or one flat list)."""
    flat = [e for item in per_rank_events
            for e in ([item] if isinstance(item, dict) else item)]
    if not flat:
        return []
    t0 = min(e["start"] for e in flat)
    out = [dict(e, start=e["start"] - t0, end=e["end"] - t0, meta=dict(e.get("meta", {})))
           for e in flat]
    return sorted(out, key=lambda e: (e["start"], e["rank"], e["end"]))


def gather(tl: Timeline, group=None, dst: int = 0) -> list[dict] | None:
    """For torchrun scripts: every rank of `group` sends its events to global rank `dst`,
    which gets the merged list; the others get None."""
    mine = dist.get_rank() == dst
    bucket = [None] * dist.get_world_size(group) if mine else None
    dist.gather_object(tl.events, bucket, dst=dst, group=group)
    return merge(bucket) if mine else None


# --------------------------------------------------------------------------- measures

def _names(names):
    return None if names is None else ({names} if isinstance(names, str) else set(names))


def _pick(events, rank=None, names=None):
    names = _names(names)
    return [e for e in events if (rank is None or e["rank"] == rank)
            and (names is None or e["name"] in names)]


def _union(events) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted((ev["start"], ev["end"]) for ev in events):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def busy_time(events, rank: int, names=None) -> float:
    """Seconds rank `rank` spends inside at least one span named in `names` (None: any):
    the length of the union of those intervals, so overlapping spans count once."""
    return sum(e - s for s, e in _union(_pick(events, rank, names)))


def makespan(events, names=None) -> float:
    """Latest end minus earliest start over all ranks' spans named in `names` (None: any)."""
    evs = _pick(events, None, names)
    return max(e["end"] for e in evs) - min(e["start"] for e in evs) if evs else 0.0


def _idle_busy(events, names):
    total = makespan(events, names)
    ranks = sorted({e["rank"] for e in events})
    busy = [busy_time(events, r, names) for r in ranks]
    return total, [total - b for b in busy], busy


def bubble_fraction(events, names=COMPUTE) -> float:
    """Mean over ranks of idle_r / T: the fraction of the run each device sits idle.
    T = makespan(events, names); busy_r = busy_time(events, r, names); idle_r = T - busy_r.
    Ranks are all those that appear in `events`. AFAB, p stages, m equal micro-batches:
    (p-1)/(m+p-1)."""
    total, idle, _ = _idle_busy(events, names)
    return sum(idle) / (len(idle) * total) if total > 0 else 0.0


def bubble_ratio(events, names=COMPUTE) -> float:
    """Total idle / total busy over ranks, sum_r idle_r / sum_r busy_r (definitions as in
    `bubble_fraction`): the bubble as a fraction of the ideal, bubble-free time. AFAB,
    p stages, m equal micro-batches: exactly (p-1)/m."""
    _, idle, busy = _idle_busy(events, names)
    return sum(idle) / sum(busy) if sum(busy) > 0 else 0.0


def overlap_time(events, rank: int, a_names, b_names) -> float:
    """Seconds on rank `rank` during which some span named in `a_names` and some span
    named in `b_names` both run: |union(a) ∩ union(b)| (e.g. all-reduce hidden by backward)."""
    a, b = _union(_pick(events, rank, a_names)), _union(_pick(events, rank, b_names))
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# --------------------------------------------------------------------------- export

def _lanes(events) -> list[str]:
    lanes = list(dict.fromkeys(e["lane"] for e in events))
    return sorted(lanes, key=lambda lane: lane != "compute")  # compute first, others in order


def to_chrome_trace(events, path=None) -> dict:
    """Chrome Trace Event format (open in ui.perfetto.dev or chrome://tracing): one "X"
    event per span, ts/dur in µs from the earliest start. Lanes are processes (pid 0 =
    "compute", 1 = the next lane, ...), ranks are threads (tid = rank, named "rank r"),
    so each lane reads as a Gantt chart of all ranks. Writes JSON to `path` if given."""
    t0 = min((e["start"] for e in events), default=0.0)
    lanes = _lanes(events)
    out = []
    for pid, lane in enumerate(lanes):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": lane}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}})
        for r in sorted({e["rank"] for e in events if e["lane"] == lane}):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r,
                        "args": {"name": f"rank {r}"}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r,
                        "args": {"sort_index": r}})
    for e in events:
        out.append({"ph": "X", "name": _label(e), "cat": e["name"], "pid": lanes.index(e["lane"]),
                    "tid": e["rank"], "ts": (e["start"] - t0) * 1e6,
                    "dur": (e["end"] - e["start"]) * 1e6,
                    "args": {**{k: _jsonable(v) for k, v in e["meta"].items()},
                             "emulated": e["emulated"]}})
    trace = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def _jsonable(v):
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


# --------------------------------------------------------------------------- plot

def _label(e) -> str:
    meta, name = e["meta"], e["name"]
    if "label" in meta:
        return str(meta["label"])
    if "mb" in meta:
        return f"{name}{meta['mb']}" if len(name) <= 2 else f"{name} {meta['mb']}"
    return name


def _key(name: str) -> str:
    return name if name in COLORS else name.lower().replace("_", "").replace("-", "")


def _sub_lanes(spans) -> list[int]:
    """For spans of one row sorted by start: the sub-lane of each, the lowest one free, so
    spans that overlap in time (an async collective beside the next) are stacked, not hidden."""
    ends, where = [], []
    for e in spans:
        free = next((i for i, end in enumerate(ends) if end <= e["start"] + 1e-12), None)
        if free is None:
            ends.append(e["end"])
            free = len(ends) - 1
        else:
            ends[free] = e["end"]
        where.append(free)
    return where


def pick_unit(seconds: float) -> str:
    """The time unit a Gantt axis of this length reads best in: "s", "ms" or "us"."""
    return "s" if seconds >= 2 else "ms" if seconds >= 2e-3 else "us"


def plot_gantt(events, ax=None, title=None, colors=None, unit=None, xmax=None):
    """Gantt chart: one row per rank (rank 0 on top), a sub-row per lane (compute, comm),
    one box per span labelled like "F3" (name + meta `mb`, or meta `label`), coloured by
    name (`COLORS`, overridden by `colors`; names given one colour share a legend entry);
    virtual-stage `chunk` > 0 is drawn lighter.
    Spans of one row that overlap in time are stacked in sub-rows. `unit` ("s", "ms", "us")
    and `xmax` (seconds) let panels share one time axis: give each panel the same unit and
    the longest makespan. Draws into `ax` when given and never shows the figure. Returns
    the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle

    lanes, ranks = _lanes(events), sorted({e["rank"] for e in events})
    rows, slot = [], {}
    for r in ranks:
        for lane in lanes:
            spans = sorted((e for e in events if e["rank"] == r and e["lane"] == lane),
                           key=lambda e: e["start"])
            for e, sub in zip(spans, _sub_lanes(spans)):
                slot[id(e)] = (r, lane, sub)
            for sub in sorted({slot[id(e)][2] for e in spans}):
                rows.append((r, lane, sub))
    heights = [1.0 if lane == "compute" else 0.6 for _, lane, _ in rows]  # comm rows thinner
    tops = [sum(heights[:i]) for i in range(len(rows))]
    centre = {row: top + h / 2 for row, top, h in zip(rows, tops, heights)}
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.45 * sum(heights) + 1.4), layout="constrained")
    total = makespan(events) or 1.0
    limit = max(total, xmax or 0.0)
    unit = unit or pick_unit(limit)
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {sorted(UNITS)}, not {unit!r}")
    scale = UNITS[unit]
    t0 = min((e["start"] for e in events), default=0.0)
    palette, spare = {**COLORS, **{_key(k): v for k, v in (colors or {}).items()}}, iter(_SPARE * 9)
    for n in sorted({_key(e["name"]) for e in events} - set(palette)):
        palette[n] = next(spare)
    px_per_unit = ax.get_window_extent().width / (limit * scale)
    for e in events:
        y = centre[slot[id(e)]]
        x, w = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        rgb = to_rgb(palette[_key(e["name"])])
        lift = min(0.5, 0.3 * e["meta"].get("chunk", 0))
        rgb = tuple(c + (1 - c) * lift for c in rgb)
        height = 0.8 if e["lane"] == "compute" else 0.45
        ax.add_patch(Rectangle((x, y - height / 2), w, height, facecolor=rgb,
                               edgecolor="white", linewidth=0.8))
        text = _label(e)
        if w * px_per_unit > 8 * len(text) + 4:
            dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.6
            ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=9,
                    color="white" if dark else "black", clip_on=True)
    ax.set_xlim(0, limit * scale)
    ax.set_ylim(sum(heights), 0)
    ax.set_yticks([centre[row] for row in rows])
    ax.set_yticklabels([("" if sub else f"rank {r}" if lane == "compute" else f"rank {r} · {lane}")
                        for r, lane, sub in rows])
    for i in range(1, len(rows)):  # a thin rule between ranks
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(tops[i], color="#dddddd", linewidth=0.8)
    emulated = any(e["emulated"] for e in events)
    ax.set_xlabel(f"time ({'µs' if unit == 'us' else unit})"
                  + (" — emulated costs" if emulated else " — wall clock"))
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.8)
    ax.set_axisbelow(True)
    by_colour: dict[tuple, list[str]] = {}   # names drawn in one colour share one legend entry
    for n in dict.fromkeys(e["name"] for e in events):
        by_colour.setdefault(to_rgb(palette[_key(n)]), []).append(n.replace("_", "-"))
    ax.legend(handles=[Patch(color=c, label=", ".join(ns)) for c, ns in by_colour.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title)
    return ax
