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

    with fails("stage=2.*this is stage 1's memory, not stage 2's \\(a stage off by one\\)"):
        check_zero_memory(stage2_keeps_full_grads)

    def no_padding(stage, psi, n, k):
        shard = psi / n
        return {"params": 2 * (shard if stage == 3 else psi), "grads": 2 * (psi if stage <= 1 else shard),
                "optimizer": k * (psi if stage == 0 else shard)}

    with fails("Ψ=10, N=4, k=12: no padding"):
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
    with fails("2× too large: a sum where a mean"):
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
    # 4 units on 4 ranks, less the 5-element unit's last shard: all padding, 0 either way
    with fails(r"N=4, every rank \(15 cases like this one\): unit 0 .* 4× too large: a sum where a mean"):
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


# ---------------------------------------------------------------- issue 37: each mistake named
import torch.nn.functional as F  # noqa: E402


def zero1_padded_with_F(param, grad, lr, group=None):
    """Right, written differently: F.pad, a summing reduce-scatter divided afterwards."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -param.numel() % n
    g, w = F.pad(grad, (0, pad)), F.pad(param, (0, pad))
    mine = torch.empty(g.numel() // n)
    comm.reduce_scatter(mine, g, op="sum", group=group)
    shard = w.chunk(n)[r] - lr * mine / n
    out = torch.empty_like(w)
    comm.all_gather(out, shard, group=group)
    return out[:param.numel()]


def zero1_on_the_world(param, grad, lr, group=None):
    return zero1_right(param, grad, lr, None)


def zero1_own_gradient(param, grad, lr, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -param.numel() % n
    mine = torch.empty((param.numel() + pad) // n)
    comm.reduce_scatter(mine, F.pad(grad, (0, pad)), op="avg", group=group)   # result unused
    w = F.pad(param - lr * grad, (0, pad))
    out = torch.empty_like(w)
    comm.all_gather(out, w.chunk(n)[r], group=group)
    return out[:param.numel()]


def zero1_no_gather(param, grad, lr, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -param.numel() % n
    mine = torch.empty((param.numel() + pad) // n)
    comm.reduce_scatter(mine, F.pad(grad, (0, pad)), op="avg", group=group)
    return F.pad(param, (0, pad)).chunk(n)[r] - lr * mine


def zero1_shard_only(param, grad, lr, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -param.numel() % n
    mine = torch.empty((param.numel() + pad) // n)
    comm.reduce_scatter(mine, F.pad(grad, (0, pad)), op="avg", group=group)
    w = F.pad(param, (0, pad))
    w.chunk(n)[r].sub_(lr * mine)
    comm.all_gather(torch.empty_like(w), w.chunk(n)[r], group=group)   # gathered, then dropped
    return w[:param.numel()]


def test_zero1_step_names_each_mistake():
    check_zero1_step(zero1_padded_with_F)
    with fails(r"N=2, every rank: 11 elements: the gradient your step applied .* 2× too large: "
               "a sum where a mean"):
        check_zero1_step(zero1_sum_not_mean)
    with fails(r"group of 2 in \[\[0, 2\], \[1, 3\]\], every rank: the group of your all_gather "
               "is that of all 4 ranks, not of `group`"):
        check_zero1_step(zero1_on_the_world)
    with fails("each shard was updated with its rank's own gradient — reduce-scatter"):
        check_zero1_step(zero1_own_gradient)
    with fails("returned 6 elements, this rank's shard — all-gather the updated shards"):
        check_zero1_step(zero1_no_gather)
    with fails("only this rank's shard was updated — all-gather"):
        check_zero1_step(zero1_shard_only)
    with fails("used all_reduce — ZeRO-1 reduce-scatters"):
        check_zero1_step(zero1_with_all_reduce)


def rs_with_F(grads, group=None):
    """Right, written differently: F.pad and a summing reduce-scatter divided afterwards."""
    n = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = F.pad(flat, (0, -flat.numel() % n))
    mine = torch.empty(flat.numel() // n)
    comm.reduce_scatter(mine, flat, group=group)
    return mine / n


def rs_reversed(grads, group=None):
    return rs_right(grads[::-1], group)


def rs_on_the_world(grads, group=None):
    return rs_right(grads, None)


def test_reduce_scatter_gradients_names_each_mistake():
    check_reduce_scatter_gradients(rs_with_F)
    with fails("the gradients were flattened in reverse order — keep the order given"):
        check_reduce_scatter_gradients(rs_reversed)
    with fails(r"group of 2 in \[\[0, 2\], \[1, 3\]\], every rank .*the shard is that of all 4 "
               "ranks, not of `group`"):
        check_reduce_scatter_gradients(rs_on_the_world)


def gather_with_a_list(shard, shapes, group=None):
    """Right, written differently: a list of shards, torch.cat, split by sizes."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    for r, p in enumerate(parts):
        out = torch.empty(len(parts) * shard.numel())
        if r == 0:
            comm.all_gather(out, shard, group=group)
            full = out
    sizes = [torch.Size(s).numel() for s in shapes]
    return [t.reshape(s) for t, s in zip(full[:sum(sizes)].split(sizes), shapes)]


def gather_on_the_world(shard, shapes, group=None):
    return gather_right(shard, shapes, None)


def test_gather_unit_names_each_mistake():
    check_gather_unit(gather_with_a_list)
    with fails(r"group of 2 in \[\[0, 2\], \[1, 3\]\], every rank .*the gather is that of all 4 "
               "ranks, not of `group`"):
        check_gather_unit(gather_on_the_world)


# ---------------------------------------------------------------- issue 37: 03.2's mistakes
def zero_memory_variant(shift=0, k_fixed=None, value_bytes=2):
    """Memory per rank with one slip: the stage shifted by `shift`, k replaced, fp32 values.
    Written by which parts each stage shards, not as the solution does."""
    def memory(stage, psi, n, k):
        st, k = stage + shift, k_fixed or k
        count = psi if stage == 0 else n * -(-psi // n)
        part = {key: count // n if st >= first else count
                for key, first in (("optimizer", 1), ("grads", 2), ("params", 3))}
        return {"params": value_bytes * part["params"], "grads": value_bytes * part["grads"],
                "optimizer": k * part["optimizer"]}
    return memory


def test_zero_memory_right_written_by_parts():
    check_zero_memory(zero_memory_variant())


@pytest.mark.parametrize("fn, pattern", [
    (zero_memory_variant(shift=-1), "stage=3, .*this is stage 2's memory, not stage 3's \\(a stage off by one\\)"),
    (zero_memory_variant(shift=+1), "stage=0, .*this is stage 1's memory, not stage 0's \\(a stage off by one\\)"),
    (zero_memory_variant(k_fixed=12), "k=8: optimizer with 12 bytes per parameter: use the argument k"),
    (zero_memory_variant(value_bytes=4), "params at 4 bytes per value: bf16 is 2"),
], ids=["stage one too low", "stage one too high", "k fixed at 12", "fp32 values"])
def test_zero_memory_mistakes(fn, pattern):
    with fails(pattern):
        check_zero_memory(fn)


def _ceil_shards(numel, n, rank):
    size = (numel + n - 1) // n
    return rank * size, rank * size + size


@pytest.mark.parametrize("fn, pattern", [
    (lambda numel, n, r: (_ceil_shards(numel, n, r)[0], _ceil_shards(numel, n, r)[1] - 1), "the stop is inclusive"),
    (lambda numel, n, r: _ceil_shards(numel, n, n - 1 - r), "the ranks in reverse order"),
    (lambda numel, n, r: (_ for _ in ()).throw(ValueError("numel must divide by n")) if numel % n
     else _ceil_shards(numel, n, r), "raised ValueError .* never an error"),
], ids=["inclusive stop", "reversed ranks", "raises when not divisible"])
def test_shard_bounds_mistakes(fn, pattern):
    with fails(pattern):
        check_shard_bounds(fn)
    check_shard_bounds(_ceil_shards)     # right, written differently


def zero1_gathers_the_gradient(param, grad, lr, group=None):
    """Same values, calls and bytes as ZeRO-1, but every rank steps the whole vector with the
    gathered mean gradient: no rank updates its shard alone or gathers parameters."""
    n = dist.get_world_size(group)
    size = -(-param.numel() // n)
    g = torch.zeros(size * n)
    g[:grad.numel()] = grad
    mine = torch.empty(size)
    comm.reduce_scatter(mine, g, op="avg", group=group)
    mean = torch.empty(size * n)
    comm.all_gather(mean, mine, group=group)
    return param - lr * mean[:param.numel()]


def zero1_step_in_place(param, grad, lr, group=None):
    """Right, written differently: parameters and gradient padded together, the shard stepped
    in place."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    size = -(-param.numel() // n)
    flat = torch.nn.functional.pad(torch.stack([param, grad]), (0, size * n - param.numel()))
    g = torch.empty(size)
    comm.reduce_scatter(g, flat[1].contiguous(), op="avg", group=group)
    shard = flat[0, rank * size:(rank + 1) * size].clone()
    shard.sub_(lr * g)
    out = torch.empty(size * n)
    comm.all_gather(out, shard, group=group)
    return out[:param.numel()]


def test_zero1_step_must_step_the_shard_and_gather_parameters():
    check_zero1_step(zero1_step_in_place)
    with fails("all-gathered the mean gradient and stepped the whole vector on every rank") as info:
        check_zero1_step(zero1_gathers_the_gradient)
    assert len(info.value.problems) == 1, info.value.details


def gather_drops_the_wrong_end(shard, shapes, group=None):
    """Wrong, no known slip: the padding dropped from the front instead of the back."""
    n = dist.get_world_size(group)
    full = torch.empty(n * shard.numel())
    comm.all_gather(full, shard, group=group)
    numel = sum(torch.Size(s).numel() for s in shapes)
    return _split(full[full.numel() - numel:], shapes)


def gather_into_a_list(shard, shapes, group=None):
    """Right, written differently: torch.split by each parameter's size, then reshape."""
    n = dist.get_world_size(group)
    full = torch.empty(n * shard.numel())
    comm.all_gather(full, shard, group=group)
    sizes = [torch.Size(s).numel() for s in shapes]
    pieces = full[:sum(sizes)].split(sizes)
    return [piece.reshape(s) for piece, s in zip(pieces, shapes)]


def test_gather_unit_says_which_parameter_differs():
    check_gather_unit(gather_into_a_list)
    with fails(r"unit \d+ \(\d+ elements\): [a-z_]+[a-z_.\d]*weight: \d+ of \d+ elements wrong, the "
               r"first at \[\d+(, \d+)?\]: got") as info:
        check_gather_unit(gather_drops_the_wrong_end)
    assert "values differ" not in info.value.details


# ---------------------------------------------------------------- issue 60: uneven sizes, one cause per hint
def zero1_chunk_param(param, grad, lr, group=None):
    """Wrong: the shard is torch.chunk's piece of the unpadded parameter, padded afterwards —
    right wherever chunk makes n pieces, an IndexError at 5 elements on 4 ranks (3 pieces)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -param.numel() % n
    mine = torch.empty((param.numel() + pad) // n)
    comm.reduce_scatter(mine, F.pad(grad, (0, pad)), op="avg", group=group)
    shard = param.chunk(n)[r]
    shard = F.pad(shard, (0, mine.numel() - shard.numel())) - lr * mine
    out = torch.empty(mine.numel() * n)
    comm.all_gather(out, shard, group=group)
    return out[:param.numel()]


def zero1_tensor_split(param, grad, lr, group=None):
    """Right, written differently: the padded vectors cut with tensor_split (n pieces always)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    pad = -param.numel() % n
    g_mine = torch.empty((param.numel() + pad) // n)
    comm.reduce_scatter(g_mine, F.pad(grad, (0, pad)), op="avg", group=group)
    shard = F.pad(param, (0, pad)).tensor_split(n)[r] - lr * g_mine
    out = torch.empty(g_mine.numel() * n)
    comm.all_gather(out, shard.contiguous(), group=group)
    return out[:param.numel()]


def test_zero1_step_tries_a_size_chunk_cuts_short():
    check_zero1_step(zero1_tensor_split)
    with fails(r"5 elements on 4 ranks: chunk\(\) cut them into 3 pieces of at most 2, not 4"):
        check_zero1_step(zero1_chunk_param)


def zero_memory_grads_whole_from_stage_2(stage, psi, n, k):
    """Wrong: the gradients never sharded (stages 2 and 3 keep them whole). At N = 2 stage 3's
    gradients are then twice the right value, as fp32 gradients would be: only the other cases
    tell the two apart, and the check names the one that fits them all."""
    right = zero_memory_bytes(stage, psi, n, k, param_bytes=2)
    return {**right, "grads": 2 * (n * -(-psi // n) if stage >= 1 else psi)}


def test_zero_memory_names_the_slip_that_fits_every_case():
    check_zero_memory(zero_memory_variant())                  # right, written by parts
    with fails("grads kept whole, but stage ≥ 2 shards the gradients") as info:
        check_zero_memory(zero_memory_grads_whole_from_stage_2)
    assert "4 bytes per value" not in info.value.details


def gather_column_major(shard, shapes, group=None):
    """Wrong: the gathered buffer read as a (S, N) matrix — element j of every shard together."""
    n = dist.get_world_size(group)
    full = torch.empty(n * shard.numel())
    comm.all_gather(full, shard, group=group)
    return _split(full.view(n, -1).t().reshape(-1), shapes)


def test_gather_unit_names_column_major_not_a_rank_order():
    check_gather_unit(gather_into_a_list)                      # right, written differently
    with fails("read column by column") as info:
        check_gather_unit(gather_column_major)
    assert "rank order" not in info.value.details


def rs_chunk_of_the_unpadded(grads, group=None):
    """Wrong: the output shaped like torch.chunk's piece of the unpadded buffer — an IndexError
    at 5 elements on 4 ranks, and a short last shard wherever numel does not divide."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    mine = torch.empty_like(flat.chunk(n)[r])
    comm.reduce_scatter(mine, F.pad(flat, (0, mine.numel() * n - flat.numel())), op="avg", group=group)
    return mine


def test_reduce_scatter_gradients_tries_an_uneven_tiny_unit():
    check_reduce_scatter_gradients(rs_with_F)                  # right, on the 5-element unit too
    with fails("rank 3 failed"):                               # its short shard: no hang
        check_reduce_scatter_gradients(rs_chunk_of_the_unpadded)
