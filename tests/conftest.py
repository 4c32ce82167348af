import os
import time

import pytest


def child_pids() -> set[int]:
    """PIDs of this process's live (non-zombie) children, read from /proc."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(entry))
    return out


@pytest.fixture
def no_leftover_workers():
    """Fails the test if any child process is still alive shortly after it."""
    before = child_pids()
    yield
    deadline = time.monotonic() + 2.0
    while (left := child_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"worker processes left behind: {sorted(left)}"
