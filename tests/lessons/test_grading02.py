"""Lesson 02 checks: each accepts a correct answer and rejects wrong ones."""
import re
import contextlib

import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading import (ExerciseFailed, check_accumulate_and_step, check_assign_buckets,
                             check_average_gradients, check_grad_accumulation_steps)


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def buckets_right(nbytes, cap):
    out, size = [], 0
    for i, b in enumerate(nbytes):
        if out and size + b <= cap:
            out[-1].append(i)
            size += b
        else:
            out.append([i])
            size = b
    return out


def buckets_close_after_passing_the_cap(nbytes, cap):
    """torch's rule (close once the bucket has reached the cap), not the lesson's."""
    out, size = [], 0
    for i, b in enumerate(nbytes):
        if not out or size >= cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += b
    return out


def test_check_assign_buckets():
    check_assign_buckets(buckets_right)
    with fails(r"cap=8: got buckets \[\[0, 1\], \[2, 3\], \[4\]\], "
                       r"expected \[\[0, 1\], \[2\], \[3\], \[4\]\] — bucket \[2, 3\] holds 14 bytes"):
        check_assign_buckets(buckets_close_after_passing_the_cap)
    with fails("the right buckets in reverse order"):
        check_assign_buckets(lambda nbytes, cap: buckets_right(nbytes, cap)[::-1])
    with fails("not written yet"):
        check_assign_buckets(lambda nbytes, cap: (_ for _ in ()).throw(NotImplementedError))


def grad_acc_right(gbs, mbs, dp):
    if gbs % (mbs * dp):
        raise ValueError("not a whole number of steps")
    return gbs // (mbs * dp)


def test_check_grad_accumulation_steps():
    check_grad_accumulation_steps(grad_acc_right)
    with fails("dp=12: returned 42"):
        check_grad_accumulation_steps(lambda gbs, mbs, dp: gbs // (mbs * dp))
    with fails("dp=512: got 4, expected 1"):  # dp fixed at 128
        check_grad_accumulation_steps(lambda gbs, mbs, dp: gbs // (mbs * 128))


def average_right(model, group=None):
    n = dist.get_world_size(group)
    for p in model.parameters():
        p.grad /= n
        comm.all_reduce(p.grad, group=group)


def sum_only(model, group=None):
    for p in model.parameters():
        comm.all_reduce(p.grad, group=group)


def average_with_torch_directly(model, group=None):
    n = dist.get_world_size(group)
    for p in model.parameters():
        p.grad /= n
        dist.all_reduce(p.grad, group=group)


def average_on_the_world(model, group=None):
    average_right(model, None)


def average_a_clone(model, group=None):
    n = dist.get_world_size(group)
    for p in model.parameters():
        g = p.grad.clone() / n
        comm.all_reduce(g, group=group)       # the mean, never written back


def test_check_average_gradients():
    check_average_gradients(average_right)
    with fails("N=2, every rank: gradients: 2× the mean: the sum over the 2 ranks — divide by 2"):
        check_average_gradients(sum_only)
    with fails("no picolib.comm.all_reduce"):
        check_average_gradients(average_with_torch_directly)
    with fails(r"group of 2 in \[\[0, 2\], \[1, 3\]\], every rank: the mean is that of all 4 ranks"):
        check_average_gradients(average_on_the_world)
    with fails("never written back into p.grad"):
        check_average_gradients(average_a_clone)


def accumulate(ddp, optimizer, micro_batches, divide=None, zero=True):
    k = len(micro_batches) if divide is None else divide
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            (ddp.module.loss(x, y) / k).backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad()


def accumulate_dividing_by_world_size(ddp, optimizer, micro_batches):
    accumulate(ddp, optimizer, micro_batches, divide=dist.get_world_size())


def accumulate_right(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            (ddp.module.loss(x, y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def accumulate_syncing_every_time(ddp, optimizer, micro_batches):
    for x, y in micro_batches:
        (ddp.module.loss(x, y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def accumulate_without_scaling(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            ddp.module.loss(x, y).backward()
    optimizer.step()


def test_check_accumulate_and_step():
    check_accumulate_and_step(accumulate_right)
    with fails("all-reduces for 2 steps of 3 micro-batches"):
        check_accumulate_and_step(accumulate_syncing_every_time)
    with fails("micro-batch losses were summed"):
        check_accumulate_and_step(accumulate_without_scaling)


@pytest.mark.parametrize("wrong, diagnosis", [
    (lambda d, o, mb: accumulate(d, o, mb, zero=False), "still holds step 1's gradient — zero"),
    (accumulate_dividing_by_world_size, "divided by the 2 ranks instead of the 3 micro-batches"),
    (lambda d, o, mb: accumulate(d, o, mb, divide=2), "divided by 2 whatever the number"),
    (lambda d, o, mb: accumulate(d, o, mb, divide=1), "the 3 micro-batch losses were summed"),
    (lambda d, o, mb: accumulate(d, o, mb[:2]), "gradient at step 1"),   # hard-coded k = 2
], ids=["no zero_grad", "divides by world size", "hard-coded k=2", "no division", "two batches only"])
def test_accumulate_and_step_rejects_each_classic_mistake(wrong, diagnosis):
    with fails(diagnosis):
        check_accumulate_and_step(wrong)


def average_world_sum_over_group_size(model, group=None):
    """Wrong on a sub-group: the sum over every rank, divided by the group's size."""
    m = dist.get_world_size(group)
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= m


def average_by_world_size(model, group=None):
    """Wrong on a sub-group: the group's sum divided by the world's size."""
    for p in model.parameters():
        comm.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size()


def average_flat(model, group=None):
    """Right, written differently: one flat buffer, op="avg", copied back."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    comm.all_reduce(flat, op="avg", group=group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def test_average_gradients_names_the_division_that_is_wrong():
    check_average_gradients(average_flat)
    with fails(r"group of 2 .*: the sum is that of all 4 ranks.*the division by the group's 2 is "
               r"right") as info:
        check_average_gradients(average_world_sum_over_group_size)
    assert "and divide by the group's size" not in info.value.details
    with fails(r"group of 2 .*: gradients: the group's sum divided by the world's 4 ranks, not the "
               r"group's 2") as info:
        check_average_gradients(average_by_world_size)
    assert "divided once too often" not in info.value.details


def test_accumulate_names_both_divisors_where_they_coincide():
    """On 2 ranks × 3 micro-batches, dividing by the ranks and dividing by a fixed 2 give the
    same gradient: that case names both; on 3 ranks × 4 only the fixed 2 fits."""
    with pytest.raises(ExerciseFailed) as info:
        check_accumulate_and_step(lambda d, o, mb: accumulate(d, o, mb, divide=2))
    two, three = info.value.problems
    assert "divided by the 2 ranks" in two and "divided by 2 whatever" in two, two
    assert "ranks instead" not in three and "divided by 2 whatever" in three, three


def test_accumulate_wrong_weights_name_the_parameter():
    def skips_the_last_micro_batch(ddp, optimizer, micro_batches):
        accumulate(ddp, optimizer, micro_batches[:-1] + [micro_batches[-2]])
    with fails(r"gradient at step 1: \d+ of \d+ values wrong, the first [a-z_.\d]+\[[\d, ]+\]: got"):
        check_accumulate_and_step(skips_the_last_micro_batch)
