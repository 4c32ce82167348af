"""Local ranks listen on loopback only, whatever the machine's name resolves to (issue: a
Debian laptop maps its hostname to 127.0.1.1, many servers to their network address, and
gloo's default device binds there). The test gives the ranks a hostname that resolves to
127.0.1.1 — in a private mount and UTS namespace, so the machine's own /etc/hosts and name are
untouched — and reads every TCP socket the ranks hold from /proc/net/tcp."""
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from picolib.rank import loopback_interface

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = textwrap.dedent('''
    import os, socket, sys
    import torch
    import torch.distributed as dist
    from picolib import comm
    from picolib.launch import run

    def tcp_sockets():
        t = torch.ones(4)
        comm.all_reduce(t)                       # the world group's connections
        comm.all_reduce(t, group=dist.new_group([0, 1]))   # and a sub-group's
        mine = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                mine.add(link[8:-1])
        found = []
        for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
            try:
                rows = open(path).read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                f = row.split()
                if f[9] not in mine:
                    continue
                raw = bytes.fromhex(f[1].split(":")[0])
                if family == socket.AF_INET:
                    raw = raw[::-1]
                else:                               # four little-endian 32-bit words
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.append((socket.inet_ntop(family, raw), "LISTEN" if f[3] == "0A" else "CONN"))
        return found

    print("HOST", socket.gethostbyname(socket.gethostname()))
    for rank, found in enumerate(run(tcp_sockets, 3)):
        for addr, state in found:
            print("SOCKET", rank, addr, state)
    ''')


def _can_make_namespaces() -> str:
    if not sys.platform.startswith("linux"):
        return "needs Linux (/proc/net/tcp and mount namespaces)"
    if os.geteuid() != 0:
        return "needs root to make a private mount namespace with its own /etc/hosts"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    ok = subprocess.run(["unshare", "-m", "-u", "true"], capture_output=True)
    if ok.returncode != 0:
        return f"unshare -m -u is not permitted here: {ok.stderr.decode().strip()}"
    return ""


def test_the_loopback_interface_is_found():
    name = loopback_interface()
    assert name in ("lo", "lo0")
    assert name in [n for _, n in socket.if_nameindex()]


@pytest.mark.skipif(bool(_can_make_namespaces()), reason=_can_make_namespaces() or "-")
def test_ranks_listen_on_loopback_when_the_hostname_resolves_elsewhere(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 picolib-elsewhere\n")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    script = f"mount --bind {hosts} /etc/hosts && hostname picolib-elsewhere && " \
             f"exec {sys.executable} {probe}"
    out = subprocess.run(["unshare", "-m", "-u", "sh", "-c", script], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "HOST 127.0.1.1" in lines, "the namespace did not make the hostname resolve elsewhere"
    sockets = [line.split()[1:] for line in lines if line.startswith("SOCKET")]
    listening = [s for s in sockets if s[2] == "LISTEN"]
    assert {int(s[0]) for s in listening} == {0, 1, 2}, f"every rank listens somewhere: {sockets}"
    elsewhere = [s for s in sockets if s[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not elsewhere, f"ranks hold sockets off 127.0.0.1: {elsewhere}"


def test_importing_the_launcher_on_windows_says_to_use_wsl2():
    code = "import sys; sys.platform = 'win32'; import picolib.launch"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "WSL2" in last, last
