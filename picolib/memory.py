"""Where the bytes of a training step go: parameters, gradients, optimizer state and the
activations autograd saves for backward — measured, traced over time, and set beside the
textbook formulas. Lessons 01 and 01b (memory on one device) explain every function here; the
parallel lessons (DP, ZeRO, TP/SP, PP) use the same measurements per rank.

Everything is counted in bytes of tensor storage, each storage once: two views of one
tensor (a weight and its transpose) cost its bytes once. No allocator statistics are
needed, so the numbers are the same on a CPU as on a GPU; under CUDA a trace also records
`torch.cuda.memory_allocated()` beside them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["storage_key", "param_bytes", "grad_bytes", "optimizer_state_bytes", "Breakdown", "measure", "Sample",
           "SavedActivations", "MemoryTrace", "gpt_param_count", "bytes_per_param",
           "model_state_bytes", "activation_bytes", "model_flops", "hardware_flops",
           "plot_breakdown", "plot_trace", "rank_bars", "binary_unit"]


def storage_key(t: torch.Tensor):
    """Identity of a tensor's storage (shared by all its views): its device and address. A
    meta storage (the dry run, lesson 11) has no address: the storage object itself stands
    for it; an empty one, the tensor."""
    s = t.untyped_storage()
    if t.is_meta:
        return "meta", s._cdata
    return t.device, s.data_ptr() or ("empty", id(t))


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen.setdefault(storage_key(t), _nbytes(t))
    return sum(seen.values())


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (each storage once)."""
    return _unique_bytes(model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients now held in `.grad` (0 before the first backward)."""
    return _unique_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, scalars: bool = False) -> int:
    """Bytes of the optimizer's state (Adam: exp_avg and exp_avg_sq, 8 bytes per fp32
    parameter; 0 before the first step). Adam also keeps a 0-dim `step` counter per tensor
    (4 bytes per tensor, not per parameter): counted only with `scalars=True`."""
    return _unique_bytes(t for state in optimizer.state.values() for t in state.values()
                         if isinstance(t, torch.Tensor) and (scalars or t.dim() > 0))


@dataclass
class Breakdown:
    """Bytes per kind of memory on one rank."""
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def measure(model: nn.Module, optimizer=None, activations: "int | SavedActivations" = 0) -> Breakdown:
    """The model's bytes now: parameters, gradients, optimizer state, plus `activations`
    (bytes, or a SavedActivations whose peak is taken)."""
    if isinstance(activations, SavedActivations):
        activations = activations.peak
    return Breakdown(param_bytes(model), grad_bytes(model),
                     optimizer_state_bytes(optimizer) if optimizer is not None else 0,
                     int(activations))


# --------------------------------------------------------------------------- activations

class _SavedHandle:
    """What the pack hook hands autograd instead of the tensor; autograd drops it when it
    frees the saved tensor (after the node's backward), and then the live count falls."""
    __slots__ = ("tensor", "key", "counter")

    def __init__(self, tensor, key, counter):
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self):
        if self.key is not None:
            self.counter._release(self.key)


class SavedActivations:
    """Count the bytes autograd saves for backward while the context is open.

        with SavedActivations(model) as act:
            loss = model.loss(x, y)
        act.bytes      # everything saved by this forward (each storage once)
        act.live       # what is still held now (falls during backward)
        act.peak       # the most that was held at once
        act.by_module  # {module name: bytes it saved} (needs `model`)
        act.by_dtype   # {torch.float32: bytes, ...}

    Parameters, buffers and their views are not activations and are left out (by storage
    when `model` is given; otherwise any leaf tensor that requires grad, and its views).
    Works with torch.utils.checkpoint: a checkpointed region saves only its inputs.
    """

    def __init__(self, model: nn.Module | None = None, per_module: bool = True):
        self.model, self.per_module = model, per_module and model is not None
        self.bytes = self.live = self.peak = 0
        self.by_module: dict[str, int] = {}
        self.by_dtype: dict = {}
        self._refs: dict = {}        # storage key -> [holders alive, bytes]
        self._stack: list[str] = []  # names of the modules now running forward
        self._handles, self._skip = [], set()

    def __enter__(self):
        if self.model is not None:
            self._skip = {storage_key(t) for t in (*self.model.parameters(), *self.model.buffers())}
            if self.per_module:
                for name, mod in self.model.named_modules():
                    self._handles += [mod.register_forward_pre_hook(
                        lambda m, a, name=name or "(model)": self._stack.append(name)),
                        mod.register_forward_hook(self._pop)]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles, self._stack = [], []

    def _pop(self, *_):
        if self._stack:
            self._stack.pop()

    def _is_param(self, t) -> bool:
        if self.model is not None:
            return storage_key(t) in self._skip
        base = t._base if t._base is not None else t
        return base.is_leaf and base.requires_grad

    def _pack(self, t):
        if self._is_param(t):
            return _SavedHandle(t, None, self)
        key = storage_key(t)
        ref = self._refs.get(key)
        if ref is None:
            nbytes = _nbytes(t)
            self._refs[key] = [1, nbytes]
            self.bytes += nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + nbytes
            if self.per_module:
                where = self._stack[-1] if self._stack else "(outside)"
                self.by_module[where] = self.by_module.get(where, 0) + nbytes
        else:
            ref[0] += 1
        return _SavedHandle(t, key, self)

    def _release(self, key):
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live -= ref[1]


# --------------------------------------------------------------------------- trace over time

@dataclass
class Sample(Breakdown):
    """A Breakdown at one moment (activations: saved tensors alive then)."""
    event: str = ""     # "forward", "backward", "step", "zero_grad" or a mark
    where: str = ""     # module or parameter name
    cuda_allocated: int | None = None


class MemoryTrace:
    """Sample live bytes during training steps: after each module's forward, after each
    parameter's gradient lands in backward, after `optimizer.step()` and `zero_grad()`.

        with MemoryTrace(model, opt) as trace:
            for x, y in batches:
                model.loss(x, y).backward(); opt.step(); opt.zero_grad()
        plot_trace(trace)

    Each sample comes from a hook PyTorch documents (module forward hooks, parameters'
    post-accumulate-grad hooks, the optimizer's step post-hook), but for `zero_grad()`:
    `torch.optim.Optimizer` has no hook there (torch 2.6 to 2.15), so inside the block this
    optimizer's own `zero_grad` is wrapped, on the instance only, and the wrapper is removed
    on exit (tests/lib/test_memory.py checks that none is left)."""

    def __init__(self, model: nn.Module, optimizer=None):
        self.model, self.optimizer = model, optimizer
        self.samples: list[Sample] = []
        self.acts = SavedActivations(model, per_module=False)
        self._handles: list = []
        self._cuda = any(p.is_cuda for p in model.parameters())

    def mark(self, event: str, where: str = ""):
        """Record a sample now."""
        cuda = torch.cuda.memory_allocated() if self._cuda else None
        now = measure(self.model, self.optimizer, self.acts.live)
        self.samples.append(Sample(**vars(now), event=event, where=where, cuda_allocated=cuda))

    def __enter__(self):
        self.acts.__enter__()
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_hook(
                lambda m, a, o, name=name: self.mark("forward", name or "(model)")))
        for name, p in self.model.named_parameters():
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda p, name=name: self.mark("backward", name)))
        if self.optimizer is not None:
            opt = self.optimizer
            self._handles.append(opt.register_step_post_hook(lambda *_: self.mark("step")))
            zero_grad = opt.zero_grad

            def traced_zero_grad(*args, **kwargs):
                zero_grad(*args, **kwargs)
                self.mark("zero_grad")
            opt.zero_grad = traced_zero_grad   # on this instance only; removed on exit
        self.mark("start")
        return self

    def __exit__(self, *exc):
        self.acts.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.optimizer is not None:
            self.optimizer.__dict__.pop("zero_grad", None)

    def series(self, kind: str) -> list[int]:
        """One column over time: 'params', 'grads', 'optimizer', 'activations' or 'total'."""
        return [getattr(s, kind) for s in self.samples]


# --------------------------------------------------------------------------- formulas

def gpt_param_count(h: int, v: int, L: int) -> int:
    """N = h·v + L·(12h² + 13h) + 2h: embedding, L GPT blocks (attention 4h² + 4h, MLP
    8h² + 5h, two LayerNorms 4h), final LayerNorm 2h. (The seed note's L(½h² + ⅓h) is garbled.)"""
    return h * v + L * (12 * h * h + 13 * h) + 2 * h


def bytes_per_param(precision: str = "fp32", fp32_grad_accum: bool = False) -> dict[str, int]:
    """Bytes each parameter costs in training with Adam, by part: fp32 4+4+8 = 16; bf16 mixed
    precision with fp32 master weights 2+2+4+8 = 16; fp32 gradient accumulation adds 4."""
    if precision == "fp32":
        parts = {"params": 4, "grads": 4, "optimizer": 8}
    elif precision == "bf16":
        parts = {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
    else:
        raise ValueError(f"precision must be 'fp32' or 'bf16', not {precision!r}")
    if fp32_grad_accum:
        parts["fp32_grads"] = 4
    return parts


def model_state_bytes(n_params: float, precision: str = "fp32", fp32_grad_accum: bool = False) -> float:
    """Parameters + gradients + optimizer state of a model with `n_params` parameters."""
    return n_params * sum(bytes_per_param(precision, fp32_grad_accum).values())


def activation_bytes(L: int, s: int, b: int, h: int, a: int, flash: bool = False) -> int:
    """Korthikanti et al. 2022, mixed precision, no parallelism: L·s·b·h·(34 + 5·a·s/h).
    34·s·b·h per layer grows with s; the 5·a·s²·b score/softmax/dropout term is quadratic in
    s and disappears with flash attention (`flash=True`: L·s·b·h·34)."""
    if min(L, s, b, h, a) < 1:
        raise ValueError(f"L, s, b, h, a must be positive, got {L}, {s}, {b}, {h}, {a}")
    return L * s * b * (34 * h + (0 if flash else 5 * a * s))


def model_flops(n_params: float, tokens: float) -> float:
    """FLOPs the model needs: forward 2N + backward 4N per token (MFU counts these)."""
    return 6 * n_params * tokens


def hardware_flops(n_params: float, tokens: float, recompute: str = "none") -> float:
    """FLOPs the hardware runs: full recomputation repeats the forward (2N) → 8N per token
    (HFU counts these)."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full', not {recompute!r}")
    return (8 if recompute == "full" else 6) * n_params * tokens


# --------------------------------------------------------------------------- plots

_COLORS = {"params": "#2a9d8f", "grads": "#f4a261", "optimizer": "#e76f8a", "activations": "#8e6cc0"}


def binary_unit(nbytes: float):
    """(scale, name) of the binary unit for `nbytes`: GiB, MiB, KiB or B (picolib.style)."""
    units = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
    return next(((scale, name) for scale, name in units if nbytes >= scale), (1, "B"))


def plot_breakdown(rows: dict, ax=None, title: str = "memory per configuration"):
    """Stacked bars: params / grads / optimizer / activations for each {label: Breakdown}."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(1.6 + 1.1 * len(rows), 3.6))[1]
    scale, unit = binary_unit(max(b.total for b in rows.values()))
    bottom = [0.0] * len(rows)
    for kind, color in _COLORS.items():
        vals = [getattr(b, kind) / scale for b in rows.values()]
        ax.bar(list(rows), vals, bottom=bottom, color=color, label=kind)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set(ylabel=unit, title=title)
    ax.legend(fontsize=9)
    return ax


def plot_trace(trace: MemoryTrace, ax=None, title: str = "memory over time"):
    """Stacked areas of live bytes per sample; dashed lines at optimizer steps."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(9, 3.6))[1]
    scale, unit = binary_unit(max(trace.series("total")))
    x = range(len(trace.samples))
    ax.stackplot(x, *[[v / scale for v in trace.series(k)] for k in _COLORS],
                 labels=list(_COLORS), colors=list(_COLORS.values()))
    for i, s in enumerate(trace.samples):
        if s.event == "step":
            ax.axvline(i, color="k", ls="--", lw=0.8)
    ax.set(xlabel="event (module forward, gradient ready, optimizer step)", ylabel=unit, title=title)
    ax.legend(loc="upper left", fontsize=9)
    return ax


def rank_bars(ranks, unit: float, unit_name: str, limit: float, limit_label: str, title: str, ax=None):
    """Stacked bars of each pipeline rank's params, grads, optimizer and activations
    ({kind: bytes} per rank, drawn in bytes / `unit`), a dashed line at `limit` (lessons 10, 11)."""
    import matplotlib.pyplot as plt
    created = ax is None
    ax = ax or plt.subplots(figsize=(7.6, 3.4))[1]
    bottom = [0.0] * len(ranks)
    for kind, color in _COLORS.items():
        vals = [r[kind] / unit for r in ranks]
        ax.bar(range(len(ranks)), vals, bottom=bottom, color=color, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(limit, color="k", ls="--", lw=1, label=limit_label)
    ax.set(xlabel="pipeline rank", ylabel=f"{unit_name} per rank", xticks=range(len(ranks)), title=title)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    if created:                 # a helper handed an ax draws into it and never shows it
        ax.figure.tight_layout()
        plt.show()
    return ax
