import sys
import time
from pathlib import Path

import pytest

# tests/ is split into lib/, lessons/ and repo/; helpers.py stays here, so every folder's
# tests can say `from helpers import ...`
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from helpers import child_pids  # noqa: E402


@pytest.fixture
def no_leftover_workers():
    """Fails the test if any child process is still alive shortly after it."""
    before = child_pids()
    yield
    deadline = time.monotonic() + 2.0
    while (left := child_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"worker processes left behind: {sorted(left)}"
