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

from helpers import alive, child_pids, open_fds
from picolib import launch
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


def _die(how, victim):
    """Rank `victim` ends without a word; the others wait for it in a collective."""
    import ctypes
    if dist.get_rank() == victim:
        if how == "exit":
            os._exit(3)
        elif how == "abort":
            os.abort()
        elif how == "segfault":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    dist.barrier()


@pytest.mark.parametrize("how, words", [("exit", "exited with code 3"),
                                        ("kill", "SIGKILL"), ("segfault", "SIGSEGV"),
                                        ("abort", "SIGABRT")])
def test_a_rank_that_dies_silently_is_named_not_a_peer(how, words):
    """Its peers' "connection closed" errors often arrive first (17-25 % of runs with the old
    launcher blamed one of them); the dead rank must be named, with the signal, every time."""
    for attempt in range(6):
        victim = attempt % 4
        with pytest.raises(WorkerError) as info:
            run(_die, 4, how, victim, timeout=30)
        assert info.value.rank == victim, f"attempt {attempt}: {info.value}"
        assert words in str(info.value)


def _mismatched_collectives(order):
    """Two ranks disagree on the collective: "sizes", rank 0 all-reduces 4 numbers where rank 1
    all-reduces 8; "order", both call the same two all-reduces in opposite orders."""
    sizes = {"sizes": [4 if dist.get_rank() == 0 else 8], "order": [4, 8][::1 - 2 * dist.get_rank()]}
    for n in sizes[order]:
        dist.all_reduce(torch.ones(n))


@pytest.mark.parametrize("order", ["sizes", "order"])
def test_a_collective_mismatch_is_named_in_gloos_own_words(order):
    """gloo aborts the process (SIGABRT) after writing why to fd 2: the error names it, not
    only the signal."""
    with pytest.raises(WorkerError) as info:
        run(_mismatched_collectives, 2, order, timeout=30)
    first = str(info.value).split("\n")[0]
    assert "SIGABRT" in first and "collective mismatch" in first, first
    assert "gloo::EnforceNotMet" in first and ("4 vs 8" in first or "8 vs 4" in first), first


def test_a_silent_abort_adds_no_words():
    with pytest.raises(WorkerError) as info:
        run(_die, 2, "abort", 1, timeout=30)
    assert "SIGABRT" in str(info.value) and "it wrote" not in str(info.value)


def test_an_exception_whose_str_raises_keeps_its_traceback():
    class Nasty(Exception):
        def __str__(self):
            raise RuntimeError("no str for you")

    def raise_nasty():
        if dist.get_rank() == 1:
            raise Nasty()
        return 0

    with pytest.raises(WorkerError) as info:
        run(raise_nasty, 2)
    assert info.value.rank == 1 and "Nasty" in str(info.value)
    assert "raise_nasty" in info.value.remote_traceback


def _refuse_to_load():
    raise ValueError("this object refuses to be rebuilt")


class _Unloadable:
    def __reduce__(self):
        return (_refuse_to_load, ())


def test_a_result_that_fails_to_unpickle_in_the_caller_names_the_rank():
    def give():
        return _Unloadable() if dist.get_rank() == 1 else 0

    with pytest.raises(WorkerError) as info:
        run(give, 2)
    assert info.value.rank == 1 and "refuses to be rebuilt" in str(info.value)


def test_an_argument_that_cannot_travel_is_named_before_any_rank_starts():
    import threading
    before = child_pids()
    with pytest.raises(TypeError, match=r"args\[1\] \(a lock\)"):
        run(rank_and_sum, 2, 0, threading.Lock())
    with pytest.raises(TypeError, match=r"kwargs\['gen'\]"):
        run(rank_and_sum, 2, 0, gen=(i for i in range(3)))
    assert child_pids() == before


def test_notebook_style_values_travel_by_value():
    """Lambdas, closures and classes defined on the spot reach the ranks (cloudpickle)."""
    class Point:
        def __init__(self, x):
            self.x = x

        def scaled(self, k):
            return Point(self.x * k)

    offset = 10
    f = lambda p: p.scaled(dist.get_rank() + 1).x + offset  # noqa: E731
    assert run(f, 3, Point(2)) == [12, 14, 16]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4", True, None, 10**6])
def test_world_size_must_be_a_sensible_positive_int(bad):
    before = child_pids()
    with pytest.raises(ValueError, match="world_size"):
        run(rank_and_sum, bad, 0)
    assert child_pids() == before


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), 1e300, True, "5"])
def test_timeout_must_be_positive_and_finite(bad):
    before = child_pids()
    with pytest.raises(ValueError, match="timeout"):
        run(rank_and_sum, 2, 0, timeout=bad)
    assert child_pids() == before


def test_fn_must_be_callable_and_backend_known():
    with pytest.raises(TypeError, match="callable"):
        run("not a function", 2)
    with pytest.raises(ValueError, match="backend"):
        run(rank_and_sum, 2, 0, backend="mpi")


def test_run_inside_a_rank_is_a_clear_error():
    def nested():
        run(rank_and_sum, 2, 0)

    with pytest.raises(WorkerError, match="inside a rank"):
        run(nested, 2)


def test_ranks_run_backward_after_the_caller_did_and_are_not_its_children():
    """The design that keeps GPU machines working: the caller has run autograd (and touched
    CUDA where there is one); the ranks are forked from the clean fork server, not from it."""
    x = torch.randn(4, requires_grad=True)
    (x * x).sum().backward()
    if torch.cuda.is_available():
        torch.ones(1, device="cuda").sum().item()

    def train_a_bit():
        w = torch.randn(3, requires_grad=True)
        (w.exp() * dist.get_rank()).sum().backward()
        return os.getppid(), os.getpgid(0) == os.getpid(), w.grad.abs().sum().item() >= 0

    out = run(train_a_bit, 2, backend="gloo")
    assert [o[0] for o in out] == [launch._SERVER.pid] * 2
    assert launch._SERVER.pid != os.getpid()
    assert all(o[1] and o[2] for o in out)  # each rank leads its own process group


def _start_sleeper(pid_dir, fail):
    """Start a subprocess that would sleep a minute, note its pid, then finish (or fail)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.path.join(pid_dir, f"child{dist.get_rank()}"), "w") as f:
        f.write(str(p.pid))
    dist.barrier()  # both children exist before rank 1 fails (else rank 0 may be killed first)
    if fail and dist.get_rank() == 1:
        raise RuntimeError("failing with a child running")
    return p.pid


def _gone_soon(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("fail", [False, True])
def test_nothing_a_rank_started_outlives_run(tmp_path, fail):
    if fail:
        with pytest.raises(WorkerError):
            run(_start_sleeper, 2, str(tmp_path), fail)
    else:
        run(_start_sleeper, 2, str(tmp_path), fail)
    pids = [int((tmp_path / f"child{r}").read_text()) for r in range(2)]
    assert not _gone_soon(pids), "a process started by a rank outlived run"


def test_a_failed_run_pins_no_descriptors_and_many_runs_leak_nothing():
    import threading

    def fail():
        raise ValueError("x")

    run(rank_and_sum, 2, 0)
    fds, threads = open_fds(), threading.active_count()
    kept = []
    for _ in range(3):
        with pytest.raises(WorkerError) as info:
            run(fail, 4)
        kept.append(info.value)  # the exceptions stay referenced, with their tracebacks
    assert open_fds() == fds
    for _ in range(30):
        run(rank_and_sum, 4, 0)
    assert open_fds() == fds and threading.active_count() == threads


def test_sixteen_ranks_on_two_cores():
    assert run(rank_and_sum, 16, 0, timeout=120) == [(r, 16, 120.0) for r in range(16)]


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


ORPHAN = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from picolib import launch
    def sleepy(pid_dir):
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        for pid in (os.getpid(), p.pid):
            open(os.path.join(pid_dir, str(pid)), "w").close()
        time.sleep(120)
    x = torch.randn(3, requires_grad=True); (x * x).sum().backward()
    open(os.path.join(sys.argv[1], str(launch._SERVER.pid)), "w").close()
    run = launch.run
    run(sleepy, 4, sys.argv[1], timeout=300)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_when_the_caller_dies_nothing_is_left(tmp_path, sig):
    """A notebook kernel killed (or stopped) mid-run: its ranks, what they started and the
    fork server all go."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 9  # the server, 4 ranks, 4 processes the ranks started
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert not _gone_soon(pids, 10.0), "processes outlived their caller"


MANY = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from picolib.launch import run
    def work(k):
        t = torch.full((1,), float(k)); dist.all_reduce(t); return t.item()
    print("ready", flush=True)
    sys.stdin.readline()                 # every caller has imported torch: start together
    for k in range(5):
        t0 = time.monotonic()
        assert run(work, 4, k, timeout=60) == [4.0 * k] * 4
        print("run", t0, time.monotonic(), flush=True)
    print("ok")
""")


def test_four_callers_at_once_do_not_collide():
    """Four processes each run five 4-rank groups, released together once all have imported
    torch, so their runs overlap in time (checked: each caller's runs meet another's)."""
    procs = [subprocess.Popen([sys.executable, "-c", MANY], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * 4
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4 and all("ok" in o for o in outs)
    spans = [[tuple(map(float, line.split()[1:])) for line in o.splitlines() if line.startswith("run")]
             for o in outs]
    assert [len(s) for s in spans] == [5] * 4
    for i, mine in enumerate(spans):
        others = [s for j, theirs in enumerate(spans) if j != i for s in theirs]
        assert any(a < d and c < b for a, b in mine for c, d in others), f"caller {i} ran alone"


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


def test_a_fork_of_the_caller_gets_its_own_server():
    """A process forked from the caller (a DataLoader worker, say) must not talk over the
    caller's connection: it starts a server of its own, and the caller's keeps working."""
    run(rank_and_sum, 2, 0)
    callers_server = launch._SERVER.pid
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = run(rank_and_sum, 2, 5) == [(r, 2, 11.0) for r in range(2)]
            ok = ok and launch._SERVER.pid not in (None, callers_server)
            os.write(write_end, b"ok" if ok else b"wrong")
            launch._SERVER.close()
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 16) == b"ok" and os.waitstatus_to_exitcode(status) == 0
    os.close(read_end)
    assert run(rank_and_sum, 2, 1) == [(r, 2, 3.0) for r in range(2)]


def test_a_module_that_fails_to_preload_does_not_stop_the_server():
    from picolib.forkserver import ForkServer
    server = ForkServer(["torch", "picolib_no_such_module", "json"])
    server.start()
    try:
        server.wait_ready()
        assert "json" in server.modules and "picolib_no_such_module" not in server.modules
    finally:
        server.close()
    assert not server.alive()


@pytest.fixture
def own_server(monkeypatch):
    """A fork server of the test's own in place of the caller's, so that killing it leaves
    the caller's server (and the other tests' leftover check) alone."""
    from picolib.forkserver import ForkServer
    server = ForkServer(launch._preload())
    monkeypatch.setattr(launch, "_SERVER", server)
    server.start()
    yield server
    server.close()


@pytest.mark.parametrize("noticed", [True, False])
def test_a_server_killed_between_runs_is_restarted(own_server, monkeypatch, noticed):
    """Killed (or taken by the out-of-memory killer) while no run was on: the next run starts
    a fresh server and succeeds. `kill` returns before the server is gone, so the caller
    may still think it alive when the next run begins (noticed=False makes that certain)."""
    assert run(rank_and_sum, 2, 0) == [(r, 2, 1.0) for r in range(2)]
    first = own_server.pid
    os.kill(first, signal.SIGKILL)
    os.waitid(os.P_PID, first, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
    if not noticed:
        monkeypatch.setattr(own_server._proc, "poll", lambda: None)
    assert run(rank_and_sum, 2, 1) == [(r, 2, 3.0) for r in range(2)]
    assert own_server.pid not in (None, first) and own_server.alive()


def _kill_the_server_from_a_rank(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    dist.barrier()                       # every rank has written its pid
    if dist.get_rank() == 0:
        os.kill(os.getppid(), signal.SIGKILL)   # a rank's parent is the fork server
    time.sleep(60)


def test_a_server_that_dies_during_a_run_is_the_error_and_the_next_run_works(own_server, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="fork server died"):
        run(_kill_the_server_from_a_rank, 2, str(tmp_path), timeout=60)
    assert time.monotonic() - t0 < 30     # reported at once, not at the timeout
    rank_pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(rank_pids) == 2
    deadline = time.monotonic() + 5
    while any(alive(p) for p in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in rank_pids), "ranks outlived their server"
    assert run(rank_and_sum, 2, 1) == [(r, 2, 3.0) for r in range(2)]


def test_the_blame_goes_to_the_rank_whose_error_is_its_own():
    """A rank that raises makes every peer waiting on it in a collective fail with a transport
    error, which may reach the caller first: the rank blamed is the one whose error is its own."""
    from picolib.launch import _culprit
    gone = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:4242: Connection reset by peer", "")
    errors = {0: gone, 3: gone, 2: ("ValueError: bad shard 42", "tb")}      # in order of arrival
    assert _culprit([], errors) == 2
    assert _culprit([], {0: gone, 3: gone}) == 0                          # nothing better: the first
    assert _culprit([1], errors) == 1                                     # a silent death comes first
