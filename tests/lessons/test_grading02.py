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


def buckets_starting_with_an_empty_one(nbytes, cap):
    out, size = [[]], 0
    for i, b in enumerate(nbytes):
        if out[-1] and size + b > cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += b
    return out


def buckets_reading_the_first_size_first(nbytes, cap):
    out, size = [[0]], nbytes[0]                   # IndexError when there are no tensors
    for i, b in enumerate(nbytes[1:], 1):
        if size + b <= cap:
            out[-1].append(i)
            size += b
        else:
            out.append([i])
            size = b
    return out


def buckets_by_cumulative_sums(nbytes, cap):
    """Right, written differently: a new bucket whenever the running size would pass the cap."""
    starts, size = [], cap + 1
    for i, b in enumerate(nbytes):
        size = size + b if size + b <= cap else (starts.append(i) or b)
    ends = starts[1:] + [len(nbytes)]
    return [list(range(a, e)) for a, e in zip(starts, ends)]


def test_assign_buckets_empty_input_is_named_as_such():
    """Issue 60: [[]] for no tensors was told "a bucket was closed while the next tensor still
    fitted"; an IndexError escaped as a traceback."""
    check_assign_buckets(buckets_by_cumulative_sums)
    with fails(r"nbytes=\[\], cap=8: got buckets \[\[\]\], expected \[\] — an empty bucket") as info:
        check_assign_buckets(buckets_starting_with_an_empty_one)
    assert "still fitted" not in info.value.details
    with fails(r"nbytes=\[\], cap=8: raised IndexError: list index out of range — with no tensors "
               r"there are no buckets: return \[\]"):
        check_assign_buckets(buckets_reading_the_first_size_first)


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


def grad_acc_asserting(gbs, mbs, dp):
    assert gbs % (mbs * dp) == 0, "not a whole number of steps"
    return gbs // (mbs * dp)


def grad_acc_by_divmod(gbs, mbs, dp):
    """Right, written differently."""
    steps, left = divmod(gbs, mbs * dp)
    if left:
        raise ValueError(f"{left} samples left over")
    return steps


def test_grad_accumulation_steps_an_assert_is_named_not_a_traceback():
    """Issue 60: an `assert` escaped the check as a raw AssertionError traceback."""
    check_grad_accumulation_steps(grad_acc_by_divmod)
    with fails(r"dp=12: raised AssertionError: not a whole number of steps, not the ValueError "
               r"the statement asks for \(an assert is a check for bugs"):
        check_grad_accumulation_steps(grad_acc_asserting)
    with fails(r"gbs=1024, mbs=2, dp=128: raised ZeroDivisionError"):
        check_grad_accumulation_steps(lambda gbs, mbs, dp: gbs // (mbs * dp - 256))


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
            (ddp.module.loss_fn(ddp(x), y) / k).backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad()


def accumulate_dividing_by_world_size(ddp, optimizer, micro_batches):
    accumulate(ddp, optimizer, micro_batches, divide=dist.get_world_size())


def accumulate_right(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            (ddp.module.loss_fn(ddp(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def accumulate_syncing_every_time(ddp, optimizer, micro_batches):
    for x, y in micro_batches:
        (ddp.module.loss_fn(ddp(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def accumulate_without_scaling(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            ddp.module.loss_fn(ddp(x), y).backward()
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


def average_skipping_zero_gradients(model, group=None):
    """Wrong: a per-rank test decides which gradients to all-reduce; rank 1's last bias
    gradient is zero, so rank 1 skips a collective the others call."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad.abs().sum() > 0:
            p.grad /= n
            comm.all_reduce(p.grad, group=group)


def average_the_weights(model, group=None):
    """Wrong: the weights are averaged, not the gradients."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        p.data /= n
        comm.all_reduce(p.data, group=group)


def average_with_op_avg(model, group=None):
    """Right, written differently: op="avg", tensor by tensor."""
    for p in model.parameters():
        comm.all_reduce(p.grad, op="avg", group=group)


def test_average_gradients_skipped_collective_and_weights():
    """Issue 60: skipping a gradient by a per-rank test passed (no case made the ranks
    disagree); averaging the weights was blamed on a clone."""
    check_average_gradients(average_with_op_avg)
    with fails("did not finish on 2 ranks within 8 s — a deadlock"):
        check_average_gradients(average_skipping_zero_gradients, timeout=8)
    with fails(r"N=2, every rank: weights: changed — p \(the weights\) was all-reduced") as info:
        check_average_gradients(average_the_weights)
    assert "clone" not in info.value.details


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


def accumulate_dividing_by_rows(ddp, optimizer, micro_batches):
    accumulate(ddp, optimizer, micro_batches, divide=micro_batches[0][0].shape[0])


def accumulate_zeroing_in_the_loop(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        optimizer.zero_grad()
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            (ddp.module.loss_fn(ddp(x), y) / len(micro_batches)).backward()
    optimizer.step()


def accumulate_bypassing_the_wrapper(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            (ddp.module.loss(x, y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def accumulate_with_the_sync_switch(ddp, optimizer, micro_batches):
    """Right, written differently: FSDP2's switch instead of no_sync(), cross-entropy by hand."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        ddp.set_requires_gradient_sync(i == k - 1)
        logits = ddp(x)
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / k).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_accumulate_rows_zero_grad_and_the_wrapper():
    """Issue 60: dividing by a micro-batch's rows got "divided by 2 whatever"; zero_grad() in
    the loop had no hint (lesson 01.4 has one); a forward bypassing the wrapper passed."""
    check_accumulate_and_step(accumulate_with_the_sync_switch)
    with fails(r"divided by its rows \(x.shape\[0\] = 10\)") as info:
        check_accumulate_and_step(accumulate_dividing_by_rows)
    assert "whatever" not in info.value.details
    with fails(r"only the last micro-batch's — zero_grad\(\) \(or a .grad reset\) inside the loop"):
        check_accumulate_and_step(accumulate_zeroing_in_the_loop)
    with fails(r"forward: 0 of 6 forwards went through the wrapper — call ddp\(tokens\)"):
        check_accumulate_and_step(accumulate_bypassing_the_wrapper)


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
