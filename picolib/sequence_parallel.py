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
added after the reduce-scatter) now see only s/tp tokens per rank, so their gradients
are summed over the group once per step (`SPLlama.finalize_grads`).

`regather=True` (Megatron's choice, Korthikanti §4.2.2): the column matmuls entering a
TP region save only this rank's s/tp slice of their input and all-gather it again in
backward (overlapped with the input-gradient matmul). Every saved activation is then
1/tp (the s·b·h·34/t formula), for one extra all-gather per region in backward.
`regather=False` saves the gathered input: backward moves exactly TP's bytes, but the
norm outputs (2·s·b·h per layer) stay replicated.

Tensors are (b, s, h) as in picolib.model; rank r holds tokens [r·s/tp, (r+1)·s/tp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm
from .mappings import (all_gather_to_region, gather_along, reduce_scatter_along,
                       reduce_scatter_to_region, split_along)
from .model import RMSNorm
from .tensor_parallel import RowParallelLinear, TPLlama, check_tensor_parallel

__all__ = ["all_gather_sequence", "reduce_scatter_sequence_nograd", "reduce_scatter_sequence",
           "gather_sequence", "split_sequence", "gathered_matmuls", "regathered_matmuls", "SPLlama",
           "sequence_parallel_llama", "activation_bytes_per_layer", "korthikanti_bytes_per_layer"]


# ------------------------------------------------------------------ moving along the sequence

SEQ = 1   # the sequence dimension of (b, s, h); picolib.mappings does the moving


def all_gather_sequence(x, group=None, async_op=False):
    """(b, s/tp, h) on each rank → (b, s, h), no autograd. With async_op: (work, finish)."""
    return gather_along(x, SEQ, group, async_op)


def reduce_scatter_sequence_nograd(x, group=None):
    """(b, s, h) partial sums on each rank → this rank's (b, s/tp, h) of the total."""
    return reduce_scatter_along(x, SEQ, group)


def split_sequence(x, group=None):
    """This rank's slice of a replicated (b, s, ...) tensor: no communication."""
    return split_along(x, SEQ, group)


def gather_sequence(x, group=None):
    """Entering a TP region: all-gather forward, reduce-scatter backward."""
    return all_gather_to_region(x, SEQ, group)


def reduce_scatter_sequence(x, group=None):
    """Leaving a TP region: reduce-scatter forward, all-gather backward."""
    return reduce_scatter_to_region(x, SEQ, group)


# ------------------------------------------------------------------ entering a TP region

def gathered_matmuls(x, weights, group=None):
    """All-gather the sequence once, then every column matmul (autograd saves the gathered x)."""
    x = gather_sequence(x, group)
    return [F.linear(x, w) for w in weights]


class _RegatheredMatmuls(torch.autograd.Function):
    """The same, saving only the local (b, s/tp, h) slice; backward all-gathers it again."""

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


# ------------------------------------------------------------------ the model

class SPLlama(TPLlama):
    """TinyLlama, tensor + sequence parallel over `group`. Takes the whole (b, s) tokens on
    every rank; blocks run on s/tp tokens between the TP regions; forward returns the
    vocab slice of the logits for all s tokens, so `loss` is TP's vocab-parallel loss.
    Call `finalize_grads()` after backward (sums the norm-weight and row-bias gradients)."""

    def __init__(self, model, group=None, regather: bool = True):
        enter = regathered_matmuls if regather else gathered_matmuls
        super().__init__(model, group, enter=enter, leave=reduce_scatter_sequence,
                         embed_reduce=reduce_scatter_sequence)
        self.regather = regather

    def forward(self, tokens):
        check_tensor_parallel(self.cfg, self.tp, seq_len=tokens.shape[1])
        return super().forward(tokens)

    def sequence_parallel_params(self):
        """Replicated parameters used on this rank's s/tp tokens only: the norm weights and
        the row-parallel biases (added after the reduce-scatter). Their gradients are partial."""
        norms = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        return norms + [m.bias for m in self.modules()
                        if isinstance(m, RowParallelLinear) and m.bias is not None]

    def finalize_grads(self):
        """One all-reduce of the partial gradients above (each rank saw s/tp tokens)."""
        grads = [p.grad for p in self.sequence_parallel_params() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=self.group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))


def sequence_parallel_llama(model, group=None, regather: bool = True) -> SPLlama:
    """The TP+SP form of a TinyLlama on `group` (checks the sizes first)."""
    check_tensor_parallel(model.cfg, dist.get_world_size(group))
    return SPLlama(model, group, regather)


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
