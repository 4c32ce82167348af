"""Helpers shared by the test modules (imported, never collected)."""
from __future__ import annotations

import os


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def child_pids(parent: int | None = None) -> set[int]:
    """PIDs of the live (non-zombie) children of `parent` (this process by default)."""
    parent = os.getpid() if parent is None else parent
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields is not None and int(fields[1]) == parent and fields[0] != "Z":
                out.add(int(entry))
    return out


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
