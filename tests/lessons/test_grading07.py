"""Lesson 07 checks: each accepts a correct answer and rejects wrong ones."""
import re
import contextlib
import pytest

from picolib.grading import (ExerciseFailed, check_afab_stage, check_broken_schedules, check_bubble,
                             check_one_f_one_b)
from picolib.pipeline_schedules import Op, Schedule


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def one_f_one_b_ops(rank, p, m, warm_extra=0):
    warm = min(p - 1 - rank + warm_extra, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("BW", i)]
    return ops + [("BW", i) for i in range(m - warm, m)]


def afab_ops(rank, p, m):
    return [("F", i) for i in range(m)] + [("BW", i) for i in range(m)]


def test_one_f_one_b_check():
    check_one_f_one_b(one_f_one_b_ops)
    with fails("rank 0, p=1, m=2: got F0 F1 BW0 BW1, expected F0 BW0 F1 BW1"):
        check_one_f_one_b(lambda r, p, m: one_f_one_b_ops(r, p, m, warm_extra=1))  # p−r warm-up
    with pytest.raises(ExerciseFailed):
        check_one_f_one_b(afab_ops)                       # valid, but not 1F1B
    with fails("not written yet"):
        check_one_f_one_b(lambda r, p, m: (_ for _ in ()).throw(NotImplementedError()))


def test_bubble_check():
    check_bubble(lambda p, m, v=1: (p - 1) / (v * m))
    with fails("bubble"):
        check_bubble(lambda p, m, v=1: (p - 1) / (m + p - 1))   # fraction of the total, not of ideal
    with fails("v=2"):
        check_bubble(lambda p, m, v=1: (p - 1) / m)            # forgets interleaving


GOOD0 = [Op("F", 0, 0), Op("F", 0, 1), Op("BW", 0, 0), Op("BW", 0, 1)]
GOOD1 = [Op("F", 1, 0), Op("BW", 1, 0), Op("F", 1, 1), Op("BW", 1, 1)]


def broken(reason):
    r0, r1 = list(GOOD0), list(GOOD1)
    if reason == "missing":
        r0 = r0[:-1]
    elif reason == "B before F":
        r1 = [Op("BW", 1, 0), Op("F", 1, 0), Op("F", 1, 1), Op("BW", 1, 1)]
    elif reason == "W before B":
        r0 = [Op("F", 0, 0), Op("F", 0, 1), Op("W", 0, 0), Op("B", 0, 0), Op("BW", 0, 1)]
    elif reason == "deadlock":
        r0 = [Op("F", 0, 0), Op("BW", 0, 0), Op("F", 0, 1), Op("BW", 0, 1)]
        r1 = [Op("F", 1, 0), Op("F", 1, 1), Op("BW", 1, 1), Op("BW", 1, 0)]
    return Schedule(reason, 2, (0, 1), [r0, r1])


def test_broken_schedules_check():
    check_broken_schedules(broken)
    with fails("accepts"):
        check_broken_schedules(lambda reason: Schedule("fine", 2, (0, 1), [GOOD0, GOOD1]))
    with fails("'deadlock'"):
        # a missing op is rejected, but not as a deadlock
        check_broken_schedules(lambda reason: broken("missing" if reason == "deadlock" else reason))
    with fails("expected a Schedule"):
        check_broken_schedules(lambda reason: [GOOD0, GOOD1])


def broken_twice(reason):
    """Each schedule broken as asked, and in a second way too (the validator stops at one)."""
    s = broken(reason)
    if reason == "missing":
        s.ops[1] = s.ops[1][:-1]                        # two ops missing
    elif reason == "B before F":
        s.ops[0] = [Op("BW", 0, 0), Op("F", 0, 0), Op("F", 0, 1), Op("BW", 0, 1)]
    elif reason == "W before B":
        s.ops[1] = [Op("F", 1, 0), Op("W", 1, 0), Op("B", 1, 0), Op("F", 1, 1),
                    Op("W", 1, 1), Op("B", 1, 1)]
    return s


def test_broken_schedules_rejects_a_schedule_broken_in_two_ways():
    with fails("'missing': broken in more than one way"):
        check_broken_schedules(broken_twice)
    with fails("'W before B': broken in more than one way"):
        check_broken_schedules(broken_twice)


# --- one stage of AFAB on real ranks ------------------------------------------------------------

def afab_stage(stage, rank, p, tokens, targets, divide=True, loss_everywhere=False, leaf=True):
    """The solution, with switches that plant one mistake each."""
    import torch
    from picolib import comm
    m, saved, loss = len(tokens), [], None
    for mb in range(m):
        if rank == 0:
            x = tokens[mb]
        else:
            x = torch.empty(stage.hidden_shape(*tokens[mb].shape))
            comm.recv(x, rank - 1)
            if leaf:
                x.requires_grad_()
        y = stage(x)
        if rank == p - 1:
            y = stage.loss_fn(y, targets[mb]) / (m if divide else 1)
            loss = y.detach() if loss is None else loss + y.detach()
        else:
            comm.send(y.detach(), rank + 1)
            if loss_everywhere:
                loss = y.detach().sum()
        saved.append((x, y))
    for x, y in saved:
        dy = None
        if rank < p - 1:
            dy = torch.empty_like(y)
            comm.recv(dy, rank + 1)
        torch.autograd.backward(y, dy)
        if rank > 0:
            comm.send(x.grad, rank - 1)
    return loss


def afab_by_the_library(stage, rank, p, tokens, targets):
    """A right answer written differently: picolib's own executor."""
    from picolib.pipeline_parallel import run_schedule
    from picolib.pipeline_schedules import afab
    return run_schedule(afab(p, len(tokens)), {rank: stage}, tokens, targets)["loss"]


def test_afab_stage_check_accepts_right_answers():
    check_afab_stage(afab_stage)
    check_afab_stage(afab_by_the_library)


def test_afab_stage_check_rejects_wrong_answers():
    with fails(r"p=2, 3 layers, m=3, rank 0: ∂ℒ/∂embed.weight: .*every value is 3× too large"):
        check_afab_stage(lambda *a: afab_stage(*a, divide=False))          # the loss not divided by m
    with fails(r"p=2, 3 layers, m=3, rank 0: returned a loss — only the last stage computes it"):
        check_afab_stage(lambda *a: afab_stage(*a, loss_everywhere=True))
    with fails(r"raised in afab_stage, line \d+: comm.send\(x.grad, rank - 1\)"):   # x not a leaf: x.grad is None
        check_afab_stage(lambda *a: afab_stage(*a, leaf=False))
    with fails(r"not written yet"):
        check_afab_stage(lambda *a: (_ for _ in ()).throw(NotImplementedError()))
