"""The mappings: where a tensor-parallel region begins and ends (lessons 04 and 05).

Megatron-LM calls them "mappings": small autograd functions that move an activation into
or out of a region split over a process group. Each comes with its *conjugate*: the
forward of one is the backward of the other, because the gradient of a linear map is
its transpose. Three pairs, each with an explicit `group` (and a `dim` where it splits
or gathers):

    copy_to_region         identity                      | all-reduce the gradient
    reduce_from_region     all-reduce                    | identity                  (lesson 04: f, g)

    scatter_to_region      keep this rank's slice of dim | all-gather the gradient
    gather_from_region     all-gather along dim          | keep this rank's slice    (lesson 04: logits)

    reduce_scatter_to_region  reduce-scatter along dim   | all-gather the gradient
    all_gather_to_region      all-gather along dim       | reduce-scatter the gradient (lesson 05: SP)

A `Region` names the pair a layer uses: tensor parallelism enters with f and leaves with
g; sequence parallelism enters with an all-gather and leaves with a reduce-scatter.

`copy_to_replicas` is f for a weight slice that only some ranks share (a KV head
replicated when tp > KV heads): its backward sums the gradients of those ranks alone.

Read a pair as "what one rank holds before → after": copy/reduce for a replicated input
and a partial-sum output (tensor parallelism), scatter/gather for a tensor cut along
`dim` without sums, reduce-scatter/all-gather for partial sums that stay cut along the
sequence (sequence parallelism: all-reduce = reduce-scatter + all-gather).

The file opens with the pairs the lessons read (f and g; the sequence pair; f for replicas);
the machinery follows: `Region`, and the communication-only helpers `gather_along`,
`reduce_scatter_along`, `split_along` (no autograd) and `shard` (a weight slice), which the
technique files share. Every byte goes through `picolib.comm`, so a `Ledger` counts it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import comm

__all__ = ["Region", "shard", "split_along", "gather_along", "reduce_scatter_along",
           "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
           "reduce_scatter_to_region", "all_gather_to_region", "copy_to_replicas"]


# ------------------------------------------------------------------ f and g (lesson 04)

class _CopyToRegion(torch.autograd.Function):
    """f: forward identity (every rank already holds x), backward all-reduce (sum the grads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: forward all-reduce (sum the partial outputs), backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_region(x, group=None):
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group=None):
    return _ReduceFromRegion.apply(x, group)


# ------------------------------------------------------------------ the sequence pair (lesson 05)

class _AllGatherToRegion(torch.autograd.Function):
    """Forward all-gather along dim, backward reduce-scatter the gradient (each rank's
    gradient is a partial sum over the features it holds)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Forward reduce-scatter along dim, backward all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.dim, ctx.group), None, None


def all_gather_to_region(x, dim: int, group=None):
    return _AllGatherToRegion.apply(x, dim, group)


def reduce_scatter_to_region(x, dim: int, group=None):
    return _ReduceScatterToRegion.apply(x, dim, group)


# ------------------------------------------------------------------ f for a slice some ranks share

class _CopyToReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks in the same `slot` (one
    all-reduce over the whole group of an (n_slots, ...) buffer, zero but in this slot)."""

    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.slot, ctx.n_slots, ctx.group = slot, n_slots, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.new_zeros((ctx.n_slots,) + tuple(grad.shape))
        buf[ctx.slot] = grad
        comm.all_reduce(buf, group=ctx.group)
        return buf[ctx.slot].clone(), None, None, None


def copy_to_replicas(w, slot: int, n_slots: int, group=None):
    """f for a tensor that the ranks of `slot` (one of `n_slots`) hold alike."""
    return _CopyToReplicas.apply(w, slot, n_slots, group)


# ------------------------------------------------------------------ slices along a dim

class _ScatterToRegion(torch.autograd.Function):
    """Forward keep this rank's slice along dim, backward all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """Forward all-gather along dim, backward keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.dim, ctx.group), None, None


def scatter_to_region(x, dim: int, group=None):
    return _ScatterToRegion.apply(x, dim, group)


def gather_from_region(x, dim: int, group=None):
    return _GatherFromRegion.apply(x, dim, group)


# ------------------------------------------------------------------ the machinery: regions, slices, collectives

class Region(NamedTuple):
    """How activations enter and leave a tensor-parallel region.
    `enter(x, weights, group)`: the entry operator, then the column-parallel matmuls;
    `leave(y, group)`: the exit operator on the row-parallel partial sums;
    `sequence_split`: outside the region a rank holds s/tp tokens (sequence parallelism)."""
    enter: Callable
    leave: Callable
    sequence_split: bool


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of {x.dim()} dims")
    return dim % x.dim()


def _check_split(size: int, dim: int, world: int) -> None:
    if size % world:
        raise ValueError(f"cannot split size {size} (dim {dim}) into {world} equal shards")


def shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Slice `rank` of `world` equal slices of `t` along `dim` (a detached copy: a weight shard)."""
    _check_split(t.shape[dim], dim, world)
    return t.chunk(world, dim)[rank].detach().clone()


def split_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's slice of `x` along `dim`: no communication (autograd flows through)."""
    n, r, dim = dist.get_world_size(group), dist.get_rank(group), _dim(x, dim)
    _check_split(x.shape[dim], dim, n)
    return x.chunk(n, dim)[r].contiguous()


def gather_along(x: torch.Tensor, dim: int, group=None, async_op: bool = False):
    """Concatenate every rank's `x` along `dim`, in rank order (one comm.all_gather).
    With async_op: (work, finish); call finish() after work.wait()."""
    n, dim, x = dist.get_world_size(group), _dim(x, dim), x.contiguous()
    buf = x.new_empty((n * x.numel(),))            # comm.all_gather stacks ranks along dim 0
    work = comm.all_gather(buf, x.view(-1), group=group, async_op=async_op)

    def finish():
        shape = x.shape[:dim] + (n * x.shape[dim],) + x.shape[dim + 1:]
        return buf.view(n, *x.shape).movedim(0, dim).reshape(shape)
    return (work, finish) if async_op else finish()


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's slice along `dim` (one comm.reduce_scatter)."""
    n, dim = dist.get_world_size(group), _dim(x, dim)
    _check_split(x.shape[dim], dim, n)
    blocks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = x.new_empty((blocks[0].numel(),))
    comm.reduce_scatter(out, blocks.view(-1), group=group)
    return out.view(blocks.shape[1:])
