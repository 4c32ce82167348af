"""Try it, lessons 07 and 07b: draw any pipeline schedule on ideal devices and read off its bubble.

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

__all__ = ["schedule_gantt", "CASES", "T_OP", "op_costs", "param_bytes", "every_schedule",
           "idle_gaps", "idle_per_rank", "schedule_figure", "name_ops", "stage_map_figure"]

_CHUNKS = {"interleaved": 2, "dualpipev": 2}    # stages per rank when v is not given


def schedule_gantt(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int | None = None,
                   plot: bool = True):
    """Simulate `schedule` for p ranks and m micro-batches (v chunks per rank for
    "interleaved", default 2), draw its Gantt chart and return the ideal bubble
    (Σ idle / Σ busy over the ranks on ideal devices, an F&B pair timed as one chunk: the
    bubble DeepSeek's formula counts)."""
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
        plot_gantt(events, ax=ax, title=f"{schedule}, p={p}, m={m}: ideal bubble {bubble:.3f} "
                                        f"of the busy time (an F&B pair timed as one chunk)")
        name_ops(ax, events)
        ax.set_xlabel("ideal time (F = B = W = 1 per stage of a p-stage cut)")
        plt.show()
    return bubble


# ----------------------------------------------------------------- the lessons' own helpers
# (emulated costs and figures of lessons 07 and 07b; 07b's run on real ranks, kept here so its cells
# stay short — lesson 07 runs its schedules in its own cells)

CASES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("dualpipev", 1), ("dualpipe", 1)]
T_OP = 0.04                      # emulated seconds of F, B or W for a stage of 2 blocks


def op_costs(sched, t: float = T_OP) -> dict:
    """Emulated op costs: F = B = W = t for a stage of a p-stage cut, half that for the
    half-size stages of `interleaved` (v = 2) and `dualpipev`; BW = B + W."""
    v = 2 if sched.name in ("interleaved", "dualpipev") else 1
    return {"F": t / v, "B": t / v, "W": t / v, "BW": 2 * t / v}


def param_bytes(modules) -> int:
    """Bytes of parameter storage held by the modules (each tensor once)."""
    return sum({p.data_ptr(): p.untyped_storage().nbytes()
                for mod in modules for p in mod.parameters()}.values())


def every_schedule(cfg, p: int, m: int, mb: int, seq: int, cases=CASES):
    """Lesson 07b. On each of p ranks (run with picolib.launch.run): every schedule of `cases` on a fresh
    TinyLlama(cfg), warmed up once, then timed with emulated costs. Returns {name: (events,
    loss or None, {param name: grad}, parameter bytes held)}. DualPipe's two copies of a layer
    (ranks r and p−1−r) are summed by the one gradient path: DDP over the mesh's pair group."""
    import torch.distributed as dist

    from ..data_parallel import DDP
    from ..mesh import Mesh
    from ..model import TinyLlama, random_tokens
    from ..pipeline_parallel import pair_gradient_groups, run_schedule, schedule_stages, stage_grads
    from ..timeline import Timeline

    out, me = {}, dist.get_rank()
    mesh = Mesh(pp=p) if any(name == "dualpipe" for name, _ in cases) else None
    tokens, targets = random_tokens(mb * m, seq, cfg.vocab_size, seed=1)
    for name, v in cases:
        model = TinyLlama(cfg)
        sched = make_schedule(name, p, m, v)
        mine = {s: st for s, st in schedule_stages(model, sched).items() if s in sched.stages_of(me)}
        wrappers = {}
        if name == "dualpipe":   # the pair holds each stage twice: DDP sums the copies' gradients
            groups = pair_gradient_groups(mine, mesh)
            wrappers = {s: DDP(st, mesh.group("dp"), groups=groups) for s, st in mine.items()}
        args = (list(tokens.chunk(m)), list(targets.chunk(m)))
        run_schedule(sched, mine, *args, data_parallel=wrappers)   # warm-up (the first backward is slow)
        for st in mine.values():
            st.zero_grad(set_to_none=True)
        tl = Timeline(emulate=op_costs(sched))
        dist.barrier()
        res = run_schedule(sched, mine, *args, timeline=tl, data_parallel=wrappers)
        grads = {k: g for st in mine.values() for k, g in stage_grads(st, model).items()}
        out[name] = (tl.events, res["loss"], grads, param_bytes(mine.values()))
    return out


def idle_gaps(events, rank: int) -> list[tuple[float, float]]:
    """The idle intervals of `rank` between time 0 and the makespan (the white of its row)."""
    end, t, gaps = max(e["end"] for e in events), min(e["start"] for e in events), []
    for e in sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start"]):
        if e["start"] > t + 1e-12:
            gaps.append((t, e["start"]))
        t = max(t, e["end"])
    if end > t + 1e-12:
        gaps.append((t, end))
    return gaps


def idle_per_rank(events) -> list[float]:
    """Makespan minus each rank's busy time: the length of the white in each row."""
    return [sum(b - a for a, b in idle_gaps(events, r)) for r in sorted({e["rank"] for e in events})]


OP_NAMES = {"F": "F: forward", "BW": "BW: whole backward", "B": "B: input-gradient half",
            "W": "W: weight-gradient half"}


def name_ops(panel, events):
    """Spell out the ops in the legend plot_gantt drew on `panel` (BW a whole backward, B and W
    its two halves) and, when a rank holds two chunks, add the lighter box of chunk 1. It
    relabels a drawn panel; it draws nothing of its own."""
    from matplotlib.patches import Patch

    legend = panel.get_legend()
    handles, texts = legend.legend_handles, [t.get_text() for t in legend.get_texts()]
    labels = [OP_NAMES.get(t, t) for t in texts]
    if any(e["meta"].get("chunk", 0) for e in events):
        handles = [*handles, Patch(facecolor="#dddddd", edgecolor="#999999")]
        labels.append("lighter: the rank's chunk 1")
    panel.legend(handles=handles, labels=labels, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                 frameon=False, fontsize=9)


def schedule_figure(panels: dict, xmax: float, unit: str = "ms", xlabel: str | None = None):
    """One figure, one panel per (title → events), stacked on a shared time axis up to
    `xmax` seconds; each panel's title carries its bubble (Σ idle / Σ busy over the ranks).
    Box labels are micro-batch numbers, colours the ops (picolib.style.OPS); a rank's second
    chunk is drawn lighter. Returns the figure (the caller shows it)."""
    import matplotlib.pyplot as plt

    n_ranks = max(len({e["rank"] for e in evs}) for evs in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, len(panels) * (0.42 * n_ranks + 1.0) + 0.4),
                             sharex=True, layout="constrained", squeeze=False)
    for ax, (title, evs) in zip(axes[:, 0], panels.items()):
        for e in evs:
            e["meta"]["label"] = str(e["meta"]["mb"])    # micro-batch numbers fit in small boxes
        plot_gantt(evs, ax=ax, unit=unit, xmax=xmax,
                   title=f"{title} — bubble {bubble_ratio(evs):.3f} of the busy time")
        name_ops(ax, evs)
        ax.set_xlabel("")
    axes[-1, 0].set_xlabel(xlabel or f"time ({unit})")
    return fig


def stage_map_figure(p: int):
    """Lesson 07b §2: which rank holds which stage in DualPipeV and DualPipe (p ranks, m = 2p),
    one panel each, a line per pipeline. Returns the figure (the caller shows it)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), layout="constrained")
    for ax, name in zip(axes, ("dualpipev", "dualpipe")):
        s = make_schedule(name, p, 2 * p)
        for k, (stage_range, mbs) in enumerate(s.pipes):
            xs = list(stage_range)
            way = "" if len(s.pipes) == 1 else ("down: " if k == 0 else "up: ")
            ax.plot(xs, [s.stage_ranks[x] for x in xs], "o-", color=f"C{k}",
                    label=f"{way}micro-batches {mbs.start}–{mbs.stop - 1}")
            for x in xs:
                ax.annotate(str(x), (x, s.stage_ranks[x]), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=9)
        ax.set_ylim(p - 0.5, -0.7)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in range(p)])
        ax.set_xlabel("stage (data-flow order)")
        ax.set_title(f"{name}: stage → rank")
        ax.legend(fontsize=9, loc="upper center")
    return fig
