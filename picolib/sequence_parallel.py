"""Sequence parallelism (Korthikanti et al. 2022, Megatron-LM): tensor parallelism whose
norms and residuals hold s/tp tokens per rank (lesson 05).

Under plain TP every rank keeps the whole (b, s, h) residual stream and runs the norms
on all of it: those activations are replicated tp times. TP+SP splits them along the
sequence instead. The two regions alternate:

    SP region (norm, residual; s/tp tokens)  ─all-gather→  TP region (attention or MLP;
    all s tokens, heads / ffn split)  ─reduce-scatter→  SP region ...

All-reduce = reduce-scatter + all-gather, so a forward moves the same bytes as TP in
twice the calls. Backward runs the conjugates: an all-gather's gradient is a
reduce-scatter, a reduce-scatter's an all-gather. The norm weights (and row-parallel biases,
added after the reduce-scatter) now see only s/tp tokens per rank, so each rank's gradient
of them is a partial sum: `SequenceParallelRMSNorm` passes its weight through f (identity
forward, all-reduce backward), so the sum over the group happens inside backward, before
the gradient reaches `.grad` and any data-parallel hook — no step to forget.

`picolib.tensor_parallel.apply_tensor_parallel(model, tp, sequence_parallel=True)` builds
the TP+SP model from these pieces (`sequence_parallel_region`).

`regather=True` (Megatron's choice, Korthikanti §4.2.2): the column matmuls entering a
TP region save only this rank's s/tp slice of their input and all-gather it again in
backward (overlapped with the input-gradient matmul). Every saved activation is then
1/tp (the s·b·h·34/t formula), for one extra all-gather per region in backward.
`regather=False` saves the gathered input: backward moves exactly TP's bytes, but the
norm outputs (2·s·b·h per layer) stay replicated.

Tensors are (b, s, h) as in picolib.model; rank r holds tokens [r·s/tp, (r+1)·s/tp).
The file opens with what lesson 05 reads (the pair g/ḡ, the region, the norm); the
re-gather, the communication without autograd and the activation counts follow.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import (Region, all_gather_to_region, copy_to_region, gather_along,
                       reduce_scatter_along, reduce_scatter_to_region, split_along)
from .model import RMSNorm

__all__ = ["all_gather_sequence", "reduce_scatter_sequence_nograd", "reduce_scatter_sequence",
           "gather_sequence", "split_sequence", "gathered_matmuls", "regathered_matmuls",
           "sequence_parallel_region", "SequenceParallelRMSNorm", "activation_bytes_per_layer",
           "korthikanti_bytes_per_layer"]


# ------------------------------------------------------------------ the pair, the region, the norm (lesson 05)

SEQ = 1   # the sequence dimension of (b, s, h); picolib.mappings does the moving


def gather_sequence(x, group=None):
    """g (Korthikanti et al.), entering a TP region: all-gather forward, reduce-scatter backward."""
    return all_gather_to_region(x, SEQ, group)


def reduce_scatter_sequence(x, group=None):
    """ḡ, leaving a TP region: reduce-scatter forward, all-gather backward."""
    return reduce_scatter_to_region(x, SEQ, group)


def gathered_matmuls(x, weights, group=None):
    """All-gather the sequence once, then every column matmul (autograd saves the gathered x)."""
    x = gather_sequence(x, group)
    return [F.linear(x, w) for w in weights]


def sequence_parallel_region(regather: bool = True) -> Region:
    """Enter a TP region by an all-gather along the sequence (saving the s/tp slice and
    gathering it again in backward, or saving the gathered input), leave it by a
    reduce-scatter."""
    return Region(regathered_matmuls if regather else gathered_matmuls,
                  reduce_scatter_sequence, True)


class SequenceParallelRMSNorm(RMSNorm):
    """An RMSNorm over this rank's s/tp tokens. Its weight (the same Parameter as the
    norm it replaces) enters through f, so backward sums the weight's gradient over the
    group: every rank's copy gets the gradient of all s tokens."""

    def __init__(self, norm: RMSNorm, group=None):
        nn.Module.__init__(self)
        self.eps, self.weight, self.group = norm.eps, norm.weight, group

    def forward(self, x):
        return self.normalize(x) * copy_to_region(self.weight, self.group)


# ------------------------------------------------------------------ the machinery: entering a region, moving without autograd

class _RegatheredMatmuls(torch.autograd.Function):
    """`gathered_matmuls`, saving only the local (b, s/tp, h) slice; backward all-gathers it again."""

    @staticmethod
    def forward(ctx, x, group, *weights):
        ctx.group = group
        ctx.save_for_backward(x, *weights)
        full = all_gather_sequence(x, group)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        work, finish = all_gather_sequence(x, ctx.group, async_op=True)
        grad_full = sum(g @ w for g, w in zip(grads, weights, strict=True))   # overlaps the all-gather
        grad_x = reduce_scatter_sequence_nograd(grad_full, ctx.group)
        work.wait()
        full = finish().flatten(0, -2)
        grad_ws = [g.flatten(0, -2).t() @ full for g in grads]
        return (grad_x, None, *grad_ws)


def regathered_matmuls(x, weights, group=None):
    return list(_RegatheredMatmuls.apply(x, group, *weights))


def all_gather_sequence(x, group=None, async_op=False):
    """(b, s/tp, h) on each rank → (b, s, h), no autograd. With async_op: (work, finish)."""
    return gather_along(x, SEQ, group, async_op)


def reduce_scatter_sequence_nograd(x, group=None):
    """(b, s, h) partial sums on each rank → this rank's (b, s/tp, h) of the total."""
    return reduce_scatter_along(x, SEQ, group)


def split_sequence(x, group=None):
    """This rank's slice of a replicated (b, s, ...) tensor: no communication."""
    return split_along(x, SEQ, group)


# ------------------------------------------------------------------ saved activations

def activation_bytes_per_layer(s: int, b: int, h: int, f: int, a: int, tp: int = 1,
                               mode: str = "tp", bytes_per_float: int = 4) -> int:
    """Bytes one TinyLlama block saves for backward on one rank (eager attention).

    Per layer, in floats: norms 2·(2sbh + sb) [input, x·rstd, rstd]; norm outputs, the
    column matmuls' input, 2sbh; attention q, k, v (after the GQA repeat), its output 4sbh
    and softmax a·s²·b; SwiGLU gate, silu, up, product 4·s·b·f; plus the s×s causal mask
    (bool, 1 byte). mode "tp": norms and their outputs replicated, the rest /tp;
    "tp+sp": all /tp but the mask; "tp+sp-gathered" (regather=False): the norm outputs
    replicated, the rest /tp. tp=1 is the single process."""
    replicated_floats = {"tp": 6 * s * b * h + 2 * s * b, "tp+sp": 0,
                         "tp+sp-gathered": 2 * s * b * h}
    if mode not in replicated_floats:
        raise ValueError(f"mode must be one of {sorted(replicated_floats)}, not {mode!r}")
    total = 10 * s * b * h + 4 * s * b * f + 2 * s * b + a * b * s * s
    rep = replicated_floats[mode]
    for name, value in (("s", s), ("f", f), ("a", a)):
        if value % tp:
            raise ValueError(f"tp={tp} must divide {name}={value}")
    return bytes_per_float * (rep + (total - rep) // tp) + s * s


def korthikanti_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022, 16-bit with dropout: s·b·h·(10 + 24/t) + 5·a·s²·b/t for TP,
    s·b·h·34/t + 5·a·s²·b/t for TP+SP."""
    core = 34 / tp if sp else 10 + 24 / tp
    return s * b * h * core + 5 * a * s * s * b / tp
