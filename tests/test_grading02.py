"""Lesson 02 checks: each accepts a correct answer and rejects wrong ones."""
import contextlib

import pytest
import torch.distributed as dist

from picolib import comm
from picolib.grading import (ExerciseFailed, check_accumulate_and_step, check_assign_buckets,
                             check_average_gradients, check_grad_accumulation_steps)


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
    with pytest.raises(ExerciseFailed, match=r"cap=8: got buckets \[\[0, 1\], \[2, 3\], \[4\]\], "
                       r"expected \[\[0, 1\], \[2\], \[3\], \[4\]\] — bucket \[2, 3\] holds 14 bytes"):
        check_assign_buckets(buckets_close_after_passing_the_cap)
    with pytest.raises(ExerciseFailed, match="the right buckets in reverse order"):
        check_assign_buckets(lambda nbytes, cap: buckets_right(nbytes, cap)[::-1])
    with pytest.raises(ExerciseFailed, match="not written yet"):
        check_assign_buckets(lambda nbytes, cap: (_ for _ in ()).throw(NotImplementedError))


def grad_acc_right(gbs, mbs, dp):
    if gbs % (mbs * dp):
        raise ValueError("not a whole number of steps")
    return gbs // (mbs * dp)


def test_check_grad_accumulation_steps():
    check_grad_accumulation_steps(grad_acc_right)
    with pytest.raises(ExerciseFailed, match="dp=12: returned 42"):
        check_grad_accumulation_steps(lambda gbs, mbs, dp: gbs // (mbs * dp))
    with pytest.raises(ExerciseFailed, match="dp=512: got 4, expected 1"):  # dp fixed at 128
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


def test_check_average_gradients():
    check_average_gradients(average_right)
    with pytest.raises(ExerciseFailed, match="N=2, every rank: .* 2× too large: a sum where a mean"):
        check_average_gradients(sum_only)
    with pytest.raises(ExerciseFailed, match="no picolib.comm.all_reduce"):
        check_average_gradients(average_with_torch_directly)


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
    with pytest.raises(ExerciseFailed, match="all-reduces for 2 micro-batches"):
        check_accumulate_and_step(accumulate_syncing_every_time)
    with pytest.raises(ExerciseFailed, match="gradient at the step: .* 2× too large"):
        check_accumulate_and_step(accumulate_without_scaling)
