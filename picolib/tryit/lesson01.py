"""Lessons 01 and 01b's plumbing: the tiny Llama's training memory, measured and drawn.
Try it: `knobs(step_trace, micro_batches=[1, 2, 4, 8])` (01), `knobs(memory_bars, batch=(1, 8, 1))` (01b).
"""
from __future__ import annotations

import torch

from ..memory import Breakdown, MemoryTrace
from ..model import LlamaConfig, TinyLlama, random_tokens

RECOMPUTE = ("none", "selective", "full")


def step_peak(cfg: LlamaConfig, batch: int, seq: int, steps: int = 2, seed: int = 0):
    """`steps` fp32 Adam steps of `TinyLlama(cfg)` on one batch under `MemoryTrace`. Returns
    (peak, bound): the sample with the most live bytes from step 2 on (Adam's moments exist),
    i.e. what the step holds at its peak, and the Breakdown of each kind's own maximum over
    the same samples — their sum is an upper bound that no moment of the step holds."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the peak is read from step 2 on), not {steps}")
    model = TinyLlama(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = random_tokens(batch, seq, cfg.vocab_size, seed=seed)
    with MemoryTrace(model, opt) as trace:
        for _ in range(steps):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    events = [s.event for s in trace.samples]
    later = trace.samples[events.index("zero_grad") + 1:]
    bound = Breakdown(*(max(getattr(s, k) for s in later) for k in ("params", "grads", "optimizer", "activations")))
    return max(later, key=lambda s: s.total), bound


def plot_peaks(rows: dict, ax=None, title: str = "memory at the step's peak"):
    """One stacked bar per {label: (peak, bound)} of `step_peak`: the kinds of memory the step
    holds at its peak; a dashed outline up to the sum of each kind's maximum (the bound)."""
    import matplotlib.pyplot as plt
    from ..style import MEMORY
    ax = ax or plt.subplots(figsize=(max(7.0, 2.6 + 1.2 * len(rows)), 3.8))[1]
    labels, mib = list(rows), 2**20
    bottom = [0.0] * len(rows)
    for kind, color in MEMORY.items():
        vals = [getattr(peak, kind) / mib for peak, _ in rows.values()]
        ax.bar(labels, vals, bottom=bottom, color=color,
               label=f"{kind} at the peak" + (": none" if not any(vals) else ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(labels, [(bound.total - peak.total) / mib for peak, bound in rows.values()], bottom=bottom,
           fill=False, ls="--", edgecolor="0.3", label="sum of each kind's maximum:\nheld at no moment")
    ax.set(ylabel="MiB", title=title)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax


def memory_bars(batch: int = 1, seq: int = 64, recompute: str = "none", attn_impl: str = "eager",
                plot: bool = True):
    """The memory two fp32 Adam steps of the tiny Llama (h=64, L=4) hold at the second step's
    peak, at micro-batch `batch`, sequence length `seq`, `recompute` ∈ none/selective/full
    (`step_peak`); draws the peak as a stacked bar with the bound outlined. Returns the peak
    sample (a Breakdown, bytes)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    batch, seq = int(batch), int(seq)
    cfg = LlamaConfig(max_seq=max(seq, 256), recompute=recompute, attn_impl=attn_impl)
    peak, bound = step_peak(cfg, batch, seq)
    if plot:
        import matplotlib.pyplot as plt
        ax = plot_peaks({f"recompute={recompute}": (peak, bound)},
                        title=f"b={batch}, s={seq}: peak {peak.total / 2**20:.2f} MiB, in the {peak.event}")
        ax.set_xlim(-1.5, 1.5)
        ax.figure.tight_layout()
        plt.show()
    return peak


def step_trace(batch: int = 8, micro_batches: int = 1, seq: int = 64, steps: int = 2,
               plot: bool = True):
    """Train the tiny Llama (fp32 Adam) for `steps` steps of `batch` sequences of `seq` tokens,
    each step accumulated over `micro_batches` micro-batches, under `MemoryTrace`; draw the
    trace with the 12Ψ and 16Ψ levels. Returns the sample with the most live bytes after the
    first `zero_grad()` (from step 2 on, when Adam's moments exist)."""
    batch, micro_batches, seq, steps = int(batch), int(micro_batches), int(seq), int(steps)
    if micro_batches < 1 or batch % micro_batches:
        raise ValueError(f"micro_batches must divide batch: {batch} sequences cannot be split "
                         f"into {micro_batches} equal micro-batches")
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the peak is read from step 2 on), not {steps}")
    cfg = LlamaConfig(max_seq=max(seq, 256))
    model = TinyLlama(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = random_tokens(batch, seq, cfg.vocab_size, seed=5)
    mb = batch // micro_batches
    with MemoryTrace(model, opt) as trace:
        for _ in range(steps):
            for i in range(micro_batches):
                (model.loss(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / micro_batches).backward()
            opt.step()
            opt.zero_grad()
    if plot:
        from ..model import param_count
        draw_trace(trace, param_count(cfg), title=f"b={batch} in {micro_batches} micro-batch"
                   f"{'es' if micro_batches > 1 else ''}, s={seq}: {steps} Adam steps")
    events = [s.event for s in trace.samples]
    return max(trace.samples[events.index("zero_grad") + 1:], key=lambda s: s.total)


# --------------------------------------------------------------------------- the lesson's helpers
# Measurements and drawings lesson 01's cells call, so that its teaching cells stay short.

PRECISIONS = ("fp32", "bf16", "bf16 + fp32 master")


def precision_runs(steps: int = 60, lr: float = 1e-5, batch: int = 4, seq: int = 64) -> dict:
    """Train the tiny Llama on the shipped text three ways, same seed and same batches,
    AdamW at `lr` (no weight decay):
    - "fp32": weights, gradients and Adam's moments in fp32;
    - "bf16": everything bf16 — weights, gradients, Adam's moments (`torch.optim.AdamW` on
      bf16 parameters);
    - "bf16 + fp32 master": a bf16 model computes, its bf16 gradients are copied into fp32
      master weights, AdamW updates the masters (fp32 moments), the bf16 model is refreshed
      from the masters.
    Returns {mode: {"losses": [loss per step], "unchanged": share of the parameters with a
    nonzero gradient that the first step left bit-identical (the masters for the last)}}."""
    from ..model import TextData
    data, out = TextData(), {}
    for mode in PRECISIONS:
        model = TinyLlama(LlamaConfig())
        if mode != "fp32":
            model = model.bfloat16()
        master = mode == "bf16 + fp32 master"
        params = ([p.detach().float().requires_grad_() for p in model.parameters()] if master
                  else list(model.parameters()))
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        losses, unchanged = [], None
        for step in range(steps):
            loss = model.loss(*data.batch(batch, seq, step))
            loss.backward()
            losses.append(loss.item())
            if master:
                for m, p in zip(params, model.parameters()):
                    m.grad, p.grad = p.grad.float(), None
            before = [p.detach().clone() for p in params] if step == 0 else None
            moved = [p.grad != 0 for p in params] if step == 0 else None
            opt.step()
            opt.zero_grad()
            if master:
                with torch.no_grad():
                    for p, m in zip(model.parameters(), params):
                        p.copy_(m)
            if step == 0:
                same = sum(((p.detach() == q) & g).sum().item() for p, q, g in zip(params, before, moved))
                unchanged = same / sum(g.sum().item() for g in moved)
        out[mode] = {"losses": losses, "unchanged": unchanged}
    return out


def plot_precision_runs(runs: dict, ax=None, title: str | None = None):
    """The loss of each run of `precision_runs` against the step."""
    import matplotlib.pyplot as plt
    from ..style import RANKS
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(7.5, 3.4), layout="constrained")
    styles = {"fp32": dict(color="k", lw=2.5), "bf16": dict(color=RANKS[6], lw=1.5),
              "bf16 + fp32 master": dict(color=RANKS[1], lw=1.5, ls="--")}
    for mode, r in runs.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=mode, **styles[mode])
    ax.set(xlabel="training step", ylabel="loss (cross-entropy, nats)",
           title=title or "same data, same seed: pure bf16 stalls, fp32 masters do not")
    ax.legend(loc="lower left")
    if created:
        plt.show()
    return ax


def accumulation_error(micro_batches: int = 64, seq: int = 32) -> dict:
    """Sum the bf16 gradients of `micro_batches` micro-batches (each loss divided by their
    number) of a bf16 tiny Llama into a bf16 buffer and into an fp32 buffer. Returns each
    buffer's relative error (L2 norm) against the fp64 sum of the same gradients."""
    from ..model import TextData
    data = TextData()
    model = TinyLlama(LlamaConfig()).bfloat16()
    acc = {"bf16": [torch.zeros_like(p) for p in model.parameters()],
           "fp32": [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]}
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for i in range(micro_batches):
        model.zero_grad()
        (model.loss(*data.batch(1, seq, 1000 + i)) / micro_batches).backward()
        for j, p in enumerate(model.parameters()):
            acc["bf16"][j] += p.grad
            acc["fp32"][j] += p.grad.float()
            exact[j] += p.grad.double()
    norm = sum((e ** 2).sum() for e in exact).sqrt()
    return {k: (sum(((a.double() - e) ** 2).sum() for a, e in zip(v, exact)).sqrt() / norm).item()
            for k, v in acc.items()}


def draw_trace(trace, psi: int, title: str):
    """picolib.memory.plot_trace with the 12Ψ and 16Ψ levels of model state drawn on it."""
    import matplotlib.pyplot as plt
    from ..memory import plot_trace
    ax = plot_trace(trace, title=title)
    ax.legend(loc="upper left", fontsize=9)
    for k, label in ((12, "12Ψ: weights + Adam"), (16, "16Ψ: + gradients")):
        ax.axhline(k * psi / 2**20, color="k", ls=":", lw=1)
        ax.annotate(label, (len(trace.samples) - 1, k * psi / 2**20), ha="right", va="bottom",
                    fontsize=9, bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
    plt.show()
    return ax


def plot_growth(by_b: dict, seqs, per_token: dict):
    """Two panels: saved MiB against the batch size, saved KiB per token against s."""
    import matplotlib.pyplot as plt
    from ..style import MEMORY, RANKS
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
    axes[0].plot(list(by_b), [v / 2**20 for v in by_b.values()], "o-", color=MEMORY["activations"])
    axes[0].set(xlabel="batch size b (s = 32)", ylabel="MiB saved", title="linear in b")
    for (impl, vals), c in zip(per_token.items(), (MEMORY["activations"], RANKS[0])):
        axes[1].plot(seqs, [v / 2**10 for v in vals], "o-", label=impl, color=c)
    axes[1].set(xlabel="sequence length s (tokens; b = 1, one layer)", ylabel="KiB saved per token",
                ylim=(0, None), title="per token: rises with s without a fused kernel")
    axes[1].legend()
    plt.show()


def step_flops(cfg, b: int, s: int) -> tuple:
    """(forward, forward + backward) matmul FLOPs of one step, counted by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    m = TinyLlama(cfg)
    with FlopCounterMode(display=False) as fc:
        loss = m.loss(*random_tokens(b, s))
        fwd = fc.get_total_flops()
        loss.backward()
    return fwd, fc.get_total_flops()


def step_times(cfgs: dict, b: int, s: int, reps: int = 7) -> dict:
    """Fastest of `reps` forward + backward times per {name: config}, run round-robin so
    that load on a shared CPU hits every configuration alike."""
    import time
    models = {r: TinyLlama(c) for r, c in cfgs.items()}
    xy, best = random_tokens(b, s), {r: float("inf") for r in cfgs}
    for _ in range(reps):
        for r, m in models.items():
            t0 = time.perf_counter()
            m.loss(*xy).backward()
            best[r] = min(best[r], time.perf_counter() - t0)
    return best


def plot_tradeoff(rel: dict, saved_mib: dict, title: str):
    """Saved MiB against relative step time, one point per recomputation mode."""
    import matplotlib.pyplot as plt
    from ..style import MEMORY
    fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    for r in rel:
        ax.scatter(rel[r], saved_mib[r], s=60, color=MEMORY["activations"])
        ax.annotate(r, (rel[r], saved_mib[r]), textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.set(xlabel="time of forward + backward / no recomputation (min of 7)",
           ylabel="MiB saved for backward", title=title)
    ax.margins(x=0.25, y=0.15)
    plt.show()


def plot_accumulation(g_big, g_acc, peaks: dict, batch: int):
    """Two panels: accumulated against big-batch gradients; peak saved MiB against k."""
    import matplotlib.pyplot as plt
    from ..style import MEMORY
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
    axes[0].scatter(g_big, g_acc, s=2, color=MEMORY["grads"])
    lo, hi = g_big.min().item(), g_big.max().item()
    axes[0].plot([lo, hi], [lo, hi], "k--", lw=0.8)
    axes[0].set(xlabel=f"gradient, one batch of {batch}", ylabel=f"gradient, {batch} micro-batches of 1",
                title="same gradient")
    axes[1].bar([str(k) for k in peaks], [v / 2**20 for v in peaks.values()], color=MEMORY["activations"])
    axes[1].set(xlabel="micro-batches m", ylabel="peak MiB saved", title="lower peak activation memory")
    plt.show()
