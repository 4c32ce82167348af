"""Lesson 08's plumbing: uniform slices against the slicer's dynamic program on ideal devices
(`slicing_gantt`; a 1024-token sequence, slice cost τ(l, c) = 1 + l/128 + context_cost·l·(c + l/2)/128²,
lesson 07's simulator), the emulated runs, the boundary traffic and the cost fit.
"""
from __future__ import annotations

from ..terapipe import TeraPipePlan, simulate_plan
from ..terapipe_slicer import dp_slices, uniform_slices
from ..timeline import makespan, plot_gantt

__all__ = ["slicing_gantt", "SEQ", "toy_cost", "counted_token_flops", "emulated_runs",
           "boundary_traffic", "plot_cost_fit", "plot_two_gantts"]

SEQ = 1024


def toy_cost(context_cost: float):
    """τ(l, c) for the knob: fixed overhead 1, 1 per 128 tokens, context_cost per 128² token pairs."""
    return lambda l, c: 1.0 + l / 128 + context_cost * l * (c + l / 2) / 128 ** 2


def slicing_gantt(n_slices: int = 4, p: int = 4, context_cost: float = 1.0, plot: bool = True):
    """Simulate `n_slices` uniform slices and the slicer's slices on p stages; draw both on
    one time axis and return {"uniform": τ_step, "slicer": τ_step, "slicer_slices": slices}
    (τ_step = makespan, ideal time units)."""
    n_slices, p = int(n_slices), int(p)
    if context_cost < 0:
        raise ValueError(f"context_cost={context_cost} < 0: attention to more context cannot be cheaper")
    cost = toy_cost(float(context_cost))
    plans = {"uniform": TeraPipePlan(uniform_slices(SEQ, n_slices), p, p),
             "slicer": TeraPipePlan(dp_slices(SEQ, p, cost, unit=64)[0], p, p)}
    events = {k: simulate_plan(plan, cost) for k, plan in plans.items()}
    out = {k: makespan(ev) for k, ev in events.items()}
    out["slicer_slices"] = plans["slicer"].slices
    if plot:
        titles = {}
        for k, ev in events.items():
            for e in ev:
                e["meta"]["label"] = str(e["meta"]["mb"])
            sl = list(plans[k].slices)
            shown = sl if len(sl) <= 10 else str(sl[:10])[:-1] + ", …]"
            name = f"{n_slices} uniform slices" if k == "uniform" else "the slicer's dynamic program"
            titles[k] = f"{name}: {shown} — τ_step = {out[k]:.1f} (simulated, p = {p})"
        plot_two_gantts(events, titles, unit="s", xlabel="ideal time units (simulated)",
                        height=0.8 * p + 2)
    return out


def plot_two_gantts(events: dict, titles: dict, unit: str, xlabel: str, height: float = 4.6):
    """Two Gantt charts, one above the other, on ONE time axis: the same unit and the same
    limit (the longer makespan), so the shorter step looks shorter. `events` and `titles`
    are keyed alike (two keys). Shows the figure; returns it."""
    import matplotlib.pyplot as plt

    longest = max(makespan(ev) for ev in events.values())
    fig, axes = plt.subplots(2, 1, figsize=(12, min(height, 9.0)), sharex=True, layout="constrained")
    for ax, (k, ev) in zip(axes, events.items()):
        plot_gantt(ev, ax=ax, unit=unit, xmax=longest, title=titles[k])
        ax.set_xlabel("")
    axes[-1].set_xlabel(xlabel)
    plt.show()
    return fig


def plot_cost_fit(rows, fit, lengths, seq: int):
    """Lesson 08 §4: the measured τ(l, c) (dots, one colour per slice length) and the fitted
    model (lines), in ms. Shows the figure; returns it."""
    import matplotlib.pyplot as plt
    import torch

    from ..style import rank_color

    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    for i, l in enumerate(lengths):
        pts = [(c, s) for ll, c, s in rows if ll == l]
        ax.plot([c for c, _ in pts], [s * 1e3 for _, s in pts], "o", color=rank_color(i), label=f"l = {l}")
        cs = torch.linspace(0, seq - l, 20)
        ax.plot(cs, [fit(l, float(c)) * 1e3 for c in cs], "-", color=rank_color(i), alpha=0.6)
    ax.set_xlabel("context c (tokens before the slice)")
    ax.set_ylabel("forward + backward (ms)")
    ax.set_title("τ(l, c) of one block on this machine: measured (dots), fitted (lines)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    plt.show()
    return fig


def emulated_runs(plans: dict, cfg, n_stages: int, seq: int, cost):
    """On every rank: each plan {name: slices} once to warm up, then once on a Timeline whose
    ops sleep up to `cost(l, c)` (cost emulation, lesson 08 §5). Returns {name: events}."""
    import torch.distributed as dist

    from ..model import TinyLlama, random_tokens
    from ..terapipe import run_terapipe, terapipe_stage
    from ..timeline import Timeline

    out = {}
    tokens, targets = random_tokens(1, seq, cfg.vocab_size, seed=2)
    for name, slices in plans.items():
        model = TinyLlama(cfg)
        plan = TeraPipePlan(slices, n_stages, cfg.n_layers)
        stage = terapipe_stage(model, plan, dist.get_rank())
        run_terapipe(plan, stage, tokens, targets)           # warm-up
        tl = Timeline(emulate={})
        dist.barrier()
        run_terapipe(plan, stage, tokens, targets, timeline=tl, cost=cost)
        out[name] = tl.events
    return out


def boundary_traffic(slicings: dict, cfg, n_stages: int, seq: int, batch: int = 1):
    """On every rank: one step per slicing {name: slices}, recording (picolib.comm's ledger)
    every point-to-point send — its bytes are the size of the tensor handed to the send,
    counted, one record per message — and (SavedActivations) the bytes autograd saved for
    backward on this stage, at their peak. Returns {name: {"sends": n, "sent": bytes,
    "fwd_sent": bytes of activations sent forward, "saved_peak": bytes}}."""
    import torch.distributed as dist

    from ..comm import Ledger
    from ..memory import SavedActivations
    from ..model import TinyLlama, random_tokens
    from ..terapipe import run_terapipe, terapipe_stage

    out = {}
    me = dist.get_rank()
    tokens, targets = random_tokens(batch, seq, cfg.vocab_size, seed=3)
    for name, slices in slicings.items():
        model = TinyLlama(cfg)
        plan = TeraPipePlan(slices, n_stages, cfg.n_layers)
        stage = terapipe_stage(model, plan, me)
        with Ledger() as led, SavedActivations(stage) as act:
            run_terapipe(plan, stage, tokens, targets)
        sends = led.select("send")
        out[name] = {"sends": len(sends), "sent": sum(r.sent_bytes for r in sends),
                     "fwd_sent": sum(r.sent_bytes for r in sends if r.meta.get("peer") == me + 1),
                     "saved_peak": act.peak}
    return out


def counted_token_flops(cfg, context: int, seed: int = 0) -> int:
    """FLOPs of one block's forward for one token after `context` cached tokens, as PyTorch's
    FlopCounterMode counts them (its matrix multiplies): an independent check of
    `picolib.terapipe_slicer.token_flops` (lesson 08 §4). The block is the model's first,
    its attention core swapped for TeraPipe's K/V-caching one, the cache filled first."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ..model import TinyLlama
    from ..terapipe import SliceKVCache, use_kv_cache

    if context < 0 or context + 1 > cfg.max_seq:
        raise ValueError(f"context={context}: need 0 ≤ context < max_seq = {cfg.max_seq}")
    torch.manual_seed(seed)
    stage = TinyLlama(cfg).part(range(1), embed=False, head=False)
    core = use_kv_cache(stage)[0]
    core.cache = SliceKVCache()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if context:
            stage(torch.randn(1, context, cfg.hidden, generator=g), positions=range(context))
        with FlopCounterMode(display=False) as counter:
            stage(torch.randn(1, 1, cfg.hidden, generator=g), positions=range(context, context + 1))
    return counter.get_total_flops()
