"""Lesson 00 checks: each accepts a correct answer and rejects a wrong one."""
import re

import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading import _core as grading_core
from picolib.grading import (ExerciseFailed, check_all_reduce_from_rs_ag, check_ring_all_reduce,
                             check_ring_bytes, check_ring_time)


def ring_all_reduce(tensor, group=None, skip_last_step=False, world=False, copy_back=True,
                    gather_start=1):
    if world:  # the classic slip: the world's ring whatever `group` says
        n, me = dist.get_world_size(), dist.get_rank()
        right, left, group = (me + 1) % n, (me - 1) % n, None
    else:
        n, me, right, left = comm.ring_neighbours(group)
    chunks = list(tensor.view(-1).chunk(n))
    incoming = torch.empty_like(chunks[0])
    steps = n - 2 if skip_last_step else n - 1
    for k in range(steps):  # reduce-scatter
        comm.exchange(sends=[(chunks[(me - k) % n].clone(), right)], recvs=[(incoming, left)],
                      group=group)
        chunks[(me - k - 1) % n] += incoming
    for k in range(n - 1):  # all-gather
        into = chunks[(me - k + gather_start - 1) % n]
        comm.exchange(sends=[(chunks[(me - k + gather_start) % n].clone(), right)],
                      recvs=[(into if copy_back else into.clone(), left)], group=group)
    return tensor


def all_to_everyone(tensor, group=None):
    """Right values, wrong algorithm: every rank sends its whole tensor to every other."""
    n, me = dist.get_world_size(), dist.get_rank()
    bufs = {p: torch.empty_like(tensor) for p in range(n) if p != me}
    comm.exchange(sends=[(tensor.clone(), p) for p in bufs], recvs=list(
        (b, p) for p, b in bufs.items()))
    for b in bufs.values():
        tensor += b
    return tensor


def rs_ag(tensor, group=None, world=False):
    group = None if world else group
    n = dist.get_world_size(group)
    shard = torch.empty(tensor.numel() // n)
    comm.reduce_scatter(shard, tensor, group=group)
    out = torch.empty_like(tensor)
    comm.all_gather(out, shard, group=group)
    return out


def native_all_reduce(tensor, group=None):
    comm.all_reduce(tensor, group=group)
    return tensor


def shard_only(tensor, group=None):
    shard = torch.empty(tensor.numel() // dist.get_world_size(group))
    comm.reduce_scatter(shard, tensor, group=group)
    return shard


def gathered_not_returned(tensor, group=None):
    rs_ag(tensor.clone(), group)
    return tensor


def failure(check, fn, **kwargs) -> str:
    """Every problem line of a failing check, joined (what the student is shown first)."""
    with pytest.raises(ExerciseFailed) as info:
        check(fn, **kwargs)
    assert len(str(info.value).splitlines()) == 1, "the exception repeats the printed lines"
    return "\n".join(info.value.problems)


def ring_bytes(op, nbytes, n):
    return nbytes * (n - 1) // n * (2 if op == "all_reduce" else 1)


def ring_time(op, nbytes, n, alpha, bandwidth):
    k = 2 if op == "all_reduce" else 1
    return k * (n - 1) * alpha + k * nbytes * (n - 1) / n / bandwidth


def test_ring_all_reduce_accepts_a_ring_on_the_world_and_on_a_sub_group():
    check_ring_all_reduce(ring_all_reduce)


@pytest.mark.parametrize("wrong, diagnosis", [
    (lambda t, group=None: ring_all_reduce(t, group, world=True),
     r"group of 2 in \[\[0, 2\], \[1, 3\]\], every rank: result is that of all 4 ranks, not of `group`"),
    (lambda t, group=None: ring_all_reduce(t, group, skip_last_step=True),
     "N=2, every rank: sent 24 bytes.*all-gather steps are missing"),
    (all_to_everyone, "N=3, every rank: sent 96 bytes.*the whole tensor to every other rank"),
    (lambda t, group=None: ring_all_reduce(t, group, copy_back=False),
     "holds the sum of 1 of the 2 inputs.*never written into the tensor"),
    (lambda t, group=None: ring_all_reduce(t, group, gather_start=0),
     "chunk index is off by one"),
], ids=["ignores group", "missing step", "not a ring", "not written back", "off by one"])
def test_ring_all_reduce_names_each_wrong_answer(wrong, diagnosis):
    assert re.search(diagnosis, failure(check_ring_all_reduce, wrong))


def test_ring_all_reduce_turns_a_deadlock_into_a_failure_naming_the_line(no_leftover_workers):
    def blocking(tensor, group=None):  # every rank waits for its left neighbour first
        comm.recv(tensor, (dist.get_rank() - 1) % dist.get_world_size())
        return tensor
    text = failure(check_ring_all_reduce, blocking, timeout=3.0)
    assert "deadlock" in text or "waiting" in text
    assert re.search(r"rank 0 was waiting in blocking, line \d+: comm.recv\(tensor", text), text
    assert grading_core.TIMEOUT < 60


def test_all_reduce_from_rs_ag_accepts_rs_ag_and_names_each_wrong_answer():
    check_all_reduce_from_rs_ag(rs_ag)
    assert "exactly one" in failure(check_all_reduce_from_rs_ag, native_all_reduce)
    assert re.search("shape .* is one shard, not the whole sum",
                     failure(check_all_reduce_from_rs_ag, shard_only))
    assert "not of `group`" in failure(check_all_reduce_from_rs_ag,
                                       lambda t, group=None: rs_ag(t, group, world=True))
    assert "never returned" in failure(check_all_reduce_from_rs_ag, gathered_not_returned)


def _one_line(check, fn):
    """The failure message of `check(fn)`: its problem lines (without the title)."""
    with pytest.raises(ExerciseFailed) as info:
        check(fn)
    return info.value.problems


def test_ring_bytes_accepts_the_formula_and_names_each_typical_mistake_in_one_line():
    check_ring_bytes(ring_bytes)
    lines = _one_line(check_ring_bytes, lambda op, b, n: b * (n - 1) // n)
    assert len(lines) == 1 and "all_reduce: half the bytes" in lines[0]
    lines = _one_line(check_ring_bytes, lambda op, b, n: b * (n - 1) * (2 if op == "all_reduce" else 1))
    assert len(lines) == 3 and all("not the whole buffer" in line for line in lines)
    lines = _one_line(check_ring_bytes, lambda op, b, n: 0 if n == 1 else b * (2 if op == "all_reduce" else 1))
    assert all("never sends the chunk it ends up owning" in line for line in lines)
    lines = _one_line(check_ring_bytes, lambda op, b, n: 2 * b * (n - 1) // n)
    assert len(lines) == 2 and all("only the all-reduce goes around the ring twice" in line for line in lines)


def test_ring_time_accepts_the_model_and_names_each_typical_mistake_in_one_line():
    check_ring_time(ring_time)
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: ring_time(op, b, n, a, w)
                      - (n - 1) * a * (op == "all_reduce"))
    assert lines == [lines[0]] and lines[0].startswith("all_reduce: latency of N−1 steps")
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: ring_bytes(op, b, n) / w)
    assert len(lines) == 3 and all("the latency term is missing" in line for line in lines)
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: a + ring_bytes(op, b, n) / w)
    assert all("one α per collective" in line for line in lines)
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: 1e6 * ring_time(op, b, n, a, w))
    assert all("seconds, please" in line for line in lines)
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: ring_time(op, b, n, a, w)
                      + (2 if op == "all_reduce" else 1) * a)       # N steps, not N−1
    assert all("latency term is wrong" in line for line in lines)
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: ring_time(op, b, n, a, w) * 1.1)
    assert all("bandwidth term is wrong" in line for line in lines)
    lines = _one_line(check_ring_time, lambda op, b, n, a, w: (2 if op == "all_reduce" else 1)
                      * (n - 1) * a + b / n / w)
    assert len(lines) == 3 and all("counts one chunk" in line or "one rank alone" in line
                                   for line in lines)


def test_unwritten_exercise_is_a_clear_failure():
    def todo(*args, **kwargs):
        raise NotImplementedError
    for check in (check_ring_all_reduce, check_ring_bytes):
        with pytest.raises(ExerciseFailed, match="not written yet"):
            check(todo)
