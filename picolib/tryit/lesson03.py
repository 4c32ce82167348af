"""Lesson 03's "try it": bytes per rank of plain DP and a ZeRO stage, for N ranks.

    from picolib.tryit import knobs
    from picolib.tryit.lesson03 import zero_bars
    knobs(zero_bars, stage=[3, 1, 2], ranks=(1, 64, 1), model=["7.5B (ZeRO paper)", "tiny Llama"])

`per_rank` is the arithmetic (picolib.zero.zero_memory_bytes, padding included);
tests/lessons/test_tryit_03.py checks it against the bytes real ZeRO ranks hold
(`ZeRO(...).memory()`). `plot_groups` draws the lesson's grouped, stacked bars;
`model_states` gives a real model's bytes per stage from the planner.

The lesson's rank functions live here too, so that its cells show what is measured and the
asserts that settle it, not the bookkeeping: `one_step` (one training step of DP and each
ZeRO stage: bytes held, calls made, saved activations), `replay` (a list of recorded calls
run again on picolib's own rings, which count the bytes they send), `accumulate` (one ZeRO
step over m micro-batches), `zero3_timeline`, `gathers_under_compute` and `hidden_fraction` (the
prefetch figure). The lesson's §2 runs ZeRO's core itself; the backward order of §6's timelines
and FSDP2 beside picolib (§7) are checked in tests/lessons/test_tryit_03.py.
"""
from __future__ import annotations

from ..style import MEMORY
from ..zero import optimizer_state_factor, zero_memory_bytes

__all__ = ["PRECISIONS", "MODELS", "per_rank", "plot_groups", "zero_bars", "CONFIGS",
           "one_step", "replay", "accumulate", "zero3_timeline", "gathers_under_compute",
           "hidden_fraction", "model_states"]

# bytes per parameter (params, grads) and optimizer bytes B_opt, Adam
PRECISIONS = {"bf16 + fp32 master": (2, 12), "fp32": (4, optimizer_state_factor("adam"))}
# the ZeRO paper's 7.5B example, and the lesson's tiny Llama (its ZeRO units)
MODELS = {"7.5B (ZeRO paper)": 7_500_000_000, "tiny Llama": [2214, 2142, 2142]}
COLORS = {kind: MEMORY[kind] for kind in ("params", "grads", "optimizer")}   # picolib.style


def per_rank(stage: int, n: int, numels, precision: str = "bf16 + fp32 master") -> dict:
    """{"DP": {...}, "ZeRO-<stage>": {...}}: params, grads, optimizer bytes on one of n
    ranks; `numels` one int (Ψ) or the units' sizes (each padded to a multiple of n)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    p, b_opt = PRECISIONS[precision]
    return {"DP": zero_memory_bytes(0, numels, n, b_opt, param_bytes=p),
            f"ZeRO-{stage}": zero_memory_bytes(stage, numels, n, b_opt, param_bytes=p)}


def _unit(nbytes: float):
    """Memory in binary units (picolib.style): GiB, MiB, KiB."""
    for scale, name in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if nbytes >= scale:
            return scale, name
    return 1, "B"


def plot_groups(groups: dict, ax=None, title: str = "bytes per rank"):
    """Stacked bars (params, grads, optimizer) in groups with a gap between groups:
    `groups` is {group label: {bar label: {"params", "grads", "optimizer"}}}. Each bar is
    labelled under itself, each group under its bars; the legend has the three parts."""
    import matplotlib.pyplot as plt
    nbars = sum(len(bars) for bars in groups.values())
    ax = ax or plt.subplots(figsize=(1.5 + 0.55 * nbars + 0.4 * len(groups), 3.8))[1]
    scale, unit = _unit(max(sum(m.values()) for bars in groups.values() for m in bars.values()))
    x, ticks, labels, centers = 0.0, [], [], []
    for group, bars in groups.items():
        first = x
        for label, mem in bars.items():
            bottom = 0.0
            for kind, color in COLORS.items():
                ax.bar(x, mem[kind] / scale, bottom=bottom, color=color, width=0.8,
                       label=kind if not ticks else None)
                bottom += mem[kind] / scale
            ticks.append(x)
            labels.append(label)
            x += 1
        centers.append(((first + x - 1) / 2, group))
        x += 0.8                                     # the gap between groups
    ax.set_xticks(ticks, labels, fontsize=9)
    for cx, group in centers:
        ax.annotate(group, (cx, 0), xycoords=("data", "axes fraction"), xytext=(0, -24),
                    textcoords="offset points", ha="center", va="top", fontsize=10,
                    fontweight="bold", annotation_clip=False)
    ax.set(ylabel=f"{unit} per rank", title=title)
    ax.legend(fontsize=9, loc="upper right")
    return ax


def zero_bars(stage: int = 3, ranks: int = 8, model: str = "7.5B (ZeRO paper)",
              precision: str = "bf16 + fp32 master", ax=None) -> dict:
    """Draw DP beside ZeRO-`stage` on N = `ranks` ranks for `model`; return `per_rank(...)`."""
    import matplotlib.pyplot as plt
    mem = per_rank(stage, ranks, MODELS[model], precision)
    created = ax is None
    ax = plot_groups({f"N = {ranks}": mem},
                     ax=ax or plt.subplots(figsize=(4.5, 3.8), layout="constrained")[1],
                     title=f"{model}\n{precision}: bytes per rank")
    if created:
        plt.show()
    dp, z = (sum(m.values()) for m in mem.values())
    print(f"DP {dp:,} B, ZeRO-{stage} {z:,} B per rank: {dp / z:.2f}× less")
    return mem


def model_states(cfg, n: int, precision: str) -> list:
    """Bytes per rank of parameters, gradients and optimizer state (the ZeRO paper's model
    states) under DP, ZeRO-1, -2 and -3 on `n` data-parallel ranks: `picolib.planner.memory`."""
    from ..planner import Parallelism, memory
    return [sum(v for kind, v in memory(cfg, Parallelism(dp=n, zero=z, precision=precision)).items()
                if kind in ("params", "grads", "optimizer")) for z in range(4)]


# --------------------------------------------------------------------------- the lesson's runs
CONFIGS = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-1 bf16"]


def one_step(cfg, mb: int, seq: int) -> dict:
    """On every rank: one torch.optim.Adam step of DP (picolib's DDP owning the optimizer)
    and of each ZeRO configuration of CONFIGS, each on a fresh TinyLlama(cfg) and this rank's
    micro-batch of `mb` sequences of `seq` tokens. Per configuration: the bytes held after
    the step ("memory": params, grads, optimizer — the wrapper's `memory()`, which DDP and
    ZeRO share), B_opt read from the torch optimizer's state ("b_opt": bytes per element of its
    tensors shaped like the parameter, + 4 for ZeRO's fp32 master beside bf16), the ledger's
    summary and calls (op, buffer bytes, ring-formula bytes), the saved activations' bytes,
    and the buffers DP's buckets or ZeRO's units hold."""
    import torch
    import torch.distributed as dist

    from ..comm import Ledger
    from ..data_parallel import DDP
    from ..memory import SavedActivations
    from ..model import TinyLlama, random_tokens
    from ..sharded_optim import state_bytes_per_element
    from ..zero import ZeRO

    x, y = random_tokens(mb, seq, cfg.vocab_size, seed=dist.get_rank())
    out = {}
    for name in CONFIGS:
        model = TinyLlama(cfg)
        if name == "DP":
            ddp = wrapper = DDP(model, optimizer=torch.optim.Adam, lr=1e-3)
        else:
            dtype = torch.bfloat16 if "bf16" in name else torch.float32
            zero = wrapper = ZeRO(model, int(name[5]), optimizer=torch.optim.Adam, lr=1e-3,
                                  param_dtype=dtype)
        with Ledger() as led, SavedActivations() as acts:
            model.loss(x, y).backward()
            wrapper.step()
        mem = wrapper.memory()
        b_opt = state_bytes_per_element(ddp.optimizer) if name == "DP" else zero.state_factor()
        out[name] = dict(memory=mem, b_opt=b_opt, traffic=led.summary(), activations=acts.bytes,
                         calls=[(r.op, r.nbytes, r.sent_bytes) for r in led.records],
                         buckets=([b.buffer.numel() for b in ddp.buckets] if name == "DP"
                                  else zero.unit_numels()))
    return out


def replay(calls) -> list:
    """Run each recorded (op, buffer bytes, …) call again on picolib's own rings (built from
    send/recv, lesson 00) with a buffer of the same size; return the bytes this rank really
    sent, one entry per call. Every rank of the group calls it with the same list."""
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..comm import Ledger

    n = dist.get_world_size()
    with Ledger() as led:
        for op, nbytes, *_ in calls:
            buf = torch.ones(nbytes // 4)
            if op == "all_reduce":
                comm.ring_all_reduce(buf)
            elif op == "reduce_scatter":
                comm.ring_reduce_scatter(buf)
            elif op == "all_gather":                    # the buffer is the gathered output
                comm.ring_all_gather(buf[: buf.numel() // n])
            else:
                raise ValueError(f"cannot replay {op!r}")
    if not all(r.measured for r in led.records):
        raise AssertionError("a replayed call was not counted on picolib's rings")
    return [r.sent_bytes for r in led.records]


def accumulate(cfg, stage: int, m: int, mb: int, seq: int) -> dict:
    """One ZeRO-`stage` step of `m` micro-batches (`no_sync()` on all but the last backward)
    on this rank: the gradient bytes held after each backward ("held"), the calls made
    ("calls") and the bytes those calls send on picolib's rings ("wire", via `replay`)."""
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist

    from ..comm import Ledger
    from ..model import TinyLlama, random_tokens
    from ..zero import ZeRO

    model = TinyLlama(cfg)
    zero = ZeRO(model, stage, optimizer=torch.optim.Adam, lr=1e-3)
    x, y = random_tokens(mb * m, seq, cfg.vocab_size, seed=dist.get_rank())
    held = []
    with Ledger() as led:
        for i in range(m):
            with zero.no_sync() if i < m - 1 else nullcontext():
                (model.loss(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / m).backward()
            held.append(zero.memory()["grads"])
        zero.step()
    calls = [(r.op, r.nbytes, r.sent_bytes) for r in led.records]
    return dict(held=held, calls=calls, wire=replay(calls))


def zero3_timeline(cfg, costs: dict, prefetch: bool, mb: int, seq: int) -> list:
    """One ZeRO-3 step with emulated costs (`Timeline(emulate=costs)`), with or without
    prefetch; returns this rank's timeline events."""
    import torch
    import torch.distributed as dist

    from ..model import TinyLlama, random_tokens
    from ..timeline import Timeline
    from ..zero import ZeRO

    tl = Timeline(emulate=costs)
    model = TinyLlama(cfg)
    zero = ZeRO(model, 3, optimizer=torch.optim.Adam, lr=1e-3, prefetch=prefetch, timeline=tl)
    x, y = random_tokens(mb, seq, cfg.vocab_size, seed=dist.get_rank())
    model.loss(x, y).backward()
    zero.step()
    return tl.events


def hidden_fraction(events, rank: int = 0) -> float:
    """Share of `rank`'s all-gather time that runs under some forward or backward span."""
    from ..timeline import busy_time, overlap_time
    return overlap_time(events, rank, "all_gather", ["F", "B"]) / busy_time(events, rank, "all_gather")


def gathers_under_compute(events, rank: int = 0) -> tuple:
    """(all-gathers of `rank` that spend at least half their time under a forward or
    backward span, all-gathers of `rank`)."""
    comp = [e for e in events if e["rank"] == rank and e["name"] in ("F", "B")]
    gathers = [e for e in events if e["rank"] == rank and e["name"] == "all_gather"]
    under = [g for g in gathers if any(min(g["end"], c["end"]) - max(g["start"], c["start"])
                                       >= 0.5 * (g["end"] - g["start"]) for c in comp)]
    return len(under), len(gathers)
