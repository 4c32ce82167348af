import time

import pytest

from helpers import child_pids


@pytest.fixture
def no_leftover_workers():
    """Fails the test if any child process is still alive shortly after it."""
    before = child_pids()
    yield
    deadline = time.monotonic() + 2.0
    while (left := child_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"worker processes left behind: {sorted(left)}"
