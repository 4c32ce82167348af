"""A rank's life, in the process the fork server has just forked (lesson 00).

`launch.run` sends each rank three descriptors: its pipe to the caller, a file for its
stack (written on SIGUSR1 when the caller's timeout fires) and the run's payload (the
settings, then `fn` and its arguments, cloudpickled). The rank then: sets one math
thread; takes the caller's `sys.path` and working folder; hides the GPUs if it is a gloo
rank that should not see them, or takes its GPU under NCCL — before any CUDA call; sends
what it prints to the caller; joins the group; calls `fn`; sends back its result or its
exception; and stays in the group until the caller says every rank is done.
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

__all__ = ["in_worker", "device", "join_group", "loopback_interface", "rank_main"]

_IN_WORKER = False  # set in a rank, so a nested `run` is caught early
_DEVICE = torch.device("cpu")  # this rank's device, set when the rank joins its group


def in_worker() -> bool:
    """True inside a rank started by `run`."""
    return _IN_WORKER


def device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device this rank computes on: its GPU under NCCL, the CPU under gloo."""
    return _DEVICE


def loopback_interface() -> str:
    """The name of this machine's loopback interface: "lo" on Linux, "lo0" on macOS."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface among {names}: picolib's local ranks need one")


def _listen_on_loopback() -> None:
    """Make every connection of a local run's ranks listen on the loopback interface.

    gloo's default device binds to whatever the hostname resolves to (127.0.1.1 on a Debian
    laptop, the network address on many servers), and NCCL's bootstrap picks the first
    non-loopback interface; both read the interface from these variables when a group is
    created (torch.distributed has no argument for it). They are set in the rank's own
    process, for its groups only; runs under torchrun never come here and choose their
    interface as torchrun users expect (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    lo = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = lo
    os.environ["NCCL_SOCKET_IFNAME"] = lo


def join_group(backend: str, device: str | None = None, **init_kwargs) -> None:
    """Under NCCL, CUDA tensors go over NCCL and CPU tensors over gloo (one group, two
    backends), so code that all-reduces a CPU scalar works on GPUs too. A gloo rank computes
    on the CPU, or with device="cuda" on the GPU it was given (torch.cuda.set_device)."""
    global _DEVICE
    if backend == "nccl":
        _DEVICE = torch.device("cuda", torch.cuda.current_device())
        backend = "cpu:gloo,cuda:nccl"
    elif device == "cuda":
        _DEVICE = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, **init_kwargs)


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


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _describe(e: BaseException) -> tuple[str, str]:
    """(one line, traceback) for an exception, even one whose __str__ raises."""
    try:
        line = f"{type(e).__name__}: {e}"
    except Exception as inner:  # noqa: BLE001
        line = f"{type(e).__name__} (its str() raised {type(inner).__name__})"
    try:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:  # noqa: BLE001
        tb = "".join(traceback.format_tb(e.__traceback__)) + line
    return line, tb


def rank_main(rank: int, conn_fd: int, stack_fd: int, payload_fd: int,
              stderr_fd: int | None = None) -> int:
    """A rank's life, in the process the fork server just forked. Returns the exit code.
    `stderr_fd`: a file for what C/C++ code writes to fd 2 (gloo's last words before an
    abort), which the caller reads when the rank dies without a Python error."""
    global _IN_WORKER
    _IN_WORKER = True
    if stderr_fd is not None:
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
    torch.set_num_threads(1)
    conn = mpc.Connection(conn_fd)
    faulthandler.register(signal.SIGUSR1, file=stack_fd, all_threads=False)
    data = os.pread(payload_fd, os.fstat(payload_fd).st_size, 0)
    os.close(payload_fd)
    n = int.from_bytes(data[:8], "big")
    settings, body = pickle.loads(data[8:8 + n]), data[8 + n:]
    sys.path[:] = settings["sys_path"]
    try:
        os.chdir(settings["cwd"])
    except OSError:
        pass
    if settings["hide_gpu"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before any CUDA call: gloo ranks use the CPU
    lock = threading.Lock()
    sys.stdout = _RankStream(conn, lock, "out")
    sys.stderr = _RankStream(conn, lock, "err")
    world_size, backend = settings["world_size"], settings["backend"]
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif settings.get("device") == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        try:
            fn, args, kwargs = cloudpickle.loads(body)
        except Exception as e:
            raise RuntimeError(f"the function or its arguments could not be rebuilt in the "
                               f"rank ({type(e).__name__}: {e})") from e
        # the group's own timeouts outlast the caller's deadline: a hang must surface as
        # WorkerTimeout with every rank's stack, not as one rank's gloo timeout error
        grace = timedelta(seconds=settings["timeout"] + 30)
        # the group meets in a file of the caller's private temporary folder: no port to
        # pick, nothing two callers could share, and no name lookup (a TCP store looks up
        # 127.0.0.1 in DNS, which stalled 8 runs in 300 by 5 s here)
        store = dist.FileStore(settings["store"], world_size)
        store.set_timeout(grace)
        _listen_on_loopback()
        join_group(backend, settings.get("device"), store=store, rank=rank,
                   world_size=world_size, timeout=grace)
        result = _to_cpu(fn(*args, **kwargs))
        try:
            payload = cloudpickle.dumps(result)
        except Exception as e:
            raise TypeError(f"the return value of type {type(result).__name__} cannot be "
                            f"sent back to the caller (pickle: {e})") from None
        sys.stdout.flush(), sys.stderr.flush()
        with lock:
            conn.send(("result", payload))
        conn.recv()  # stay in the group until every rank is done: peers never see us vanish
        return 0
    except BaseException as e:  # noqa: BLE001 - everything must reach the caller
        try:
            sys.stdout.flush(), sys.stderr.flush()
            with lock:
                conn.send(("error", *_describe(e)))
        except Exception:  # noqa: BLE001
            pass
        return 1
