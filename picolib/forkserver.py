"""A clean process to fork ranks from (lesson 00 explains why).

On a CUDA build with a GPU, a process that has run one autograd backward, or touched
CUDA, can never again fork a child that runs backward or uses CUDA. A notebook does
both all the time: every lesson trains a single-process reference next to its ranks.
So `launch.run` never forks the caller. It asks a *fork server* instead: a fresh
interpreter, started once per caller, that imports torch and picolib and then does
nothing but fork on request. It never runs user code, never computes, never touches
CUDA, so every fork starts clean — and, the modules being loaded already, in
milliseconds.

The conversation is one UNIX socket pair between the caller and the server; each
request gets one answer:

    ("spawn", rank)  + file descriptors     ->  ("pid", pid)
    ("signal", pids, signum, whole_group)   ->  ("ok",)

Each rank leads a process group of its own. When a rank exits, the server reaps it,
kills whatever is left of its group (processes the rank started) and writes the exit
code to the rank's status pipe, which the caller is waiting on. When the caller goes
away — it closes the socket, or it dies and the kernel closes it — the server kills
every rank's group and exits: nothing outlives the caller.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback

__all__ = ["ForkServer", "ServerDied", "in_server"]

_HEADER = struct.Struct("!Q")
_IN_SERVER = False  # true in the server and in every rank forked from it


def in_server() -> bool:
    """True in the fork server and in the ranks it forks (so they never start one)."""
    return _IN_SERVER


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies. macOS has no such signal: there
    the server still kills every rank when the caller's socket closes (the caller exited or
    died), but ranks whose server is itself killed outright end only at their group timeout."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


# ------------------------------------------------------------------ messages with fds

def send_message(sock: socket.socket, obj, fds=()) -> None:
    data = pickle.dumps(obj)
    socket.send_fds(sock, [_HEADER.pack(len(data))], list(fds))
    sock.sendall(data)


def recv_message(sock: socket.socket):
    """One message and the descriptors that came with it; EOFError when the peer is gone."""
    head, fds = b"", []
    while len(head) < _HEADER.size:
        chunk, new_fds, _, _ = socket.recv_fds(sock, _HEADER.size - len(head), 16)
        if not chunk:
            for fd in new_fds:
                os.close(fd)
            raise EOFError
        head, fds = head + chunk, fds + new_fds
    (size,) = _HEADER.unpack(head)
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return pickle.loads(data), fds


# ------------------------------------------------------------------ the server process

def serve(fd: int, preload: list[str]) -> None:
    """The server's main loop (runs in the fresh interpreter `ForkServer.start` began)."""
    global _IN_SERVER
    _IN_SERVER = True
    sock = socket.socket(fileno=fd)
    try:
        try:
            for name in preload:
                try:
                    __import__(name)
                except Exception:  # noqa: BLE001 - a rank that needs it imports it (and says why)
                    if name == "torch":
                        raise
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                raise RuntimeError(f"importing {preload} initialised CUDA in the fork server")
            reply = ("ready", sorted(sys.modules))
        except BaseException:  # noqa: BLE001 - the caller must see why we could not start
            reply = ("failed", traceback.format_exc())
        send_message(sock, reply)
    except OSError:
        return  # the caller went away while we were loading
    if reply[0] == "failed":
        return
    children: dict[int, int] = {}  # rank pid -> write end of its status pipe
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False), os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD reaches wake_w
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's ^C is the caller's business
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj == wake_r:
                    while True:
                        try:
                            if not os.read(wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                    _reap(children)
                    continue
                try:
                    msg, fds = recv_message(sock)
                except (EOFError, ConnectionError):
                    return  # the caller is gone
                if msg[0] == "spawn":
                    pid = _fork_rank(msg[1], fds, sock, sel, (wake_r, wake_w), children)
                    send_message(sock, ("pid", pid))
                elif msg[0] == "signal":
                    _, pids, signum, whole_group = msg
                    for pid in pids:
                        if pid in children:
                            try:
                                (os.killpg if whole_group else os.kill)(pid, signum)
                            except ProcessLookupError:
                                pass
                    send_message(sock, ("ok",))
    finally:
        for pid in list(children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(children, block=True)


def _fork_rank(rank, fds, sock, sel, wake, children) -> int:
    status_w, rank_fds = fds[0], fds[1:]
    pid = os.fork()
    if pid == 0:  # the rank
        code = 1
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            die_with_parent()
            if os.getppid() == 1:  # the server died before we asked
                os._exit(1)
            sel.close(), sock.close()
            for fd in (*wake, status_w, *children.values()):
                os.close(fd)
            from .rank import rank_main
            code = rank_main(rank, *rank_fds)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # also here, so a kill sent before the child ran still works
    except OSError:
        pass
    for fd in rank_fds:
        os.close(fd)
    children[pid] = status_w
    return pid


def _reap(children: dict[int, int], block: bool = False) -> None:
    """Collect exited ranks: kill what each left in its process group, report its code."""
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is None:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever the rank started goes with it
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
        except OSError:
            pass
        os.close(fd)


# ------------------------------------------------------------------ the caller's side

class ServerDied(RuntimeError):
    """The fork server went away (killed, the out-of-memory killer) while the caller spoke to it."""


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "it had been stopped"
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}: out of memory? killed by someone?"
    return f"exit code {code}"


class ForkServer:
    """The caller's handle on its fork server: start it, ask it to fork or signal ranks."""

    def __init__(self, preload: list[str]):
        self.preload = list(preload)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self.modules: frozenset[str] = frozenset()  # what the server has imported
        self._owner = os.getpid()  # a process forked from the owner must start its own

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        if self._owner != os.getpid():  # we are a fork of the caller: that server is not ours
            self._disown()
        return self._proc is not None and self._proc.poll() is None

    def _disown(self) -> None:
        if self._sock is not None:
            self._sock.close()  # our copy only; the caller keeps its connection
        self._sock, self._proc, self._ready, self._owner = None, None, False, os.getpid()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the server if it is not running; returns at once (it preloads meanwhile)."""
        with self._lock:
            if self.alive():
                return
            self._close_locked()
            ours, theirs = socket.socketpair()
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            # should anything ask torch whether a GPU exists, ask NVML, which (unlike the
            # CUDA runtime) leaves the server fit to fork ranks that use CUDA
            env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
            code = (f"import picolib.forkserver as f; "
                    f"f.serve({theirs.fileno()}, {self.preload!r})")
            self._proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                                          pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            self._sock, self._ready = ours, False

    def wait_ready(self) -> None:
        """Block until the server has finished importing (the first call's wait)."""
        self._request(None)

    def _request(self, msg, fds=()):
        with self._lock:
            if self._sock is None or not self.alive():
                code = self._close_locked()
                raise ServerDied(f"the picolib fork server is not running ({_how_it_ended(code)})")
            try:
                if not self._ready:
                    reply, _ = recv_message(self._sock)
                    if reply[0] != "ready":
                        raise RuntimeError("the picolib fork server could not start:\n"
                                           + reply[1])
                    self._ready, self.modules = True, frozenset(reply[1])
                if msg is None:
                    return None
                send_message(self._sock, msg, fds)
                reply, _ = recv_message(self._sock)
            except (EOFError, OSError) as e:
                code = self._close_locked()
                raise ServerDied(f"the picolib fork server died ({_how_it_ended(code)})") from e
            except BaseException:  # interrupted mid-conversation: start afresh next time
                self._close_locked()
                raise
            return reply

    def spawn(self, rank: int, status_w: int, fds: list[int]) -> int:
        """Fork one rank; it receives `fds`. The server reports its exit code on `status_w`."""
        return self._request(("spawn", rank), [status_w, *fds])[1]

    def signal(self, pids, signum: int, whole_group: bool = False) -> None:
        """Send `signum` to those of `pids` that have not exited (to their groups if asked)."""
        if self.alive():
            try:
                self._request(("signal", list(pids), signum, whole_group))
            except RuntimeError:
                pass  # a dead server took its ranks with it

    def close(self) -> None:
        """Stop the server; it kills every rank it still has."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> int | None:
        """Close the socket (a live server then exits), reap the server; its exit code."""
        code = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            self._proc = None
        return code
