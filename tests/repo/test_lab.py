"""`make lab` serves the repository, so a learner who follows the quick start can open the
exercises and docs as well as the lessons, and it opens on lesson 00. The test starts the
very command `make lab` runs (read from `make -n lab`) on a free port and asks the running
server's contents API what it serves."""
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lab_command() -> list[str]:
    out = subprocess.run(["make", "-s", "-n", "lab", f"PYTHON={sys.executable}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    line = [ln for ln in out.splitlines() if "jupyter lab" in ln][-1]
    cmd = shlex.split(line)
    cmd[0] = str(Path(sys.executable).parent / "jupyter")   # the suite's own environment
    return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str):
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


@pytest.mark.skipif(not (Path(sys.executable).parent / "jupyter").exists(),
                    reason="JupyterLab is not installed in this environment (pip install -e '.[notebooks]')")
def test_make_lab_serves_lessons_exercises_and_docs_and_opens_lesson_00(tmp_path):
    cmd = _lab_command()
    assert "--LabApp.default_url=/lab/tree/notebooks/00_collectives.ipynb" in cmd, \
        f"make lab does not open on lesson 00: {cmd}"
    port, token = _free_port(), "picolib-test"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    server = subprocess.Popen(cmd + ["--no-browser", f"--ServerApp.port={port}",
                                     f"--IdentityProvider.token={token}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                root = _get(f"{base}/api/contents/", token)
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"jupyter lab exited: {server.stdout.read()[-2000:]}")
                time.sleep(0.5)
        else:
            pytest.fail("jupyter lab did not answer within 60 s")
        served = {item["name"] for item in root["content"] if item["type"] == "directory"}
        assert {"notebooks", "exercises", "docs"} <= served, f"the server's root holds {sorted(served)}"
        exercises = {item["name"] for item in _get(f"{base}/api/contents/exercises", token)["content"]}
        assert "00_collectives.ipynb" in exercises and len(exercises) >= 12, sorted(exercises)
        lesson = _get(f"{base}/api/contents/notebooks/00_collectives.ipynb?content=0", token)
        assert lesson["type"] == "notebook"
        with urllib.request.urlopen(urllib.request.Request(
                f"{base}/?token={token}"), timeout=10) as landing:   # where a browser lands
            assert landing.geturl().split("?")[0].endswith("/lab/tree/notebooks/00_collectives.ipynb"), \
                landing.geturl()
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
