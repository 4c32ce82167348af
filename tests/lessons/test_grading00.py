"""Lesson 00 checks: each accepts a correct answer and rejects a wrong one."""
import re

import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading import _core as grading_core
from picolib.grading import lesson00 as grading_lesson00
from picolib.grading import (ExerciseFailed, check_all_reduce_from_rs_ag, check_ring_all_reduce,
                             check_ring_bytes, check_ring_time)


def ring_all_reduce(tensor, group=None, skip_last_step=False, world=False, copy_back=True,
                    gather_start=1, steps_per_pass=None, gather=True):
    if world:  # the classic slip: the world's ring whatever `group` says
        n, me = dist.get_world_size(), dist.get_rank()
        right, left, group = (me + 1) % n, (me - 1) % n, None
    else:
        n, me, right, left = comm.ring_neighbours(group)
    chunks = list(tensor.view(-1).chunk(n))
    incoming = torch.empty_like(chunks[0])
    steps = n - 2 if skip_last_step else n - 1
    if steps_per_pass is not None:
        steps = steps_per_pass
    for k in range(steps):  # reduce-scatter
        comm.exchange(sends=[(chunks[(me - k) % n].clone(), right)], recvs=[(incoming, left)],
                      group=group)
        chunks[(me - k - 1) % n] += incoming
    for k in range((n - 1 if steps_per_pass is None else steps_per_pass) if gather else 0):  # all-gather
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
     "N=2, every rank: sent 24 bytes.*one step short"),
    (lambda t, group=None: ring_all_reduce(t, group, steps_per_pass=1),
     "N=4, every rank: sent 24 bytes.*one step per pass"),
    (lambda t, group=None: ring_all_reduce(t, group, gather=False),
     "N=4, every rank: sent 36 bytes.*one of the two passes .* is missing"),
    (all_to_everyone, "N=3, every rank: sent 96 bytes.*the whole tensor to every other rank"),
    (lambda t, group=None: ring_all_reduce(t, group, copy_back=False),
     "holds the sum of 1 of the 2 inputs.*never written into the tensor"),
    (lambda t, group=None: ring_all_reduce(t, group, gather_start=0),
     "chunk index is off by one"),
], ids=["ignores group", "missing step", "one step per pass", "no all-gather", "not a ring",
        "not written back", "off by one"])
def test_ring_all_reduce_names_each_wrong_answer(wrong, diagnosis):
    text = failure(check_ring_all_reduce, wrong)
    assert re.search(diagnosis, text), text
    if re.search("step|pass", diagnosis):     # too few steps: no chunk-index story beside it
        assert "off by one" not in text and "never written" not in text, text
        others = [h for _, h in grading_lesson00.STEP_HINTS if not re.search(diagnosis.split(".*", 1)[1], h)]
        assert len(others) == len(grading_lesson00.STEP_HINTS) - 1
        assert not any(h in text for h in others), text    # one explanation, not two


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


# ---------------------------------------------- the networking problems of the GPU chapter
from picolib.grading import (check_all_gather_seconds, check_bisection_bandwidth,  # noqa: E402
                             check_node_bandwidth, check_sharp_switch, check_su_all_gather)
from picolib.grading import lesson00 as ref  # noqa: E402


def test_networking_references_pass_their_checks_and_hold_the_published_answers():
    check_node_bandwidth(ref.node_bandwidth)
    check_bisection_bandwidth(ref.bisection_bandwidth)
    check_sharp_switch(ref.sharp_switch)
    check_all_gather_seconds(ref.all_gather_seconds)
    check_su_all_gather(ref.su_all_gather)
    assert ref.node_bandwidth(8, 450e9, 4, 64 * 25e9) == 3.6e12              # the book: 3.6 TB/s
    assert ref.bisection_bandwidth(8, 450e9) == 3.6e12                       # both directions
    assert round(ref.all_gather_seconds((1024, 16384), 2, 8, 450e9) * 1e6, 1) == 65.2   # not 9 µs
    su = ref.su_all_gather(1.0, 32, 8, 3.6e12, 12.8e12)
    assert su["node_out"] == 8 and su["top_out"] == 31 and round(1 / su["seconds"] / 1e9) == 413


@pytest.mark.parametrize("wrong, diagnosis", [
    (lambda gpus, per_gpu, switches, switch_bw: switches * switch_bw, "the switches' capacity"),
    (lambda gpus, per_gpu, switches, switch_bw: gpus * per_gpu, "the GPUs' ports only"),
    (lambda gpus, per_gpu, switches, switch_bw: gpus * per_gpu + switches * switch_bw, "a sum"),
    (lambda gpus, per_gpu, switches, switch_bw: 2 * ref.node_bandwidth(gpus, per_gpu, switches, switch_bw),
     "count one direction"),
    (lambda gpus, per_gpu, switches, switch_bw: ref.node_bandwidth(gpus, per_gpu, switches, switch_bw) / 1e9,
     "not GB/s"),
], ids=["switches", "ports", "sum", "both directions", "GB/s"])
def test_node_bandwidth_names_each_mistake(wrong, diagnosis):
    lines = _one_line(check_node_bandwidth, wrong)
    assert len(lines) == 1 and diagnosis in lines[0], lines


@pytest.mark.parametrize("wrong, diagnosis", [
    (lambda gpus, per_gpu: gpus // 2 * per_gpu, "one direction only"),
    (lambda gpus, per_gpu: 2 * gpus * per_gpu, "only half the GPUs"),
    (lambda gpus, per_gpu: per_gpu, "one GPU's port"),
], ids=["one direction", "all GPUs", "one port"])
def test_bisection_bandwidth_names_each_mistake(wrong, diagnosis):
    lines = _one_line(check_bisection_bandwidth, wrong)
    assert len(lines) == 1 and diagnosis in lines[0], lines


def _sharp(change):
    def fn(nbytes, n, per_gpu, switch_total):
        out = ref.sharp_switch(nbytes, n, per_gpu, switch_total)
        out.update(change(nbytes, n, per_gpu, switch_total))
        return out
    return fn


@pytest.mark.parametrize("wrong, diagnosis", [
    (_sharp(lambda b, n, w, s: {"in": b}), "['in']: one GPU's B"),
    (_sharp(lambda b, n, w, s: {"in": b * (n - 1)}), "['in']: (N−1)·B"),
    (_sharp(lambda b, n, w, s: {"out": b}), "['out']: B once"),
    (_sharp(lambda b, n, w, s: {"seconds": b * n / s}), "the switches' share only"),
    (_sharp(lambda b, n, w, s: {"seconds": b / w}), "a GPU's port only"),
    (_sharp(lambda b, n, w, s: {"seconds": 2 * max(b / w, b * n / s)}), "full duplex"),
], ids=["in: one B", "in: N-1", "out: one B", "switch time", "port time", "twice"])
def test_sharp_switch_names_each_mistake(wrong, diagnosis):
    lines = _one_line(check_sharp_switch, wrong)
    assert len(lines) == 1 and diagnosis in lines[0], lines


def _elements(shape):
    out = 1
    for d in shape:
        out *= d
    return out


@pytest.mark.parametrize("wrong, diagnosis", [
    (lambda shape, itemsize, n, per_gpu: _elements(shape) * itemsize / (n * per_gpu), "the published 9 µs"),
    (lambda shape, itemsize, n, per_gpu: _elements(shape) * itemsize / per_gpu, "all of B"),
    (lambda shape, itemsize, n, per_gpu: (n - 1) / n * _elements(shape) / per_gpu, "elements, not bytes"),
    (lambda shape, itemsize, n, per_gpu: 1e6 * ref.all_gather_seconds(shape, itemsize, n, per_gpu), "seconds"),
    (lambda shape, itemsize, n, per_gpu: 8 * ref.all_gather_seconds(shape, itemsize, n, per_gpu), "bits, not bytes"),
], ids=["B/(NW)", "B/W", "elements", "µs", "bits"])
def test_all_gather_seconds_names_each_mistake(wrong, diagnosis):
    lines = _one_line(check_all_gather_seconds, wrong)
    assert len(lines) == 1 and diagnosis in lines[0], lines
    assert "a sum where a mean" not in lines[0], lines          # no mean in this formula


def test_all_gather_seconds_right_written_differently():
    def by_chunks(shape, itemsize, n, per_gpu):
        """Right: N−1 chunks of B/N arrive through the GPU's own port, one per step."""
        nbytes = itemsize * _elements(shape)
        return sum(nbytes / n for _ in range(n - 1)) / per_gpu
    check_all_gather_seconds(by_chunks)


def test_an_unexplained_factor_is_named_without_a_cause():
    lines = _one_line(check_all_gather_seconds,
                      lambda shape, itemsize, n, per_gpu: 3 * ref.all_gather_seconds(shape, itemsize, n, per_gpu))
    assert len(lines) == 1 and "3× too large" in lines[0] and "mean" not in lines[0], lines


def _su(change):
    def fn(nbytes, m, n, w_node, w_top):
        out = ref.su_all_gather(nbytes, m, n, w_node, w_top)
        out.update(change(nbytes, m, n, w_node, w_top, out))
        return out
    return fn


@pytest.mark.parametrize("wrong, diagnosis", [
    (_su(lambda b, m, n, wn, wt, o: {"node_in": b / m}), "['node_in']: only the node's own shards"),
    (_su(lambda b, m, n, wn, wt, o: {"node_out": b}), "['node_out']: B once"),
    (_su(lambda b, m, n, wn, wt, o: {"top_out": b}), "['top_out']: B once"),
    (_su(lambda b, m, n, wn, wt, o: {"seconds": o["node_out"] / wn}), "the node level's time"),
], ids=["node in", "node out", "top out", "node time"])
def test_su_all_gather_names_each_mistake(wrong, diagnosis):
    lines = _one_line(check_su_all_gather, wrong)
    assert len(lines) == 1 and diagnosis in lines[0], lines


def test_unwritten_networking_exercises_fail():
    def todo(*args, **kwargs):
        raise NotImplementedError
    for check in (check_node_bandwidth, check_bisection_bandwidth, check_sharp_switch,
                  check_all_gather_seconds, check_su_all_gather):
        with pytest.raises(ExerciseFailed, match="not written yet"):
            check(todo)


def rs_ag_with_a_wrong_shard(tensor, group=None):
    """Wrong: a shard one element too long — gloo's own error ("ProcessGroupGloo.cpp: Check
    failed"), nothing about groups."""
    shard = torch.empty(tensor.numel() // dist.get_world_size(group) + 1)
    comm.reduce_scatter(shard, tensor, group=group)
    return tensor


def test_the_sub_group_hint_comes_with_a_rank_outside_the_group_only():
    from picolib.launch import WorkerError
    tb = ('Traceback (most recent call last):\n  File "/tmp/student.py", line 3, in ring\n'
          '    comm.send(t, 1, group=group)\nValueError: Global rank 1 is not part of group '
          '<torch.distributed.distributed_c10d.ProcessGroup object at 0x7f>\n')
    text = grading_core._error_message(WorkerError(0, "ValueError: Global rank 1 is not part of "
                                                      "group <ProcessGroup>", tb))
    assert "peers are global ranks" in text, text
    with pytest.raises(ExerciseFailed) as info:
        check_all_reduce_from_rs_ag(rs_ag_with_a_wrong_shard)
    text = info.value.details
    assert "ProcessGroupGloo" in text and "peers are global ranks" not in text, text


def test_su_all_gather_without_a_known_slip_says_which_case_and_key_differ():
    """top_in off by one shard (no known slip): the line names the key, the case, got and
    expected — never a bare "values differ"."""
    lines = _one_line(check_su_all_gather, _su(lambda b, m, n, wn, wt, o: {"top_in": o["top_in"] + b / (m * n)}))
    assert len(lines) == 1 and re.match(
        r"su_all_gather\['top_in'\]: 4 of 4 cases wrong, e\.g\. nbytes=\d+, m=32, n=8, .*: got .*, "
        r"expected ", lines[0]), lines
    assert "values differ" not in lines[0]


def test_su_all_gather_right_written_differently():
    def per_level(nbytes, m, n, w_node, w_top):
        """Right, written differently: every GPU's traffic summed level by level."""
        node_out = sum(nbytes for _ in range(n))                # N·B out of the node level
        top_out = sum(nbytes for _ in range(m - 1))             # (M−1)·B out of the top level
        return {"node_in": float(nbytes), "node_out": float(node_out), "top_in": float(nbytes),
                "top_out": float(top_out), "seconds": max(node_out / w_node, top_out / w_top)}
    check_su_all_gather(per_level)
