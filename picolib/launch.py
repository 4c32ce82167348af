"""Run a function on N ranks of a real `torch.distributed` group — from a notebook cell.

    results = run(fn, 4, x, lr=0.1)   # fn(x, lr=0.1) on ranks 0..3; their return values

Why not `torch.multiprocessing.spawn`? It re-imports torch in every rank (seconds per
rank) and cannot run a function defined in a notebook. `run` forks instead: the ranks
start as copies of the caller, so `fn` can be anything the notebook defined.

The contract (lesson 00 shows each part):
- every rank calls `torch.set_num_threads(1)` before any math: forking a process whose
  OpenMP pool is live can deadlock, and N ranks on a few cores should not fight anyway;
- the group meets through a TCP store that rank 0 serves on a socket the caller bound
  to a free port of 127.0.0.1, so two notebooks running at once never collide (and the
  caller starts no thread of its own: forking while a thread holds a lock can hang);
- a rank that raises becomes a `WorkerError` in the caller, naming the rank and
  carrying its traceback; a run that does not finish in `timeout` seconds becomes a
  `WorkerTimeout`; an interrupt (the notebook's stop button) ends every rank;
- no rank outlives `run`: every exit path kills what is left;
- what a rank prints reaches the caller prefixed with `[rank r]`.

On a cluster the same worker code runs under `torchrun`; call `init_from_env()` first.
"""
from __future__ import annotations

import ctypes
import faulthandler
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run", "init_from_env", "WorkerError", "WorkerTimeout", "resolve_backend",
           "device", "in_worker"]

_IN_WORKER = False  # set in a forked rank, so a nested `run` is caught early


class WorkerError(RuntimeError):
    """A rank raised (or died). `.rank` is the rank, `.remote_traceback` its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += "\n\n--- traceback on rank %d ---\n%s" % (rank, remote_traceback.rstrip())
        super().__init__(text)


class WorkerTimeout(TimeoutError):
    """The ranks did not all finish within the timeout (often: a collective one rank skipped)."""


def in_worker() -> bool:
    """True inside a rank started by `run`."""
    return _IN_WORKER


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' → NCCL when there is one GPU per rank, otherwise gloo (CPU)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, GPUs={gpus}")
    return backend


def device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device this rank computes on: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str = "auto") -> tuple[int, int]:
    """Join the group that `torchrun` describes (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Returns (rank, world_size). Under NCCL each process takes GPU LOCAL_RANK.
    """
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = resolve_backend(backend, local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


# --------------------------------------------------------------------------- worker

class _RankStream(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr in a rank: sends whole lines to the caller."""

    def __init__(self, conn, lock, kind: str):
        self._conn, self._lock, self._kind, self._buf = conn, lock, kind, ""

    def writable(self):
        return True

    def write(self, text: str) -> int:
        self._buf += text
        if "\n" in self._buf:
            lines, self._buf = self._buf.rsplit("\n", 1)
            self._send(lines)
        return len(text)

    def flush(self):
        if self._buf:
            self._send(self._buf)
            self._buf = ""

    def _send(self, text: str):
        with self._lock:
            self._conn.send((self._kind, text))


def _die_with_parent():
    """Ask Linux to kill this rank if the caller dies (a crashed kernel leaves no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _worker(rank, world_size, backend, listener, timeout, conn, stack_file, fn, args, kwargs):
    global _IN_WORKER
    _IN_WORKER = True
    torch.set_num_threads(1)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller decides; it kills us
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    lock = threading.Lock()
    sys.stdout = _RankStream(conn, lock, "out")
    sys.stderr = _RankStream(conn, lock, "err")
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # rank 0 serves the rendezvous store on the socket the caller bound; the caller runs
        # no store thread of its own, so nothing holds a lock while it forks
        port = listener.getsockname()[1]
        # the group's own timeouts outlast the caller's deadline: a hang must surface as
        # WorkerTimeout with every rank's stack, not as one rank's gloo timeout error
        grace = timedelta(seconds=timeout + 30)
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                                  timeout=grace, wait_for_workers=False,
                                  master_listen_fd=listener.fileno(), use_libuv=False)
        else:
            listener.close()
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=grace)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=grace)
        result = _to_cpu(fn(*args, **kwargs))
        try:
            payload = pickle.dumps(result)
        except Exception as e:
            raise TypeError(f"the return value of type {type(result).__name__} cannot be "
                            f"sent back to the caller (pickle: {e})") from None
        sys.stdout.flush(), sys.stderr.flush()
        with lock:
            conn.send(("result", payload))
        conn.recv()  # stay in the group until every rank is done: peers never see us vanish
    except BaseException as e:  # noqa: BLE001 - everything must reach the caller
        code = 1
        try:
            sys.stdout.flush(), sys.stderr.flush()
            with lock:
                conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except Exception:
            pass
    finally:
        os._exit(code)  # skip the caller's atexit hooks, which this fork inherited


# --------------------------------------------------------------------------- caller

def run(fn: Callable, world_size: int, *args, backend: str = "auto",
        timeout: float = 120.0, **kwargs) -> list[Any]:
    """Call `fn(*args, **kwargs)` on ranks 0..world_size-1 and return their results in rank order.

    Inside `fn` the default process group is ready (`dist.get_rank()`, collectives).
    Raises WorkerError if a rank fails, WorkerTimeout after `timeout` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    if _IN_WORKER or dist.is_initialized():
        raise RuntimeError("launch.run was called inside a rank (or a process already in a "
                           "process group); start ranks from the notebook or script only")
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError("launch.run needs the 'fork' start method (Linux, macOS, WSL); "
                           "on this system use torchrun and init_from_env()")
    backend = resolve_backend(backend, world_size)
    if backend == "nccl" and torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised in this process, and a forked rank "
                           "cannot use it: call run(...) before touching the GPU, or use torchrun")

    ctx = mp.get_context("fork")  # explicit: Python 3.14 changes the default
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(world_size, 8))
    procs, conns = [], []
    stacks = [tempfile.TemporaryFile("w+") for _ in range(world_size)]
    sys.stdout.flush(), sys.stderr.flush()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker, daemon=True, name=f"picolib-rank{rank}",
                            args=(rank, world_size, backend, listener, timeout, child_end,
                                  stacks[rank], fn, args, kwargs))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        listener.close()
        results = _collect(procs, conns, stacks, timeout)
        for c in conns:  # all done: let every rank leave the group
            try:
                c.send("exit")
            except OSError:
                pass
        for p in procs:
            p.join(timeout=5)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        for c in conns:
            c.close()
        for f in stacks:
            f.close()
        listener.close()
        sys.stdout.flush()


def _stuck_stacks(procs, ranks, stacks) -> str:
    """Ask each stuck rank for its Python stack (faulthandler on SIGUSR1) and collect them."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    text = []
    for r in ranks:
        stacks[r].seek(0)
        lines = [ln for ln in stacks[r].read().splitlines() if ln.strip()]
        text.append(f"--- rank {r} was here ---\n" + "\n".join(lines[:12]))
    return "\n".join(text)


def _collect(procs, conns, stacks, timeout):
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    open_conns = dict(enumerate(conns))
    by_conn = {id(c): r for r, c in open_conns.items()}
    while len(results) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            waiting = [r for r in range(len(procs)) if r not in results]
            raise WorkerTimeout(
                f"ranks {waiting} did not finish within {timeout:g} s (a collective that "
                f"some rank never called? a deadlock in send/recv?); all ranks were stopped\n"
                + _stuck_stacks(procs, waiting, stacks))
        ready = mpc.wait(list(open_conns.values()) +
                         [p.sentinel for r, p in enumerate(procs) if r not in results],
                         timeout=min(left, 1.0))
        for obj in ready:
            if isinstance(obj, int):
                continue
            rank = by_conn[id(obj)]
            try:
                msg = obj.recv()
            except (EOFError, OSError):
                open_conns.pop(rank, None)
                continue
            _handle(rank, msg, results)
        for rank, p in enumerate(procs):  # a rank that died without a word (killed, segfault)
            if rank not in results and not p.is_alive():
                c = open_conns.pop(rank, None)
                while c is not None and c.poll():
                    try:
                        _handle(rank, c.recv(), results)
                    except (EOFError, OSError):
                        break
                if rank not in results:
                    raise WorkerError(rank, f"the process exited with code {p.exitcode} "
                                            "without returning (killed? out of memory?)")
    return [results[r] for r in range(len(procs))]


def _handle(rank, msg, results):
    kind = msg[0]
    if kind == "out":
        print("\n".join(f"[rank {rank}] {line}" for line in msg[1].split("\n")), flush=True)
    elif kind == "err":
        print("\n".join(f"[rank {rank}] {line}" for line in msg[1].split("\n")),
              file=sys.stderr, flush=True)
    elif kind == "result":
        results[rank] = pickle.loads(msg[1])
    elif kind == "error":
        raise WorkerError(rank, msg[1], msg[2])
