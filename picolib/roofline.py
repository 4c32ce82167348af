"""The roofline of one accelerator, and where each operation of a training step sits on it
(lesson 12).

An operation that does F floating-point operations and moves B bytes between the processor
and its main memory cannot finish faster than

    t = max(F / peak, B / bandwidth)

(peak FLOP/s of the arithmetic units, bandwidth in bytes/s). Its *arithmetic intensity*
I = F / B decides which term wins: below the ridge point peak / bandwidth an operation is
memory-bound (the processor waits for bytes), above it compute-bound. The best FLOP/s it can
reach is min(peak, I · bandwidth): that line is the roofline. The planner's per-shape compute
efficiency (lesson 11) is this same formula evaluated on a GPU's datasheet figures.

What this file gives:
- `attainable`, `op_time`, `ridge` — the formula;
- `measure_peak`, `measure_bandwidth` — this machine's two numbers, measured (a large matmul,
  a large copy; best of several runs, because a shared machine only ever slows a run down);
- `StepProfile` — one training step recorded operation by operation: FLOPs from
  `torch.utils.flop_counter` (matmuls; other operations count one FLOP per output element, a
  stated convention), bytes from the tensors each operation reads and writes (views move
  nothing), and time from `torch.profiler` (each operation runs inside a labelled
  `record_function`), grouped into the kinds of work a transformer step does;
- `draw_roofline` — the picture;
(the same groups predicted instead of measured, for the planner: `picolib.layer_costs`);
- `CHIPS`, `tensor_peak` — what is inside NVIDIA's data-centre GPUs, V100 to B200: the
  architecture (SMs, Tensor Core FLOPs per cycle per SM, the clock NVIDIA's peak figures
  assume) kept apart from the datasheet's peak, HBM and NVLink figures, so a lesson can
  compute one from the other instead of restating it.
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from .torch_compat import TorchDispatchMode, current_autograd_node

__all__ = ["attainable", "op_time", "ridge", "measure_peak", "measure_bandwidth", "GROUPS",
           "StepProfile", "profile_step", "draw_roofline", "CHIPS", "tensor_peak"]

# the kinds of work one step of the tiny Llama does, in the order the lesson shows them
GROUPS = ("matmuls", "norms", "SwiGLU elementwise", "softmax and mask", "RoPE and reshapes",
          "residual adds", "loss and embedding", "optimizer")
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_mm"}


def attainable(intensity: float, peak: float, bandwidth: float) -> float:
    """The highest FLOP/s an operation of `intensity` FLOPs per byte can reach."""
    return min(peak, intensity * bandwidth)


def op_time(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """The roofline's lower bound on an operation's time, in seconds."""
    return max(flops / peak, nbytes / bandwidth)


def ridge(peak: float, bandwidth: float) -> float:
    """The intensity (FLOPs per byte) where memory-bound turns compute-bound."""
    return peak / bandwidth


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _best(fn, reps: int, device) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peak(dtype=torch.float32, n: int = 512, reps: int = 5, device="cpu") -> float:
    """FLOP/s of an n×n×n matmul (2n³ FLOPs), the best of `reps` runs."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    inner = 1 if torch.device(device).type == "cpu" else 20
    t = _best(lambda: [a @ b for _ in range(inner)], reps, device)
    return 2 * n ** 3 * inner / t


def measure_bandwidth(dtype=torch.float32, nbytes: int = 64 * 2**20, reps: int = 5,
                      device="cpu") -> float:
    """Bytes/s of copying `nbytes` (larger than the caches): a copy reads and writes them."""
    x = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    y = torch.empty_like(x)
    t = _best(lambda: y.copy_(x), reps, device)
    return 2 * x.numel() * x.element_size() / t


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def group_of(op: str, module: str, optimizer: bool) -> str:
    """The kind of work an operation does, from its name and the module that ran it."""
    if op in MATMULS:
        return "matmuls"
    if optimizer:
        return "optimizer"
    if module.endswith("norm"):
        return "norms"
    if module.endswith(".core"):
        return "softmax and mask"
    if module.endswith(".mlp"):
        return "SwiGLU elementwise"
    if module.endswith(".attn"):
        return "RoPE and reshapes"
    if re.search(r"blocks\.\d+$", module):
        return "residual adds"
    return "loss and embedding"


class _Modules(TorchFunctionMode):
    """Forward: remember which module made each autograd node, so that the backward's
    operations (run by that node) are put in the same group."""

    def __init__(self, tracker, nodes):
        super().__init__()
        self.tracker, self.nodes = tracker, nodes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.grad_fn is not None and t.grad_fn not in self.nodes:
                self.nodes[t.grad_fn] = max(self.tracker.parents, key=len, default="")
        return out


class StepProfile(TorchDispatchMode):
    """Records every operation below autograd: its group, FLOPs and bytes; on the CPU each
    runs inside `record_function("[group]")` so torch.profiler times the groups; on a GPU
    each is timed between two synchronisations."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.tracker, self.nodes = ModuleTracker(), {}
        self.flops, self.bytes = defaultdict(float), defaultdict(float)
        self.counts, self.seconds = defaultdict(int), defaultdict(float)
        self.optimizer = False
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.recording:
            return func(*args, **kwargs)
        op = func._overloadpacket.__name__
        node = current_autograd_node()
        module = self.nodes.get(node, "") if node is not None else max(self.tracker.parents, key=len, default="")
        group = group_of(op, module, self.optimizer)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            torch.cuda.synchronize()
            self.seconds[group] += time.perf_counter() - t0
        else:
            with torch.profiler.record_function(f"[{group}]"):
                out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out                      # a view moves no bytes and does no arithmetic
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            flops = sum(t.numel() for t in _tensors(out))     # convention: 1 per output element
        self.flops[group] += flops
        self.bytes[group] += _nbytes(args) + _nbytes(list(kwargs.values())) + _nbytes(out)
        self.counts[group] += 1
        return out

    def table(self) -> dict:
        """{group: {"flops", "bytes", "seconds", "ops"}} in GROUPS order (groups that ran)."""
        return {g: {"flops": self.flops[g], "bytes": self.bytes[g], "seconds": self.seconds[g],
                    "ops": self.counts[g]} for g in GROUPS if self.counts[g]}


@contextmanager
def _quiet_stderr():
    """The profiler's C++ side announces every start and stop on file descriptor 2; hide
    those two lines (Python's own errors still reach sys.stderr afterwards)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_step(model, tokens, targets, optimizer, steps: int = 3) -> dict:
    """Run `steps` training steps (forward, backward, optimizer step, zero_grad) of `model`
    under `StepProfile`, and return the last step's table: per group FLOPs, bytes, the
    number of operations, and seconds (torch.profiler on the CPU, synchronised wall time on a
    GPU; the fastest of the steps for each group)."""
    device = next(model.parameters()).device
    best = None
    for _ in range(steps):
        prof = StepProfile(device)
        with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            with prof:
                with prof.tracker, _Modules(prof.tracker, prof.nodes):
                    loss = model.loss(tokens, targets)
                loss.backward()
                prof.optimizer = True
                optimizer.step()
                optimizer.zero_grad()
        if device.type != "cuda":
            for e in p.key_averages():
                if e.key.startswith("[") and e.key[1:-1] in GROUPS:
                    prof.seconds[e.key[1:-1]] = e.cpu_time_total / 1e6
        table = prof.table()
        if best is None:
            best = table
        else:
            for g, row in table.items():
                best[g]["seconds"] = min(best[g]["seconds"], row["seconds"])
    return best


COLORS = {"matmuls": "#1f77b4", "norms": "#2ca02c", "SwiGLU elementwise": "#ff7f0e",
          "softmax and mask": "#9467bd", "RoPE and reshapes": "#8c564b", "residual adds": "#e377c2",
          "loss and embedding": "#7f7f7f", "optimizer": "#d62728"}


def draw_roofline(ax, peak: float, bandwidth: float, points: dict | None = None,
                  label: str = "", color="k", title: str | None = None, marker="o"):
    """Draw the roofline min(peak, I·bandwidth) on log-log axes (GFLOP/s against FLOPs per
    byte) and the `points` {name: (intensity, FLOP/s)} on it. Draws into `ax`, returns it."""
    lo, hi = 1e-2, 1e4
    xs = [lo, ridge(peak, bandwidth), hi]
    ax.plot(xs, [attainable(x, peak, bandwidth) / 1e9 for x in xs], color=color, lw=1.6,
            label=label or None)
    for name, (intensity, rate) in (points or {}).items():
        ax.scatter(intensity, rate / 1e9, s=45, marker=marker, color=COLORS.get(name, color),
                   edgecolor="k", lw=0.5, zorder=3, label=name)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte)",
           ylabel="GFLOP/s")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# ----------------------------------------------------------------- inside one GPU (lesson 12)
# Two sources per chip, kept apart. Architecture (NVIDIA's Volta, Ampere and Hopper
# whitepapers): SMs, dense 16-bit Tensor Core FLOPs per cycle per SM (an FMA counts 2: V100
# 8 Tensor Cores x 64 FMAs, A100 4 x 256, H100 4 x 512), and the clock NVIDIA's peak tensor
# figures assume (V100 SXM2 and A100 SXM4: their boost clocks; H100 SXM5: 1.83 GHz for the
# Tensor Cores, 1.98 GHz for the fp32 lanes). Datasheet (NVIDIA's product pages): dense peak
# in 16 bits (bf16; fp16 for the V100, which has no bf16), HBM bandwidth, NVLink bandwidth as
# NVIDIA quotes it (both directions added). B200: NVIDIA publishes no SM count or clock, so
# its architecture fields are None and its peak is a reported figure only.
CHIPS = {
    "V100": dict(sms=80, tc_flops_per_cycle_sm=1024, tensor_clock=1.53e9, peak16=125e12,
                 hbm=0.9e12, nvlink_both_ways=300e9, note="fp16 (no bf16 on Volta)"),
    "A100": dict(sms=108, tc_flops_per_cycle_sm=2048, tensor_clock=1.41e9, peak16=312e12,
                 hbm=2.039e12, nvlink_both_ways=600e9, note="80 GB SXM4"),
    "H100": dict(sms=132, tc_flops_per_cycle_sm=4096, tensor_clock=1.83e9, peak16=989.4e12,
                 hbm=3.35e12, nvlink_both_ways=900e9, note="SXM5"),
    "H200": dict(sms=132, tc_flops_per_cycle_sm=4096, tensor_clock=1.83e9, peak16=989.4e12,
                 hbm=4.8e12, nvlink_both_ways=900e9, note="the H100's chip, HBM3e"),
    "B200": dict(sms=None, tc_flops_per_cycle_sm=None, tensor_clock=None, peak16=2.25e15,
                 hbm=8e12, nvlink_both_ways=1.8e12, note="reported: dense bf16, HGX B200"),
}


def tensor_peak(chip: str) -> float | None:
    """Dense 16-bit Tensor Core FLOP/s from the architecture: SMs x FLOPs per cycle per SM x
    clock (None where the architecture is not published)."""
    c = CHIPS[chip]
    if c["sms"] is None:
        return None
    return c["sms"] * c["tc_flops_per_cycle_sm"] * c["tensor_clock"]
