"""Lesson 03's checks accept right answers and reject wrong ones (each with a reason)."""
import re
import contextlib
import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading import (ExerciseFailed, check_shard_bounds, check_zero1_step,
                             check_zero_memory)
from picolib.zero import shard_bounds, zero_memory_bytes


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def test_shard_bounds_right_and_wrong():
    check_shard_bounds(shard_bounds)

    def floor_division(numel, n, rank):        # forgets the padding: loses the tail
        size = numel // n
        return rank * size, (rank + 1) * size

    with fails("numel=10, n=4"):
        check_shard_bounds(floor_division)

    def unwritten(numel, n, rank):
        raise NotImplementedError

    with fails("not written yet"):
        check_shard_bounds(unwritten)


def test_zero_memory_right_and_wrong():
    check_zero_memory(lambda stage, psi, n, k: zero_memory_bytes(stage, psi, n, k, param_bytes=2))

    def stage2_keeps_full_grads(stage, psi, n, k):
        return zero_memory_bytes(min(stage, 1) if stage == 2 else stage, psi, n, k, param_bytes=2)

    with fails("stage=2"):
        check_zero_memory(stage2_keeps_full_grads)

    def no_padding(stage, psi, n, k):
        shard = psi / n
        return {"params": 2 * (shard if stage == 3 else psi), "grads": 2 * (psi if stage <= 1 else shard),
                "optimizer": k * (psi if stage == 0 else shard)}

    with fails("Ψ=10, N=4"):
        check_zero_memory(no_padding)


def zero1_right(param, grad, lr, group=None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    size = -(-param.numel() // n)
    g = torch.zeros(size * n)
    g[:grad.numel()] = grad
    mine = torch.empty(size)
    comm.reduce_scatter(mine, g, op="avg", group=group)
    w = torch.zeros(size * n)
    w[:param.numel()] = param
    shard = w[rank * size:(rank + 1) * size] - lr * mine
    out = torch.empty(size * n)
    comm.all_gather(out, shard, group=group)
    return out[:param.numel()]


def zero1_with_all_reduce(param, grad, lr, group=None):
    """Right values, plain DP's traffic: the check must notice."""
    g = grad.clone()
    comm.all_reduce(g, op="avg", group=group)
    return param - lr * g


def zero1_sum_not_mean(param, grad, lr, group=None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    size = -(-param.numel() // n)
    g = torch.zeros(size * n)
    g[:grad.numel()] = grad
    mine = torch.empty(size)
    comm.reduce_scatter(mine, g, op="sum", group=group)
    w = torch.zeros(size * n)
    w[:param.numel()] = param
    out = torch.empty(size * n)
    comm.all_gather(out, w[rank * size:(rank + 1) * size] - lr * mine, group=group)
    return out[:param.numel()]


def test_zero1_step_right_and_wrong():
    check_zero1_step(zero1_right)
    with fails("used all_reduce"):
        check_zero1_step(zero1_with_all_reduce)
    with fails("new parameters"):
        check_zero1_step(zero1_sum_not_mean)


# ---------------------------------------------------------------- ZeRO-2 and ZeRO-3 by hand
from picolib.grading.lesson03 import check_gather_unit, check_reduce_scatter_gradients  # noqa: E402


def rs_right(grads, group=None):
    n = dist.get_world_size(group)
    flat = torch.cat([g.flatten() for g in grads])
    size = -(-flat.numel() // n)
    padded = torch.zeros(size * n)
    padded[:flat.numel()] = flat
    mine = torch.empty(size)
    comm.reduce_scatter(mine, padded, op="avg", group=group)
    return mine


def rs_sum(grads, group=None):
    n = dist.get_world_size(group)
    flat = torch.cat([g.flatten() for g in grads])
    padded = torch.zeros(-(-flat.numel() // n) * n)
    padded[:flat.numel()] = flat
    mine = torch.empty(padded.numel() // n)
    comm.reduce_scatter(mine, padded, op="sum", group=group)
    return mine


def rs_all_reduce(grads, group=None):
    """The mean gradient, whole: plain DP's answer, not ZeRO-2's."""
    flat = torch.cat([g.flatten() for g in grads])
    comm.all_reduce(flat, op="avg", group=group)
    return flat


def test_reduce_scatter_gradients_right_and_wrong():
    check_reduce_scatter_gradients(rs_right)
    with fails(r"N=2, every rank \(6 cases like this one\): unit 0 .* 2× too large: a sum where a mean"):
        check_reduce_scatter_gradients(rs_sum)
    with fails("the whole gradient; return only this rank's shard"):
        check_reduce_scatter_gradients(rs_all_reduce)
    with fails("not written yet"):
        check_reduce_scatter_gradients(lambda grads, group=None: (_ for _ in ()).throw(NotImplementedError))


def gather_right(shard, shapes, group=None):
    n = dist.get_world_size(group)
    full = torch.empty(n * shard.numel())
    comm.all_gather(full, shard, group=group)
    return _split(full, shapes)


def gather_reversed(shard, shapes, group=None):
    n = dist.get_world_size(group)
    full = torch.empty(n * shard.numel())
    comm.all_gather(full, shard, group=group)
    full = torch.cat(list(full.split(shard.numel()))[::-1])
    return _split(full, shapes)


def gather_keeps_padding(shard, shapes, group=None):
    n = dist.get_world_size(group)
    full = torch.empty(n * shard.numel())
    comm.all_gather(full, shard, group=group)
    return [full]


def _split(full, shapes):
    out, offset = [], 0
    for shape in shapes:
        k = torch.Size(shape).numel()
        out.append(full[offset:offset + k].view(shape))
        offset += k
    return out


def test_gather_unit_right_and_wrong():
    check_gather_unit(gather_right)
    with fails("reverse rank order"):
        check_gather_unit(gather_reversed)
    with fails("drop the .* elements of padding"):
        check_gather_unit(gather_keeps_padding)


def test_shard_bounds_names_floor_division_and_clipping():
    with fails(r"numel=10, n=4: got \[.*\] — ⌊numel/n⌋ per shard"):
        check_shard_bounds(lambda numel, n, r: (r * (numel // n), (r + 1) * (numel // n)))
    with fails("the shards stop at numel"):
        check_shard_bounds(lambda numel, n, r: (min(r * -(-numel // n), numel),
                                                        min((r + 1) * -(-numel // n), numel)))
