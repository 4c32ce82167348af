"""Checkpoints that never lose a run: `--save DIR` writes DIR/step-NNNNNN/ atomically (a
temporary name renamed once every rank has finished), keeps the newest `--keep`, and
`--resume DIR` takes the newest complete one. A trainer killed (SIGKILL of its whole process
group) at each moment of a save that leaves something different on disk always resumes onto
the uninterrupted curve.
Folders that cannot work are refused before any rank starts."""
import json
import os
import signal
import subprocess
import sys
import textwrap
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


KILLED = textwrap.dedent("""
    import os, signal, sys
    from picolib import checkpoint
    from picolib.compose import TrainConfig
    from picolib.launch import run
    from picolib.train import train

    def killed_train(cfg, group, moment, at):
        \"\"\"train(cfg), but rank 0 SIGKILLs the caller's process group (the caller, its fork
        server; the ranks follow their server) and itself at `moment` of the save of step `at`.\"\"\"
        import shutil
        import torch.distributed as dist
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        def kill(when):
            if when and dist.get_rank() == 0:
                os.killpg(group, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

        def killing(name, fn, first):
            def wrapped(*args, **kwargs):
                mine = moment == name and checkpoint.saving == at
                kill(mine and first)
                out = fn(*args, **kwargs)
                kill(mine and not first)
                return out
            return wrapped

        save, rmtree = checkpoint.save, shutil.rmtree
        def counting_save(*args, **kwargs):
            checkpoint.saving = args[5]                              # next_step: the step saved
            kill(moment == "before the save" and checkpoint.saving == at)
            return save(*args, **kwargs)
        checkpoint.save = counting_save
        FileSystemWriter.finish = killing("files written, no metadata", FileSystemWriter.finish, True)
        checkpoint.dcp.save = killing("written, not renamed", checkpoint.dcp.save, False)
        checkpoint._sync_folder = killing("renamed, older not pruned", checkpoint._sync_folder, False)
        def pruning(path, *args, **kwargs):
            kill(moment == "pruning" and checkpoint.saving == at and ".old-step" in str(path))
            return rmtree(path, *args, **kwargs)
        checkpoint.shutil.rmtree = pruning
        return train(cfg)

    save, moment, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = TrainConfig(steps=%d, save=save, save_every=1, progress=False, **%r)
    run(killed_train, 2, cfg, os.getpid(), moment, at, timeout=240)
""" % (STEPS, OPTIONS))


# (where the kill lands, in the save of which step, what it leaves, the step resumed from)
MOMENTS = [("before the save", 1, "nothing yet", 0),
           ("files written, no metadata", 3, "a .tmp folder without .metadata", 2),
           ("written, not renamed", 4, "a complete .tmp folder", 3),
           ("renamed, older not pruned", 8, "three step folders", 8),   # nothing left to run
           ("pruning", 8, "a half-pruned .old- folder", 8)]             # nor here: still tidied


@pytest.mark.parametrize("moment, at, leaves, start", MOMENTS, ids=[m[0] for m in MOMENTS])
def test_a_kill_at_any_moment_of_periodic_saves_never_loses_the_run(tmp_path, straight, moment, at, leaves, start):
    """A run that saves after every step, SIGKILLed (its whole process group) at each moment
    of a save where what is on disk differs: before it starts (as anywhere between saves),
    with the data files written but not DCP's metadata, with the folder complete but not yet
    renamed, renamed but the oldest not yet pruned, and during pruning. Each leaves what that
    moment should; the newest complete step resumes onto the uninterrupted curve (fp32,
    within 1e-6); every step folder left behind loads; the resumed run leaves nothing else."""
    ckpt = tmp_path / "ckpt"
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(ckpt), moment, str(at)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                         stderr=(tmp_path / "err").open("w"), start_new_session=True)   # its own group
    family = set()
    while p.poll() is None:           # its fork server and ranks (each rank its own group)
        family |= _descendants(p.pid)
        time.sleep(0.05)
    assert p.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()[-2000:]
    _wait_gone(family)   # a rank dies a moment after its server: a rename it had begun
    # may still land then, and is part of what the kill left (read nothing before)
    names = sorted(q.name for q in ckpt.iterdir()) if ckpt.exists() else []
    step = [f"step-{s:06d}" for s in range(at)]
    assert names == {"before the save": [],
                     "files written, no metadata": [f".step-{at:06d}.tmp", *step[-2:]],
                     "written, not renamed": [f".step-{at:06d}.tmp", *step[-2:]],
                     "renamed, older not pruned": [*step[-2:], f"step-{at:06d}"],
                     "pruning": [f".old-step-{at - 2:06d}", *step[-1:], f"step-{at:06d}"]}[moment], leaves
    if moment != "before the save":
        tmp = ckpt / f".step-{at:06d}.tmp"
        assert (tmp / ".metadata").exists() == (moment == "written, not renamed")
        assert moment.startswith("renamed") or moment == "pruning" or any(tmp.glob("*.distcp"))
    for folder in checkpoint.step_folders(ckpt):        # nothing half-written is ever named step-N
        checkpoint.check_resume(folder, TrainConfig().model_config())
    newest = checkpoint.latest(ckpt) if ckpt.exists() else None
    assert (int(newest.name[5:]) if newest else 0) == start
    rest = _run(resume=str(ckpt), save=str(ckpt), save_every=1) if newest else _run(save=str(ckpt))
    assert len(rest) == STEPS - start                  # killed after the last save: nothing left
    assert all(abs(a - b) <= 1e-6 for a, b in zip(rest, straight[start:])), (moment, start, rest, straight)
    assert not list(ckpt.glob(".*")), f"leftovers after a completed run: {list(ckpt.glob('.*'))}"
