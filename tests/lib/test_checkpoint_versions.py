"""Checkpoints that never lose a run: `--save DIR` writes DIR/step-NNNNNN/ atomically (a
temporary name renamed once every rank has finished), keeps the newest `--keep`, and
`--resume DIR` takes the newest complete one. A trainer killed (SIGKILL of its whole process
group) at random moments during periodic saves always resumes onto the uninterrupted curve.
Folders that cannot work are refused before any rank starts."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import alive, child_pids

from picolib import checkpoint
from picolib.compose import TrainConfig, check_config
from picolib.launch import run
from picolib.train import main, train

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = dict(dp=2, zero=1, micro_batches=2)      # the configuration the user ran
STEPS = 8


def _run(**options):
    cfg = TrainConfig(**{"steps": STEPS, "progress": False, **OPTIONS, **options})
    check_config(cfg, 2)
    return [r["loss"] for r in run(train, 2, cfg, timeout=240)[0]]


@pytest.fixture(scope="module")
def straight():
    return _run()


def test_steps_are_versioned_and_only_the_newest_are_kept(tmp_path, straight):
    ckpt = tmp_path / "ckpt"
    assert _run(save=str(ckpt), save_every=2, keep=2) == straight
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000006", "step-000008"]
    assert checkpoint.latest(ckpt) == ckpt / "step-000008"
    # resume from the newest (nothing left to do past step 8: train two more) and from a given step
    more = _run(resume=str(ckpt), steps=STEPS + 2)
    ten = _run(steps=STEPS + 2)
    assert max(abs(a - b) for a, b in zip(more, ten[STEPS:], strict=True)) <= 1e-6
    from_six = _run(resume=str(ckpt / "step-000006"))
    assert max(abs(a - b) for a, b in zip(from_six, straight[6:], strict=True)) <= 1e-6


@pytest.mark.parametrize("make, option, message", [
    (lambda d: None, "resume", r"no such folder"),
    (lambda d: d.mkdir(), "resume", r"no complete checkpoint in it"),
    (lambda d: (d / ".step-000004.tmp").mkdir(parents=True), "resume",
     r"no complete checkpoint in it \(only incomplete saves: \.step-000004\.tmp\)"),
    (lambda d: (d.mkdir(), (d / "notes.txt").write_text("mine")), "save",
     r"the folder holds other files \(notes\.txt\)"),
    (lambda d: d.write_text("a file"), "save", r"it is a file, not a folder"),
], ids=["missing", "empty", "only a half-written save", "save over other files", "save onto a file"])
def test_folders_that_cannot_work_are_refused_before_any_rank_starts(tmp_path, capsys, make, option, message):
    folder = tmp_path / "ckpt"
    make(folder)
    with pytest.raises(ValueError, match=message):
        check_config(TrainConfig(**{option: str(folder)}, progress=False), 1)
    with pytest.raises(SystemExit) as exit_:               # the command line: one line, exit 2
        main([f"--{option}", str(folder), "--no-progress"])
    assert exit_.value.code == 2
    assert "error: --" + option in capsys.readouterr().err


def test_a_checkpoint_of_another_model_names_the_tensor_and_both_shapes(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig(steps=1, progress=False, save=str(ckpt))
    run(train, 1, cfg, timeout=120)
    with pytest.raises(ValueError, match=r"embed\.weight is \(256, 32\) in the checkpoint but "
                                         r"\(256, 256\) in this model; .*another --preset"):
        check_config(TrainConfig(preset="base", resume=str(ckpt), progress=False), 1)


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    out, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(child_pids(p) for p in frontier)) - out
        out |= frontier
    return out


def _wait_gone(pids: set[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, f"processes of the killed run still alive after {timeout} s: {sorted(left)}"


def _trainer(save: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "picolib.train", "--nproc", "2", "--dp", "2", "--zero", "1",
           "--micro-batches", "2", "--steps", str(STEPS), "--save", str(save), "--save-every", "1",
           "--log", str(log), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)           # its own process group


def test_a_kill_at_any_moment_of_periodic_saves_never_loses_the_run(tmp_path, straight):
    """Ten kills at random moments of the periodic saves of a run that saves after every step:
    each waits until rank 0 has logged a random step (its save starts right after) and then a
    random fraction of a second, so the kills land before, inside and after saves whatever the
    machine's load. Each time the newest complete step resumes onto the uninterrupted curve
    (fp32, within 1e-6), and every step folder left behind loads."""
    rng = random.Random(1234)
    resumed_from = []
    for attempt in range(10):
        ckpt, log = tmp_path / f"run{attempt}", tmp_path / f"log{attempt}.jsonl"
        p = _trainer(ckpt, log)
        target, deadline = rng.randrange(STEPS), time.monotonic() + 240
        while p.poll() is None and time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) > target:
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.4))
        family = _descendants(p.pid)      # its fork server and ranks (each rank its own group)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        _wait_gone(family)   # a rank dies a moment after its server: a rename it had begun
        # may still land then, and is part of what the kill left (read nothing before)
        for step in checkpoint.step_folders(ckpt):        # nothing half-written is ever named step-N
            checkpoint.check_resume(step, TrainConfig().model_config())
        newest = checkpoint.latest(ckpt) if ckpt.exists() else None
        start = int(newest.name[5:]) if newest else 0
        resumed_from.append(start)
        rest = _run(resume=str(ckpt), save=str(ckpt), save_every=1) if newest else _run(save=str(ckpt))
        assert len(rest) == STEPS - start                  # killed after the last save: nothing left
        assert all(abs(a - b) <= 1e-6 for a, b in zip(rest, straight[start:])), \
            (attempt, start, rest, straight)
        assert not list(ckpt.glob(".*")), f"leftovers after a completed run: {list(ckpt.glob('.*'))}"
    assert sum(0 < s < STEPS for s in resumed_from) >= 3, f"too few kills between saves: {resumed_from}"
