"""The launcher's contract (DESIGN.md, launch.py): results in rank order, loud failures,
timeouts instead of hangs, no process left behind."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from picolib.launch import WorkerError, WorkerTimeout, run

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_results_come_back_in_rank_order(n):
    out = run(rank_and_sum, n, 1)
    expected_sum = float(sum(range(n)) + n)
    assert out == [(r, n, expected_sum) for r in range(n)]


def test_kwargs_and_closures_reach_the_ranks():
    scale = 3

    def closure(x, *, y):
        return (x + y) * scale * (dist.get_rank() + 1)

    assert run(closure, 2, 1, y=2) == [9, 18]


def test_worker_output_is_prefixed_with_its_rank(capsys):
    def talk():
        print(f"hello from {dist.get_rank()}")
        print("second line")

    run(talk, 2)
    out = capsys.readouterr().out
    for r in range(2):
        assert f"[rank {r}] hello from {r}" in out
        assert f"[rank {r}] second line" in out


def test_a_failing_rank_raises_workererror_quickly():
    def fail_on_two():
        if dist.get_rank() == 2:
            raise ValueError("bad shard 42")
        dist.barrier()  # the others wait forever for rank 2

    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run(fail_on_two, 4, timeout=60)
    assert time.monotonic() - t0 < 5
    assert info.value.rank == 2
    assert "ValueError: bad shard 42" in str(info.value)
    assert "fail_on_two" in info.value.remote_traceback


def test_a_skipped_collective_times_out_with_the_stacks():
    def skip_on_one():
        if dist.get_rank() != 1:
            dist.all_reduce(torch.ones(1))

    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        run(skip_on_one, 3, timeout=2)
    elapsed = time.monotonic() - t0
    assert 2 <= elapsed < 6
    assert "ranks [0, 2]" in str(info.value)
    assert "skip_on_one" in str(info.value)  # the stuck ranks' stacks point at the line


def test_an_unpicklable_result_names_the_rank_and_type():
    def give_lock():
        import threading
        return threading.Lock() if dist.get_rank() == 1 else 0

    with pytest.raises(WorkerError) as info:
        run(give_lock, 2)
    assert info.value.rank == 1
    assert "lock" in str(info.value).lower() and "cannot be sent back" in str(info.value)


def test_a_rank_that_dies_silently_is_reported():
    def die():
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(WorkerError) as info:
        run(die, 2, timeout=30)
    assert info.value.rank == 1 and "exited with code" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4", True, None])
def test_world_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="world_size"):
        run(rank_and_sum, bad, 0)


def test_fn_must_be_callable_and_timeout_positive():
    with pytest.raises(TypeError, match="callable"):
        run("not a function", 2)
    with pytest.raises(ValueError, match="timeout"):
        run(rank_and_sum, 2, 0, timeout=0)
    with pytest.raises(ValueError, match="backend"):
        run(rank_and_sum, 2, 0, backend="mpi")


def test_run_inside_a_rank_is_a_clear_error():
    def nested():
        run(rank_and_sum, 2, 0)

    with pytest.raises(WorkerError, match="inside a rank"):
        run(nested, 2)


SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    from picolib.launch import run
    def sleepy(pid_dir):
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        time.sleep(60)
    try:
        run(sleepy, 4, sys.argv[1], timeout=90)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
""")


def test_an_interrupt_ends_every_worker(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 4
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "interrupted" in out
    time.sleep(0.2)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
             open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"workers outlived the interrupt: {alive}"


TWIN = textwrap.dedent("""
    import torch, torch.distributed as dist
    from picolib.launch import run
    def work():
        t = torch.ones(1); dist.all_reduce(t); return t.item()
    for _ in range(10):
        assert run(work, 4, timeout=60) == [4.0] * 4
    print("ok")
""")


def test_two_callers_at_once_do_not_collide():
    procs = [subprocess.Popen([sys.executable, "-c", TWIN], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all("ok" in o for o in outs)


TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch
    from picolib.launch import init_from_env
    from picolib.comm import Ledger, all_reduce
    rank, world = init_from_env()
    t = torch.tensor([float(rank + 1)])
    with Ledger() as led:
        all_reduce(t)
    print(f"rank={rank} world={world} sum={t.item()} sent={led.total()}", flush=True)
""")


def test_the_same_code_runs_under_torchrun(tmp_path):
    """The cluster path: torchrun starts the processes, init_from_env joins the group."""
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", str(script)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    for rank in range(2):
        assert f"rank={rank} world=2 sum=3.0 sent=4" in r.stdout
