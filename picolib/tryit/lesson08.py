"""Try it, lesson 08: uniform slices against the DP slicer, on ideal devices.

    slicing_gantt(n_slices=4, p=4, context_cost=1.0)   # two Gantt charts; returns the times
    counted_token_flops(cfg, context)                  # the lesson's check of token_flops

A 1024-token sequence, p stages, a cost per slice t(l, c) = 1 + l/128 + w·l·(c + l/2)/128²
(ideal time units; w = `context_cost` weighs attention to the context against the rest).
The uniform cut has `n_slices` equal slices; the DP (`dp_slices`, slices in multiples of 64
tokens) picks its own. Both are simulated with lesson 07's simulator.
"""
from __future__ import annotations

from ..terapipe import TeraPipePlan, simulate_plan
from ..terapipe_slicer import dp_slices, uniform_slices
from ..timeline import makespan, plot_gantt

__all__ = ["slicing_gantt", "SEQ", "toy_cost", "counted_token_flops"]

SEQ = 1024


def toy_cost(context_cost: float):
    """t(l, c) for the knob: fixed overhead 1, 1 per 128 tokens, w per 128² token pairs."""
    return lambda l, c: 1.0 + l / 128 + context_cost * l * (c + l / 2) / 128 ** 2


def slicing_gantt(n_slices: int = 4, p: int = 4, context_cost: float = 1.0, plot: bool = True):
    """Simulate `n_slices` uniform slices and the DP's slices on p stages; draw both and
    return {"uniform": T, "dp": T, "dp_slices": slices} (T = makespan, ideal time)."""
    n_slices, p = int(n_slices), int(p)
    if context_cost < 0:
        raise ValueError(f"context_cost={context_cost} < 0: attention to more context cannot be cheaper")
    cost = toy_cost(float(context_cost))
    plans = {"uniform": TeraPipePlan(uniform_slices(SEQ, n_slices), p, p),
             "dp": TeraPipePlan(dp_slices(SEQ, p, cost, unit=64)[0], p, p)}
    events = {k: simulate_plan(plan, cost) for k, plan in plans.items()}
    out = {k: makespan(ev) for k, ev in events.items()}
    out["dp_slices"] = plans["dp"].slices
    if plot:
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(2, 1, figsize=(12, 0.9 * p + 2), sharex=True, layout="constrained")
        longest = max(makespan(ev) for ev in events.values())
        for ax, (k, ev) in zip(axes, events.items()):
            for e in ev:
                e["meta"]["label"] = str(e["meta"]["mb"])
            sl = list(plans[k].slices)
            plot_gantt(ev, ax=ax, unit="s", xmax=longest, title=f"{k}: slices {sl if len(sl) <= 10 else str(sl[:10])[:-1] + ', …]'}"
                                         f" — T = {out[k]:.1f} (simulated)")
            ax.set_xlabel("ideal time units (simulated)")
            ax.set_xlim(0, max(out["uniform"], out["dp"]))
        plt.show()
    return out


def counted_token_flops(cfg, context: int, seed: int = 0) -> int:
    """FLOPs of one block's forward for one token after `context` cached tokens, as PyTorch's
    FlopCounterMode counts them (its matrix multiplies): an independent check of
    `picolib.terapipe_slicer.token_flops` (lesson 08 §4). The block is the model's first,
    its attention core swapped for TeraPipe's K/V-caching one, the cache filled first."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ..model import TinyLlama
    from ..terapipe import KVCache, use_kv_cache

    if context < 0 or context + 1 > cfg.max_seq:
        raise ValueError(f"context={context}: need 0 ≤ context < max_seq = {cfg.max_seq}")
    torch.manual_seed(seed)
    stage = TinyLlama(cfg).part(range(1), embed=False, head=False)
    core = use_kv_cache(stage)[0]
    core.cache = KVCache()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if context:
            stage(torch.randn(1, context, cfg.hidden, generator=g), positions=range(context))
        with FlopCounterMode(display=False) as counter:
            stage(torch.randn(1, 1, cfg.hidden, generator=g), positions=range(context, context + 1))
    return counter.get_total_flops()
