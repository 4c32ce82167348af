"""Try it, lesson 07: draw any pipeline schedule on ideal devices and read off its bubble.

    schedule_gantt("zb_h1", p=4, m=8)      # Gantt chart; returns bubble time / busy time

Costs are those of one stage of a p-stage cut: F = B = W = 1 (BW = 2); schedules with v
stages per rank (interleaved, DualPipeV) run chunks of 1/v of that. Numbers a schedule
cannot take (interleaved with m not a multiple of p, DualPipe with an odd p, m < 2p, ...)
print the reason and return None; an unknown name raises ValueError.
"""
from __future__ import annotations

from ..pipeline_schedules import SCHEDULES, make_schedule
from ..pipeline_simulator import simulate
from ..timeline import bubble_ratio, plot_gantt

__all__ = ["schedule_gantt"]

_CHUNKS = {"interleaved": 2, "dualpipev": 2}    # stages per rank when v is not given


def schedule_gantt(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int | None = None,
                   plot: bool = True):
    """Simulate `schedule` for p ranks and m micro-batches (v chunks per rank for
    "interleaved", default 2), draw its Gantt chart and return the bubble fraction
    (Σ idle / Σ busy over the ranks, ideal time)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    v = v if v is not None else _CHUNKS.get(schedule, 1)
    try:
        sched = make_schedule(schedule, int(p), int(m), int(v))
    except ValueError as e:
        print(f"{schedule} cannot run p={p}, m={m}: {e}")
        return None
    chunks = sched.n_stages // sched.n_ranks if schedule != "dualpipe" else 1
    cost = {k: 1.0 / chunks for k in ("F", "B", "W")}
    events = simulate(sched, cost)
    bubble = bubble_ratio(events)
    if plot:
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(12, 0.45 * p + 1.2), layout="constrained")
        plot_gantt(events, ax=ax, title=f"{schedule}, p={p}, m={m}: bubble {bubble:.3f} "
                                        f"of the busy time (simulated)")
        ax.set_xlabel("ideal time (F = B = W = 1 per stage of a p-stage cut)")
        plt.show()
    return bubble
