"""Lesson 12's measurements: eager traffic and kernels against `torch.compile` (`fusion`),
attention's cost, fp16 gradients and the loss scaler, FP8 errors by scale granularity and a short
FP8 run, and the try-it `io_plot` (attention's slow-memory traffic, naive and tiled).
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F
from ..torch_compat import TorchDispatchMode, inductor_metrics

from ..attention_io import largest_block, naive_bytes, on_chip_bytes, tiled_bytes
from ..low_precision import DynamicLossScaler, fake_quantize, fp8_model
from ..model import LlamaConfig, TinyLlama, TextData, attention_core, random_tokens

__all__ = ["eager_traffic", "check_fused_rmsnorm", "rmsnorm_eager", "swiglu_act", "masked_softmax", "fusion",
           "attention_cost", "fp16_gradients", "scaler_steps", "outlier_errors", "fp8_runs",
           "plot_fusion", "plot_outliers", "plot_fp8_runs", "io_plot", "best_time"]


class _Traffic(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes, self.ops, self.largest, self.created = 0, [], 0, 0
        self.live = self.peak = 0          # bytes of the tensors made here and still referenced

    def _freed(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out
        self.ops.append(func._overloadpacket.__name__)
        ins = [t for t in _flat(args) + _flat(list((kwargs or {}).values()))]
        outs = _flat(out)
        self.bytes += sum(t.numel() * t.element_size() for t in ins + outs)
        for t in outs:
            n = t.numel() * t.element_size()
            self.created += n
            self.largest = max(self.largest, n)
            self.live += n
            weakref.finalize(t, self._freed, n)
        self.peak = max(self.peak, self.live)
        return out


def _flat(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    return []


def eager_traffic(fn, *args) -> dict:
    """Run `fn(*args)` eagerly, recording every operation below autograd: {"bytes" read and
    written, "ops" (names), "created" bytes of new tensors, "largest" new tensor, "peak" bytes
    of new tensors alive at once (each counted until Python drops it; the result included)}."""
    with torch.no_grad(), _Traffic() as t:
        result = fn(*args)
    peak = t.peak
    del result
    return {"bytes": t.bytes, "ops": t.ops, "created": t.created, "largest": t.largest, "peak": peak}


def rmsnorm_eager(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def swiglu_act(gate, up):
    return F.silu(gate) * up


def masked_softmax(scores, mask):
    """The attention's elementwise part: scale, causal mask, softmax."""
    return (scores / 8.0).masked_fill(mask, float("-inf")).softmax(-1)


def check_fused_rmsnorm(norm, rows: int = 32, device=None, seed: int = 0) -> dict | None:
    """The Triton RMSNorm of `picolib.fused_rmsnorm` against `norm` (a picolib RMSNorm, its
    weight randomised): {"y", "dx", "dw": max abs differences, "mode": interpreter or
    compiled}; None when Triton is not installed. `device`: by default the CPU under
    Triton's interpreter, the GPU where Triton compiles (its kernels read GPU memory only)."""
    try:
        from ..fused_rmsnorm import interpreted, rmsnorm
    except ImportError:
        return None
    device = device or ("cpu" if interpreted() else "cuda")
    norm = norm.to(device)
    g = torch.Generator().manual_seed(seed)
    hidden = norm.weight.numel()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    x = torch.randn(rows, hidden, generator=g).to(device).requires_grad_()
    dy = torch.randn(rows, hidden, generator=g).to(device)
    y = rmsnorm(x, norm.weight, norm.eps)
    (y * dy).sum().backward()
    dx, dw = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    ref = norm(x)
    (ref * dy).sum().backward()
    return {"y": (y - ref).abs().max().item(), "dx": (dx - x.grad).abs().max().item(),
            "dw": (dw - norm.weight.grad).abs().max().item(),
            "mode": "interpreter on the CPU" if interpreted() else "compiled for the GPU"}


def best_time(fn, *args, reps: int = 7) -> float:
    """The fastest of `reps` runs, seconds (a shared machine only ever slows a run down)."""
    best = float("inf")
    with torch.no_grad():
        fn(*args)
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*args)
            best = min(best, time.perf_counter() - t0)
    return best


def fusion(rows: int = 32768, hidden: int = 512, ffn: int = 1024, seq: int = 256) -> dict:
    """The three memory-bound functions on fp32 inputs of a transformer's sizes, eager and
    compiled by `torch.compile` (Inductor). For each: bytes eager moves (counted), the least
    bytes a fused kernel must move (its inputs and outputs), eager operations and generated
    kernels (Inductor's counter), and the best time of each."""
    metrics = inductor_metrics()
    g = torch.Generator().manual_seed(0)
    cases = {"RMSNorm": (rmsnorm_eager, (torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g))),
             "SwiGLU silu(g)·u": (swiglu_act, (torch.randn(rows, ffn, generator=g), torch.randn(rows, ffn, generator=g))),
             "scale, mask, softmax": (masked_softmax, (torch.randn(rows * hidden // seq // seq, seq, seq, generator=g),
                                                       torch.ones(seq, seq, dtype=torch.bool).triu(1)))}
    out = {}
    for name, (fn, args) in cases.items():
        counted = eager_traffic(fn, *args)
        result = fn(*args)
        least = sum(a.numel() * a.element_size() for a in args) + result.numel() * result.element_size()
        metrics.reset()
        compiled = torch.compile(fn)
        assert torch.allclose(compiled(*args), result, atol=1e-5, rtol=1e-4)
        kernels = metrics.generated_kernel_count
        out[name] = {"eager_bytes": counted["bytes"], "fused_bytes": least, "ops": len(counted["ops"]),
                     "kernels": kernels, "eager_s": best_time(fn, *args), "compiled_s": best_time(compiled, *args)}
    return out


def plot_fusion(table: dict, ax=None):
    """Predicted (bytes eager / bytes fused) against measured speed-up, one pair per function."""
    import matplotlib.pyplot as plt
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(6.4, 3.2))
    names = list(table)
    pred = [r["eager_bytes"] / r["fused_bytes"] for r in table.values()]
    meas = [r["eager_s"] / r["compiled_s"] for r in table.values()]
    xs = list(range(len(names)))
    ax.scatter(xs, pred, s=90, marker="s", facecolor="none", edgecolor="#3182bd", lw=1.6,
               label="predicted: eager bytes / fused bytes", zorder=3)
    ax.scatter(xs, meas, s=70, marker="o", color="#e6550d", label="measured: eager time / compiled time", zorder=3)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(xs, names)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_yscale("log")
    ax.set_ylim(min(pred + meas + [1]) / 2, max(pred + meas) * 4)
    ax.set(ylabel="speed-up (×, log scale)", title="fusion: predicted from bytes vs measured (this CPU, fp32)")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=9, loc="upper right")
    if created:
        ax.figure.tight_layout()
        plt.show()
    return ax


def attention_cost(seqs=(256, 512, 1024), heads: int = 2, d: int = 64) -> dict:
    """{impl: {s: (best seconds, bytes of tensors created, largest tensor, peak bytes of new
    tensors alive at once)}} for eager attention and PyTorch's fused
    `scaled_dot_product_attention`, b = 1, causal."""
    out = {"eager": {}, "sdpa": {}}
    g = torch.Generator().manual_seed(0)
    for s in seqs:
        q, k, v = (torch.randn(1, heads, s, d, generator=g) for _ in range(3))
        for impl in out:
            t = eager_traffic(attention_core, q, k, v, impl)
            out[impl][s] = (best_time(attention_core, q, k, v, impl, reps=3), t["created"], t["largest"], t["peak"])
    return out


def fp16_gradients(divisors=(1, 256, 4096), batch: int = 4, seq: int = 64) -> dict:
    """The tiny Llama's gradients under autocast, with the loss divided by k (a mean over k
    times more tokens, as k accumulated micro-batches make it): {k: {mode: (share of the
    gradient elements that are 0 where fp32's are not, relative error of the gradient
    against fp32's)}}, modes fp16, bf16 and fp16 with a loss scale of 2¹⁶."""
    x, y = random_tokens(batch, seq)
    ref = TinyLlama(LlamaConfig())
    ref.loss(x, y).backward()
    ref_grads = [p.grad for p in ref.parameters()]
    norm = sum(g.norm() ** 2 for g in ref_grads) ** 0.5
    total = sum(g.numel() for g in ref_grads)
    out = {}
    for k in divisors:
        out[k] = {}
        for mode in ("fp16", "bf16", "fp16 + loss scaling"):
            m = TinyLlama(LlamaConfig())
            scaler = DynamicLossScaler() if mode.endswith("scaling") else None
            with torch.autocast("cpu", dtype=torch.bfloat16 if mode == "bf16" else torch.float16):
                loss = m.loss(x, y) / k
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                assert scaler.unscale_and_check(list(m.parameters()))
            grads = [p.grad.float() * k for p in m.parameters()]
            lost = sum(((g == 0) & (r != 0)).sum().item() for g, r in zip(grads, ref_grads))
            err = sum((g - r).norm() ** 2 for g, r in zip(grads, ref_grads)) ** 0.5 / norm
            out[k][mode] = (lost / total, err.item())
    return out


def scaler_steps(init_scale: float = 2.0 ** 24, steps: int = 6) -> list:
    """A dynamic loss scaler that starts too high on the tiny Llama under fp16 autocast:
    [(scale used, step taken?)] per step — overflowing steps are skipped and halve it."""
    m = TinyLlama(LlamaConfig())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler, out = DynamicLossScaler(init_scale, growth_interval=1000), []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m.loss(*random_tokens(4, 64, seed=step))
        used = scaler.scale_value
        scaler.scale(loss).backward()
        ok = scaler.unscale_and_check(list(m.parameters()))
        if ok:
            opt.step()
        opt.zero_grad()
        out.append((used, ok))
    return out


def outlier_errors(outliers=(1, 10, 100, 1000, 10000), groups=("tensor", "row", "tile"),
                   fmt: str = "e4m3") -> dict:
    """FP8 error of the ordinary values of an activation when one channel is `outlier`
    times larger: the input of a SwiGLU down-projection of a tiny Llama with h = 256
    (rows of 512: four 1×128 tiles). {group: [mean relative error of the other channels'
    values, per outlier size]}."""
    cfg = LlamaConfig(hidden=256, n_heads=4, n_kv_heads=2, ffn_hidden=512, n_layers=2)
    model, seen = TinyLlama(cfg), {}

    def keep(module, inputs, output):
        seen["x"] = inputs[0].detach()

    model.blocks[0].mlp.w_down.register_forward_hook(keep)
    with torch.no_grad():
        model.loss(*random_tokens(4, 64))
    x = seen["x"]
    out = {g: [] for g in groups}
    for k in outliers:
        a = x.clone()
        a[..., 7] *= k
        ordinary = torch.ones_like(a, dtype=torch.bool)
        ordinary[..., 7] = False
        ordinary &= a != 0
        for g in groups:
            q = fake_quantize(a, g, fmt)
            out[g].append(((q - a).abs()[ordinary] / a.abs()[ordinary]).mean().item())
    return out


def plot_outliers(outliers, errors: dict, ax=None):
    import matplotlib.pyplot as plt
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(6.0, 3.2))
    colors = {"tensor": "#d62728", "row": "#ff7f0e", "tile": "#2ca02c"}
    for g, errs in errors.items():
        ax.plot(outliers, [100 * e for e in errs], "o-", color=colors.get(g), label=f"one scale per {g}")
    ax.set(xscale="log", xlabel="outlier channel's size (× its original values)",
           ylabel="mean relative error (%)",
           title="FP8 e4m3: error of the ordinary values next to an outlier (measured)")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=9)
    if created:
        ax.figure.tight_layout()
        plt.show()
    return ax


FP8_RUNS = {"bf16": None,                                   # run name: (scale granularity, gradient format)
            "fp8, 1×128 tiles": ("tile", "e4m3"),
            "fp8, per tensor": ("tensor", "e4m3"),          # granularity alone changed
            "fp8, tiles, e5m2 gradients": ("tile", "e5m2")}  # gradient format alone changed


def fp8_runs(steps: int = 40, lr: float = 3e-3, batch: int = 4, seq: int = 64, runs: dict = FP8_RUNS) -> dict:
    """Train the tiny Llama on the shipped text, same seed and batches, AdamW, once per entry of
    `runs`: None is bf16 autocast; (granularity, gradient format) puts FP8 matmul inputs in every
    linear but the head (e4m3 activations and weights, scales per "tile"/"row"/"tensor", fp32
    accumulation). {run name: [loss per step]}."""
    data, out = TextData(), {}
    for name, fp8 in runs.items():
        model = TinyLlama(LlamaConfig())
        if fp8 is not None:
            fp8_model(model, group=fp8[0], grad_fmt=fp8[1])
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        losses = []
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp8 is None):
                loss = model.loss(*data.batch(batch, seq, step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = losses
    return out


def plot_fp8_runs(runs: dict, tolerance: float = 0.02, axes=None):
    """Left: the loss curves; right: each run's loss minus the first run's, with the band
    ±`tolerance`. Draws into `axes` (two) if given; returns them."""
    import matplotlib.pyplot as plt
    created = axes is None
    if created:
        _, axes = plt.subplots(1, 2, figsize=(10.5, 3.4))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    base = next(iter(runs.values()))
    steps = range(1, len(base) + 1)
    for (mode, losses), c in zip(runs.items(), colors):
        axes[0].plot(steps, losses, label=mode, lw=1.4, color=c)
        axes[1].plot(steps, [a - b for a, b in zip(losses, base)], label=mode, lw=1.4, color=c)
    axes[1].axhspan(-tolerance, tolerance, color="0.85", label=f"±{tolerance}")
    axes[0].set(xlabel="step", ylabel="loss (nats per token)", title="tiny Llama: bf16 and FP8 matmul inputs (measured)")
    first = next(iter(runs))
    axes[1].set(xlabel="step", ylabel=f"loss − {first} loss (nats)", title=f"difference from {first}")
    for ax in axes:
        ax.title.set_fontsize(10)
        ax.legend(fontsize=9)
    if created:
        axes[0].figure.tight_layout()
        plt.show()
    return axes


def io_plot(head_dim: int = 128, block: int = 0, on_chip_kib: int = 256, plot: bool = True) -> dict:
    """Try it: slow-memory bytes of one head's attention, naive and tiled, for s from 1k to
    128k (bf16). `block` 0 picks the largest block that fits `on_chip_kib` KiB; a block
    that does not fit is an error. Returns {"block", "naive", "tiled" (bytes per s)}."""
    on_chip = on_chip_kib * 1024
    block = block or largest_block(head_dim, on_chip)
    if on_chip_bytes(head_dim, block) > on_chip:
        raise ValueError(f"a block of {block} rows needs {on_chip_bytes(head_dim, block):,} bytes "
                         f"on chip; only {on_chip:,} are there")
    seqs = [2 ** k for k in range(10, 18)]
    naive = {s: naive_bytes(s, head_dim) for s in seqs}
    tiled = {s: tiled_bytes(s, head_dim, block) for s in seqs}
    if plot:
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.2, 3.4))
        ax.plot(seqs, [naive[s] / 2**30 for s in seqs], "o-", color="#d62728", label="naive (S, P through slow memory)")
        ax.plot(seqs, [tiled[s] / 2**30 for s in seqs], "o-", color="#2ca02c", label=f"tiled, blocks of {block} rows")
        ax.set(xscale="log", yscale="log", xlabel="sequence length s (tokens)", ylabel="GiB moved, one head",
               title=f"attention I/O (computed): d={head_dim}, {on_chip_kib} KiB on chip, "
                     f"ratio {naive[seqs[-1]] / tiled[seqs[-1]]:.1f}× at 128k")
        ax.title.set_fontsize(10)
        ax.legend(fontsize=9)
        fig.tight_layout()
        plt.show()
    return {"block": block, "naive": naive, "tiled": tiled}
