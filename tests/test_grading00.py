"""Lesson 00 checks: each accepts a correct answer and rejects a wrong one."""
import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading import _core as grading_core
from picolib.grading import (ExerciseFailed, check_all_reduce_from_rs_ag, check_ring_all_reduce,
                             check_ring_bytes, check_ring_time)


def ring_all_reduce(tensor, group=None, skip_last_step=False):
    n, me = dist.get_world_size(), dist.get_rank()
    right, left = (me + 1) % n, (me - 1) % n
    chunks = list(tensor.view(-1).chunk(n))
    incoming = torch.empty_like(chunks[0])
    steps = n - 2 if skip_last_step else n - 1
    for k in range(steps):  # reduce-scatter
        comm.exchange(sends=[(chunks[(me - k) % n].clone(), right)], recvs=[(incoming, left)])
        chunks[(me - k - 1) % n] += incoming
    for k in range(n - 1):  # all-gather
        comm.exchange(sends=[(chunks[(me - k + 1) % n].clone(), right)],
                      recvs=[(chunks[(me - k) % n], left)])
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


def rs_ag(tensor, group=None):
    n = dist.get_world_size()
    shard = torch.empty(tensor.numel() // n)
    comm.reduce_scatter(shard, tensor)
    out = torch.empty_like(tensor)
    comm.all_gather(out, shard)
    return out


def native_all_reduce(tensor, group=None):
    comm.all_reduce(tensor)
    return tensor


def shard_only(tensor, group=None):
    shard = torch.empty(tensor.numel() // dist.get_world_size())
    comm.reduce_scatter(shard, tensor)
    return shard


def ring_bytes(op, nbytes, n):
    return nbytes * (n - 1) // n * (2 if op == "all_reduce" else 1)


def ring_time(op, nbytes, n, alpha, bandwidth):
    k = 2 if op == "all_reduce" else 1
    return k * (n - 1) * alpha + k * nbytes * (n - 1) / n / bandwidth


def test_ring_all_reduce_accepts_a_ring_and_rejects_a_missing_step_or_a_non_ring():
    check_ring_all_reduce(ring_all_reduce)
    with pytest.raises(ExerciseFailed, match="result"):
        check_ring_all_reduce(lambda t, group=None: ring_all_reduce(t, skip_last_step=True))
    with pytest.raises(ExerciseFailed, match="a ring sends"):
        check_ring_all_reduce(all_to_everyone)


def test_ring_all_reduce_turns_a_deadlock_into_a_failure(no_leftover_workers, monkeypatch):
    monkeypatch.setattr(grading_core, "TIMEOUT", 3.0)

    def blocking(tensor, group=None):  # every rank waits for its left neighbour first
        comm.recv(tensor, (dist.get_rank() - 1) % dist.get_world_size())
        return tensor
    with pytest.raises(ExerciseFailed, match="deadlock"):
        check_ring_all_reduce(blocking)


def test_all_reduce_from_rs_ag_accepts_rs_ag_and_rejects_all_reduce_or_a_shard():
    check_all_reduce_from_rs_ag(rs_ag)
    with pytest.raises(ExerciseFailed, match="exactly one"):
        check_all_reduce_from_rs_ag(native_all_reduce)
    with pytest.raises(ExerciseFailed, match="shape"):
        check_all_reduce_from_rs_ag(shard_only)


def test_ring_bytes_accepts_the_formula_and_rejects_a_missing_factor_two():
    check_ring_bytes(ring_bytes)
    with pytest.raises(ExerciseFailed, match="all_reduce"):
        check_ring_bytes(lambda op, b, n: b * (n - 1) // n)


def test_ring_time_accepts_the_model_and_rejects_one_latency_per_all_reduce():
    check_ring_time(ring_time)
    with pytest.raises(ExerciseFailed, match="all_reduce"):
        check_ring_time(lambda op, b, n, a, w: ring_time(op, b, n, a, w)
                        - (n - 1) * a * (op == "all_reduce"))


def test_unwritten_exercise_is_a_clear_failure():
    def todo(*args, **kwargs):
        raise NotImplementedError
    for check in (check_ring_all_reduce, check_ring_bytes):
        with pytest.raises(ExerciseFailed, match="not written yet"):
            check(todo)
