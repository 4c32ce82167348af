"""Run a function on N ranks of a real `torch.distributed` group — from a notebook cell.

    results = run(fn, 4, x, lr=0.1)   # fn(x, lr=0.1) on ranks 0..3; their return values

Why not `torch.multiprocessing.spawn`? It starts a fresh interpreter per rank (seconds
each, every rank re-imports torch) and cannot run a function defined in a notebook.
Why not plain `fork` of the notebook? On a CUDA build with a GPU, a process that has run
one autograd backward or touched CUDA can never fork a rank that does either — and a
notebook has always done both. So `run` forks the ranks from a clean *fork server*
(`forkserver.py`): a fresh interpreter with torch and picolib loaded, started in the
background when this module is imported, reused by every later call (what a rank does
then is `rank.py`). `fn` and its arguments travel by value (cloudpickle), so notebook
functions, closures, lambdas and classes work.

The contract (lesson 00 shows each part):
- every rank calls `torch.set_num_threads(1)` before any math (N ranks on a few cores
  should not fight over threads);
- the group meets through a store in a file of the caller's private temporary folder
  (no port to pick, no name lookup), so two notebooks running at once never collide;
- a rank that raises becomes a `WorkerError` in the caller, naming the rank and carrying
  its traceback; a rank that dies without a word (killed, crashed) is named with the
  signal that ended it, even when its peers' errors arrive first, and with its C/C++ code's
  last words on stderr (gloo's "collective mismatch" before it aborts);
- a run that does not finish in `timeout` seconds becomes a `WorkerTimeout` that shows
  where each stuck rank was; an interrupt (the notebook's stop button) ends every rank;
- no rank, nothing a rank started, and not the server outlives the caller;
- a server that died between two runs (killed, the out-of-memory killer) is restarted by
  the next run; one that dies during a run is that run's error, named;
- what a rank prints reaches the caller prefixed with `[rank r]`.

On a cluster the same worker code runs under `torchrun`; call `init_from_env()` first.
"""
from __future__ import annotations

import sys

if sys.platform == "win32":   # before anything that would fail less clearly
    raise ImportError("picolib's launcher needs Linux or macOS: it forks ranks from a server and "
                      "passes them descriptors over UNIX sockets, which native Windows lacks. "
                      "On Windows, run the course inside WSL2 (a Linux).")

import atexit
import linecache
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import pkgutil
import re
import signal
import site
import tempfile
import threading
import time
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist

from . import forkserver
from .rank import device, in_worker, join_group

__all__ = ["run", "init_from_env", "WorkerError", "WorkerTimeout", "resolve_backend",
           "device", "in_worker", "MAX_WORLD_SIZE", "MAX_TIMEOUT"]

MAX_WORLD_SIZE = 128  # local ranks; beyond that use torchrun on several machines
MAX_TIMEOUT = 7 * 24 * 3600.0  # seconds; a week is already "never"
_GRACE = 1.0  # after a first failure, seconds to wait for the rank that caused it

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


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' → NCCL when there is one GPU per rank, otherwise gloo on the CPU."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    gpus = _gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, GPUs={gpus}")
    return backend


def init_from_env(backend: str = "auto") -> tuple[int, int]:
    """Join the group that `torchrun` describes (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Returns (rank, world_size). Under NCCL each process takes GPU LOCAL_RANK. The group is
    destroyed when the script exits (a group left to the interpreter's shutdown can abort
    the process: "terminate called without an active exception", 2 runs in 8 here).
    """
    _SERVER.close()  # torchrun started this process: no notebook ranks to fork here
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = resolve_backend(backend, local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    join_group(backend, init_method="env://")
    atexit.register(_leave_group)
    return dist.get_rank(), dist.get_world_size()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the caller

def _preload() -> list[str]:
    """What the fork server imports: torch, PyTorch's own parallel APIs (the lessons set
    them beside picolib's; a function that names `torch.tensor` also makes cloudpickle
    import `torch.distributed.tensor` in the rank) and every picolib module."""
    import picolib
    names = [f"picolib.{m.name}" for m in pkgutil.iter_modules(picolib.__path__)
             if m.name != "forkserver"]
    torch_parts = ["torch.distributed." + n for n in
                   ("tensor", "device_mesh", "fsdp", "pipelining", "checkpoint")]
    return ["torch", "torch.distributed", *torch_parts, "cloudpickle", *sorted(names)]


_SERVER = forkserver.ForkServer(_preload())


def _start_early() -> bool:
    """Start the server on import only in a process that may call `run`: not in the server or
    its ranks, not under torchrun, not in a child of `multiprocessing` (spawn re-imports
    this module in every child: a server each would double what spawn costs)."""
    return (not forkserver.in_server() and "TORCHELASTIC_RUN_ID" not in os.environ
            and multiprocessing.parent_process() is None)


if _start_early():
    _SERVER.start()  # returns at once; torch loads in the server while the notebook goes on


def _check_arguments(fn, world_size, timeout):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size} is more than the {MAX_WORLD_SIZE} ranks "
                         "launch.run starts on one machine; use torchrun across machines")
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be a positive, finite number of seconds, at most "
                         f"{MAX_TIMEOUT:g} (a week), not {timeout!r}")
    if in_worker() or forkserver.in_server() or dist.is_initialized():
        raise RuntimeError("launch.run was called inside a rank (or a process already in a "
                           "process group); start ranks from the notebook or script only")
    if not hasattr(os, "fork"):
        raise RuntimeError("launch.run needs fork (Linux, macOS, WSL); on this system use "
                           "torchrun and init_from_env()")


def _user_modules(loaded: frozenset[str]) -> list:
    """Modules of the caller's own code (not installed, not loaded in the fork server).

    Their functions and classes travel by value, like the notebook's: a rank then never
    imports, say, a test module (and pytest with it) just to find one function."""
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix,
                       *site.getsitepackages(), site.getusersitepackages()})
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name not in loaded and name != "__main__" and "." not in name and path
                and not os.path.abspath(path).startswith(installed)):
            out.append(module)
    return out


_PICKLE_LOCK = threading.Lock()  # cloudpickle's by-value registry is process-wide


def _serialise(fn, args, kwargs) -> bytes:
    """cloudpickle (fn, args, kwargs); if that fails, say which one cannot travel and why."""
    _SERVER.wait_ready()
    with _PICKLE_LOCK:
        by_value = [m for m in _user_modules(_SERVER.modules)
                    if not _registered_by_value(m)]
        for m in by_value:
            cloudpickle.register_pickle_by_value(m)
        try:
            return _dumps_or_explain(fn, args, kwargs)
        finally:
            for m in by_value:
                cloudpickle.unregister_pickle_by_value(m)


def _registered_by_value(module) -> bool:
    """Registered already (by the user, say): then leave it so afterwards."""
    return module.__name__ in getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", ())


def _dumps_or_explain(fn, args, kwargs) -> bytes:
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001
        parts = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
        parts += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        for name, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception as e2:  # noqa: BLE001
                raise TypeError(f"{name} (a {type(value).__name__}) cannot be sent to the "
                                f"ranks: {type(e2).__name__}: {e2}") from None
        raise TypeError(f"fn and its arguments cannot be sent to the ranks: {e}") from None


def run(fn: Callable, world_size: int, *args, backend: str = "auto",
        timeout: float = 120.0, device: str | None = None, **kwargs) -> list[Any]:
    """Call `fn(*args, **kwargs)` on ranks 0..world_size-1 and return their results in rank order.

    Inside `fn` the default process group is ready (`dist.get_rank()`, collectives) and
    `device()` is the rank's device. Raises WorkerError if a rank fails, WorkerTimeout
    after `timeout` seconds. backend: "auto" (NCCL with one GPU per rank if there are
    enough, else gloo with the GPUs hidden from the ranks), "nccl", or "gloo" (the ranks
    still see the GPUs: gloo can move CUDA tensors too). device="cuda" with gloo: the
    ranks compute on the GPUs, several ranks sharing one (rank r on GPU r mod count), so
    one GPU can test multi-rank code with CUDA tensors (point-to-point messages then travel
    through CPU copies, which gloo needs).
    """
    _check_arguments(fn, world_size, timeout)
    resolved = resolve_backend(backend, world_size)
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and resolved != "gloo":
        raise ValueError("device='cuda' is for gloo ranks sharing GPUs (backend='gloo'); "
                         "under NCCL each rank has its own GPU already")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a CUDA GPU, and none is visible here")
    _SERVER.start()  # a no-op unless it is not running (first call, or it was killed)
    body = _restarting(_serialise, fn, args, kwargs)
    sys.stdout.flush(), sys.stderr.flush()
    ranks: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="picolib-run-") as workdir:
        settings = pickle.dumps({"world_size": world_size, "backend": resolved,
                                 "timeout": float(timeout), "sys_path": list(sys.path),
                                 "cwd": os.getcwd(), "store": os.path.join(workdir, "store"),
                                 "hide_gpu": backend == "auto" and resolved == "gloo",
                                 "device": device})
        try:
            with tempfile.TemporaryFile(dir=workdir) as payload:
                payload.write(len(settings).to_bytes(8, "big") + settings + body)
                payload.flush()
                ranks.append(_restarting(_Rank.start, 0, payload))
                for rank in range(1, world_size):  # a server that dies now fails the run
                    ranks.append(_Rank.start(rank, payload))
            results = _collect(ranks, timeout, _code_index(fn, args, kwargs))
            for r in ranks:  # all done: let every rank leave the group
                r.send_exit()
            _wait_exits(ranks, 10.0)
            return results
        finally:
            _end(ranks)
            sys.stdout.flush()


def _restarting(step, *args):
    """`step(*args)`, once more on a fresh server if the server was found dead. Before a run's
    first rank exists nothing of the run is lost: the server died since the last run (killed,
    the out-of-memory killer) and `kill` returns before the process is gone, so the caller
    may not have noticed yet. Once a rank is running, a dead server is the run's error."""
    try:
        return step(*args)
    except forkserver.ServerDied:
        _SERVER.start()
        return step(*args)


class _Rank:
    """The caller's view of one rank: its pipe, its status pipe, its stack file, the file
    its C/C++ code writes to as stderr."""

    def __init__(self, rank, conn, status, stack, stderr=None):
        self.rank, self.conn, self.status, self.stack = rank, conn, status, stack
        self.stderr = stderr
        self.pid: int | None = None
        self.exit_code: int | None = None  # set once the server reports it
        self.exited = False

    @classmethod
    def start(cls, rank, payload) -> "_Rank":
        ours, theirs = mpc.Pipe(duplex=True)
        status_r, status_w = os.pipe()
        r = cls(rank, ours, status_r, tempfile.TemporaryFile("w+b"), tempfile.TemporaryFile("w+b"))
        try:
            r.pid = _SERVER.spawn(rank, status_w, [theirs.fileno(), r.stack.fileno(),
                                                   payload.fileno(), r.stderr.fileno()])
        except BaseException:
            r.close()
            raise
        finally:
            theirs.close()
            os.close(status_w)
        return r

    def read_exit(self) -> None:
        text = os.read(self.status, 64)
        self.exited = True
        self.exit_code = int(text) if text else None  # nothing: the server itself died

    def send_exit(self) -> None:
        try:
            self.conn.send("exit")
        except OSError:
            pass

    def stack_text(self, index: dict | None = None) -> str:
        self.stack.seek(0)
        lines = [ln for ln in self.stack.read().decode(errors="replace").splitlines()
                 if ln.strip()]
        return f"--- rank {self.rank} was here ---\n" + with_source("\n".join(lines[:12]), index)

    def stderr_text(self) -> str:
        """What the rank's C/C++ code wrote to stderr (Python's stderr travels on the pipe)."""
        if self.stderr is None or self.stderr.closed:
            return ""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def close(self) -> None:
        self.conn.close()
        if self.status >= 0:
            os.close(self.status)
            self.status = -1
        self.stack.close()
        if self.stderr is not None:
            text = self.stderr_text()
            if text.strip():      # where it went before it was captured: the caller's fd 2
                os.write(2, "".join(f"[rank {self.rank}] {line}\n"
                                    for line in text.rstrip().splitlines()).encode())
            self.stderr.close()


_FRAME_LINE = re.compile(r'^(\s*)File "([^"]+)", line (\d+)')


def _code_index(*roots, depth: int = 3) -> dict[str, list]:
    """{function name: [code objects]} of the functions in `roots` (functions, classes and
    their methods, containers of them, the functions their globals name, nested code):
    cloudpickle ships code by value as "<dynamic-code>", so the caller keeps where it was."""
    index: dict[str, list] = {}
    seen: set[int] = set()

    def code(c, d):
        if id(c) in seen:
            return
        seen.add(id(c))
        index.setdefault(c.co_name, []).append(c)
        for const in c.co_consts:
            if hasattr(const, "co_code"):
                code(const, d)

    def visit(obj, d):
        if d < 0 or id(obj) in seen:
            return
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if hasattr(obj, "__code__") and hasattr(obj, "__globals__"):
            seen.add(id(obj))
            code(obj.__code__, d)
            for name in obj.__code__.co_names:
                g = obj.__globals__.get(name)
                if hasattr(g, "__code__") or isinstance(g, type):
                    visit(g, d - 1)
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, d - 1)
                except ValueError:
                    pass
        elif isinstance(obj, type) and obj.__module__ not in ("builtins",) and \
                not obj.__module__.startswith(("torch", "picolib")):
            seen.add(id(obj))
            for value in vars(obj).values():
                visit(value, d - 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj[:64]:
                visit(value, d)
        elif isinstance(obj, dict):
            for value in list(obj.values())[:64]:
                visit(value, d)

    for root in roots:
        visit(root, depth)
    return index


def _dynamic_file(index, name: str, line: int) -> str | None:
    """The file of the function `name` that holds `line` (a frame of shipped code)."""
    for c in (index or {}).get(name, ()):
        lines = [ln for _, _, ln in c.co_lines() if ln is not None]
        if lines and min(lines + [c.co_firstlineno]) <= line <= max(lines):
            return c.co_filename
    return None


def with_source(text: str, index: dict | None = None) -> str:
    """`text` (a rank's traceback or stack dump) with the source line under each frame that
    lacks one, read in the caller: a notebook cell's code is known here, not in the rank.
    Frames of code shipped by value ("<dynamic-code>") are found through `index`
    (`_code_index` of what was shipped), and their file named."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        out.append(line)
        m = _FRAME_LINE.match(line)
        if not m:
            continue
        path = m[2]
        if path == "<dynamic-code>":
            fn = re.search(r"line \d+,? in (\S+)", line)
            path = _dynamic_file(index, fn[1] if fn else "", int(m[3])) or path
            if path != "<dynamic-code>":
                out[-1] = line.replace('"<dynamic-code>"', f'"{path}"', 1)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if nxt.strip() and not _FRAME_LINE.match(nxt) and not nxt.startswith("---") \
                and nxt.startswith(m[1] + "  "):
            continue                                   # the rank printed it already
        source = linecache.getline(path, int(m[3])).strip()
        if source:
            out.append(f"{m[1]}    {source}")
    return "\n".join(out)


def _death(r: _Rank) -> str:
    """Why a rank ended without a word, from its exit code."""
    code = r.exit_code
    if code is None:
        return "the picolib fork server died, and took the rank with it"
    if code < 0:
        sig = signal.Signals(-code)
        why = {signal.SIGKILL: " (out of memory? killed by someone?)",
               signal.SIGSEGV: " (a crash in C or C++ code)",
               signal.SIGABRT: " (a C/C++ assertion or abort())"}.get(sig, "")
        return f"the process was killed by {sig.name}: {signal.strsignal(sig)}{why}{_last_words(r)}"
    return f"the process exited with code {code} without returning a result{_last_words(r)}"


_ENFORCE = re.compile(r"^\[enforce fail at [^\]]*\]\s*")


def _last_words(r: _Rank) -> str:
    """What a rank that died wrote to stderr from C/C++ before it went: an uncaught C++
    exception's `what()` (gloo's "... Is there a distributed collective mismatch in your
    code?"), else its last line; "" when it wrote nothing."""
    lines = [ln.strip() for ln in r.stderr_text().splitlines() if ln.strip()]
    if not lines:
        return ""
    thrown = next((ln for ln in lines if ln.startswith("terminate called after throwing")), "")
    what = next((ln.split("what():", 1)[1].strip() for ln in lines if "what():" in ln), "")
    kind = re.search(r"instance of '([^']+)'", thrown)
    said = _ENFORCE.sub("", what) if what else lines[-1]
    return f"; it wrote: {kind[1] + ': ' if kind else ''}{said}"


def _collect(ranks: list[_Rank], timeout: float, index: dict | None = None) -> list[Any]:
    """Every rank's result, or the WorkerError / WorkerTimeout that explains why not."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}  # in order of arrival
    silent: list[int] = []  # ranks that ended without a result or an error, in order
    first_failure = None

    def handle(r: _Rank, msg) -> None:
        nonlocal first_failure
        kind = msg[0]
        if kind in ("out", "err"):
            print("\n".join(f"[rank {r.rank}] {line}" for line in msg[1].split("\n")),
                  file=sys.stdout if kind == "out" else sys.stderr, flush=True)
        elif kind == "result":
            try:
                results[r.rank] = cloudpickle.loads(msg[1])
            except Exception as e:  # noqa: BLE001
                errors[r.rank] = (f"its result could not be unpickled in the caller "
                                  f"({type(e).__name__}: {e})", "")
        elif kind == "error":
            errors[r.rank] = (msg[1], msg[2])
        if r.rank in errors and first_failure is None:
            first_failure = time.monotonic()

    def drain(r: _Rank) -> None:
        while not r.conn.closed:
            try:
                if not r.conn.poll():
                    return
                handle(r, r.conn.recv())
            except (EOFError, OSError):
                r.conn.close()

    while True:
        pending = [r for r in ranks if r.rank not in results and r.rank not in errors
                   and r.rank not in silent]
        now = time.monotonic()
        if not pending or (first_failure is not None and now > first_failure + _GRACE):
            break
        if first_failure is None and now >= deadline:
            waiting = [r.rank for r in pending]
            _SERVER.signal([r.pid for r in pending], signal.SIGUSR1)
            time.sleep(0.3)
            raise WorkerTimeout(
                f"ranks {waiting} did not finish within {timeout:g} s (a collective that "
                f"some rank never called? a deadlock in send/recv?); all ranks were stopped\n"
                + "\n".join(r.stack_text(index) for r in pending))
        wait_for = deadline - now if first_failure is None else first_failure + _GRACE - now
        by_object = {}
        for r in pending:
            if not r.conn.closed:
                by_object[r.conn] = r
            if not r.exited:
                by_object[r.status] = r
        for obj in mpc.wait(list(by_object), timeout=max(0.0, min(wait_for, 1.0))):
            r = by_object[obj]
            if obj is r.conn:
                drain(r)
                continue
            r.read_exit()
            drain(r)  # what it said before it went
            if r.rank not in results and r.rank not in errors:
                silent.append(r.rank)
                first_failure = first_failure or time.monotonic()
    if silent or errors:
        culprit = _culprit(silent, errors)
        others = sorted((set(silent) | set(errors)) - {culprit})
        also = f" (rank{'s' if len(others) > 1 else ''} {others} failed too)" if others else ""
        if culprit in errors:
            message, tb = errors[culprit]
            tb = with_source(tb, index)
        else:
            message, tb = _death(ranks[culprit]), ""
        raise WorkerError(culprit, message + also, tb)
    return [results[r.rank] for r in ranks]


# What a rank raises when a peer has gone (gloo's transport, NCCL's abort): a consequence, not a cause
_PEER_GONE = re.compile(r"gloo/transport/|Connection (closed|reset) by peer|remote process exited|"
                        r"communicator was aborted", re.I)


def _culprit(silent: list[int], errors: dict) -> int:
    """The rank to blame: the first that died without a word; else the first whose error is its
    own — not a peer's disappearance, which a failing rank causes in every rank waiting on it in
    a collective, sometimes before its own error reaches the caller; else the first error."""
    if silent:
        return silent[0]
    own = [r for r, (message, _) in errors.items() if not _PEER_GONE.search(message)]
    return own[0] if own else next(iter(errors))


def _wait_exits(ranks: list[_Rank], seconds: float) -> None:
    """Wait (bounded) until the server has reported every rank's exit."""
    deadline = time.monotonic() + seconds
    while True:
        left = [r for r in ranks if not r.exited and r.status >= 0]
        if not left or time.monotonic() >= deadline:
            return
        by_fd = {r.status: r for r in left}
        for fd in mpc.wait(list(by_fd), timeout=max(0.0, deadline - time.monotonic())):
            by_fd[fd].read_exit()


def _end(ranks: list[_Rank]) -> None:
    """Kill what is left of every rank (and all it started); wait for it; close the pipes."""
    alive = [r.pid for r in ranks if not r.exited and r.pid is not None]
    if alive:
        _SERVER.signal(alive, signal.SIGKILL, whole_group=True)
        _wait_exits(ranks, 30.0)
    for r in ranks:
        r.close()
