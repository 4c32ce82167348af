"""picolib.data: the shipped corpus, text and token files, each dp rank reading only its share,
the held-out split, and the mean loss over all tokens."""
import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from picolib.data import (COURSE, VAL_FRACTION, TokenData, global_mean_loss, main,
                          mean_token_loss, prepare, val_batches)
from picolib.model import TextData

ROOT = Path(__file__).resolve().parents[2]


class CountingReads:
    """Stands in for a dataset's token array and records every slice read from it."""

    def __init__(self, ids):
        self.ids, self.reads = ids, []

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, key):
        assert isinstance(key, slice), f"a window is read as one slice, not {key!r}"
        self.reads.append((key.start, key.stop))
        return self.ids[key]


@pytest.fixture
def files(tmp_path):
    """A text whose training part is letters and whose held-out tail is digits, and its .bin."""
    n = 4000
    cut = n - int(n * VAL_FRACTION)
    text = "".join(chr(97 + i % 26) for i in range(cut)) + "".join(str(i % 10) for i in range(n - cut))
    txt = tmp_path / "t.txt"
    txt.write_text(text)
    bin_ = tmp_path / "t.bin"
    assert prepare(txt, bin_) == n
    return txt, bin_


# ---------------------------------------------------------------------- the shipped corpus

def test_shipped_corpus_is_real_text_of_200kb_with_a_held_out_tail_not_seen_in_training():
    raw = COURSE.read_bytes()
    assert len(raw) >= 200_000
    raw.decode("utf-8")
    train, val = TokenData(), TokenData(split="val")
    assert len(train) + len(val) == len(raw) and len(val) == int(len(raw) * VAL_FRACTION)
    head = bytes(train.tokens).decode("utf-8", "ignore")
    tail = bytes(val.tokens).decode("utf-8", "ignore")
    paras = [" ".join(p.split()) for p in tail.split("\n\n")[1:]]       # [0] may be cut mid-way
    long_paras = [p for p in paras if len(p) >= 80]
    assert len(long_paras) > 50
    flat = " ".join(head.split())
    assert not [p for p in long_paras if p in flat], "a validation paragraph is in training"


def test_pyproject_ships_the_data_files_in_the_package():
    tomllib = pytest.importorskip("tomllib")                 # Python 3.11+
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["picolib"]
    for f in (ROOT / "picolib" / "data").iterdir():
        assert any(fnmatch.fnmatch(f"data/{f.name}", g) for g in globs), f.name


def _assemble(root, out, hashseed):
    env = {**os.environ, "PYTHONHASHSEED": str(hashseed)}
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_corpus.py"), "--root", str(root),
                    "--out", str(out)], check=True, env=env, capture_output=True)
    return out.read_bytes()


def test_make_corpus_takes_prose_only_dedups_holds_out_and_is_deterministic(tmp_path):
    root = tmp_path / "repo"
    (root / "notebooks").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "picolib").mkdir()
    cells = [{"cell_type": "markdown",
              "source": [f"# Part {i}\n\nProse number {i} " + "x" * (400 if i in (11, 23) else 60)]}
             for i in range(30)]
    cells.insert(1, {"cell_type": "code", "source": ["secret_code = 1"]})
    (root / "notebooks" / "00_a.ipynb").write_text(json.dumps({"cells": cells}))
    (root / "docs" / "d.md").write_text("# Doc\n\nProse number 3 " + "x" * 60 + "\n\nnew words")
    (root / "picolib" / "m.py").write_text('"""Module prose."""\ndef f():\n    """not a module"""\n')
    a = _assemble(root, tmp_path / "a.txt", 1)
    assert a == _assemble(root, tmp_path / "b.txt", 2)           # same input, same bytes
    text = a.decode()
    assert "secret_code" not in text and "not a module" not in text and "Module prose." in text
    assert text.count("Prose number 3 ") == 1                   # the repeated paragraph dropped
    assert text.rstrip().endswith("# Part 23\n\nProse number 23 " + "x" * 400)  # 12th, 24th held out
    assert text.index("# Part 11") > text.index("# Doc")


# ---------------------------------------------------------------------- training batches

@pytest.mark.parametrize("dp", [1, 2, 4])
def test_ranks_shares_concatenate_to_the_global_batch(files, dp):
    for path in files:
        data = TokenData(path)
        for step in (0, 7):
            whole = data.batch(8, 16, step, seed=3)
            parts = [data.batch_for_rank(step, 8, 16, 3, r, dp) for r in range(dp)]
            for i in range(2):
                assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
            assert parts[0][0].shape == (8 // dp, 16)
            assert torch.equal(whole[0][:, 1:], whole[1][:, :-1])      # targets shift by one


def test_text_and_token_file_give_the_same_batches_and_match_model_TextData(files):
    txt, bin_ = files
    for split in ("train", "val", "all"):
        a, b = TokenData(txt, split), TokenData(bin_, split)
        assert len(a) == len(b) and a.vocab_size == b.vocab_size == 256
        for x, y in zip(a.batch(4, 32, step=5), b.batch(4, 32, step=5)):
            assert torch.equal(x, y)
    tiny = ROOT / "picolib" / "data" / "tiny.txt"
    for x, y in zip(TokenData(tiny, "all").batch(4, 32, 3, seed=1), TextData().batch(4, 32, 3, seed=1)):
        assert torch.equal(x, y)


def test_a_memmap_rank_reads_only_its_own_windows(files):
    _, bin_ = files
    data = TokenData(bin_)
    assert isinstance(data.tokens, np.memmap)
    starts = data.global_starts(11, 8, 16, seed=2)
    for r in range(4):
        data.tokens = spy = CountingReads(TokenData(bin_).tokens)
        data.batch_for_rank(11, 8, 16, 2, r, 4)
        mine = starts[2 * r:2 * r + 2]
        assert sorted(spy.reads) == sorted((s, s + 17) for s in mine)
    assert len(set(starts)) > 4                  # the ranks' windows are not all the same


def test_training_never_reads_the_held_out_tail(files):
    for path in files:
        data = TokenData(path)
        for step in range(300):
            x, y = data.batch(8, 64, step)
            assert int(torch.cat([x, y]).min()) >= 97, "held-out digits reached a training batch"
        assert all(int(t.max()) < 97 for t in TokenData(path, "val").batch(4, 64, 0))


def test_the_position_is_a_function_of_the_step_so_a_resumed_run_sees_the_same_batches(files):
    _, bin_ = files
    run = TokenData(bin_)
    uninterrupted = [run.batch_for_rank(s, 8, 16, 1, 1, 2) for s in range(10)]
    resumed = TokenData(bin_)                    # a fresh process, starting at step 6
    for s in range(6, 10):
        assert all(torch.equal(a, b) for a, b in zip(resumed.batch_for_rank(s, 8, 16, 1, 1, 2),
                                                      uninterrupted[s]))
    assert not torch.equal(uninterrupted[6][0], uninterrupted[7][0])
    assert not torch.equal(run.batch(8, 16, 6, seed=1)[0], run.batch(8, 16, 6, seed=2)[0])


# ---------------------------------------------------------------------- validation

def test_val_batches_are_the_held_out_splits_consecutive_windows(files):
    txt, bin_ = files
    K, b, s = 3, 4, 20
    batches = val_batches(K, b, s, path=bin_)
    ids = torch.from_numpy(np.asarray(TokenData(txt, "val").tokens, dtype=np.int64))
    rows = torch.cat([x for x, _ in batches])
    assert torch.equal(rows.reshape(-1), ids[:K * b * s])
    assert torch.equal(torch.cat([y for _, y in batches]).reshape(-1), ids[1:K * b * s + 1])
    for dp in (2, 4):
        for k in range(K):
            shares = [TokenData(txt, "val").val_batch_for_rank(k, b, s, r, dp) for r in range(dp)]
            assert torch.equal(torch.cat([x for x, _ in shares]), batches[k][0])
    with pytest.raises(ValueError, match="at most"):
        val_batches(100, b, s, path=txt)


def test_mean_token_loss_is_the_mean_over_all_tokens_not_the_mean_of_rank_means():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(7, 10, 256, generator=g), torch.randint(0, 256, (7, 10), generator=g)
    one_process = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    shares = [(0, 1), (1, 3), (3, 7)]                                   # uneven shares
    sums = [F.cross_entropy(logits[a:b].flatten(0, 1), targets[a:b].flatten(), reduction="sum").item()
            for a, b in shares]
    counts = [(b - a) * 10 for a, b in shares]
    assert mean_token_loss(sums, counts) == pytest.approx(one_process, rel=1e-6)
    mean_of_means = sum(s / c for s, c in zip(sums, counts)) / len(shares)
    assert abs(mean_of_means - one_process) > 1e-3                       # the wrong way differs


def _rank_loss(shares):
    import torch.distributed as dist
    loss_sum, count = shares[dist.get_rank()]
    return global_mean_loss(loss_sum, count)


def test_global_mean_loss_adds_sums_and_counts_over_the_group():
    from picolib.launch import run
    shares = [(12.0, 3), (50.0, 10), (1.0, 2)]
    got = run(_rank_loss, 3, shares, backend="gloo")
    assert got == [pytest.approx(63.0 / 15)] * 3


# ---------------------------------------------------------------------- files and the command

def test_prepare_command_and_its_errors(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("héllo wörld\n" * 50)
    assert main(["prepare", str(src), str(tmp_path / "out.bin")]) == 0
    ids = np.memmap(tmp_path / "out.bin", dtype=np.uint16, mode="r")
    assert bytes(ids.astype(np.uint8)) == src.read_bytes()
    assert json.loads((tmp_path / "out.bin.json").read_text())["vocab_size"] == 256
    for argv, says in [(["prepare", str(tmp_path / "nope.txt"), str(tmp_path / "o.bin")], "no file"),
                       (["prepare", str(src), str(tmp_path / "o.npy")], "must end in '.bin'")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe not text")
    with pytest.raises(SystemExit):
        main(["prepare", str(bad), str(tmp_path / "bad.bin")])
    assert "not UTF-8" in capsys.readouterr().err and not (tmp_path / "bad.bin").exists()
    with pytest.raises(ValueError, match="not UTF-8"):
        TokenData(bad)
    with pytest.raises(FileNotFoundError):
        TokenData(tmp_path / "missing.txt")
    capsys.readouterr()
    assert main(["info", str(tmp_path / "out.bin")]) == 0
    assert "train 630, validation 70" in capsys.readouterr().out       # 700 bytes, last 10 %


def test_a_token_file_from_elsewhere_takes_its_vocabulary_from_its_largest_id(tmp_path):
    ids = np.arange(3000, dtype=np.uint16) % 1000
    ids[1234] = 50_000
    ids.tofile(tmp_path / "gpt2.bin")
    data = TokenData(tmp_path / "gpt2.bin", "all")
    assert data.vocab_size == 50_001
    x, _ = data.batch(2, 8)
    assert x.dtype == torch.long and int(x.max()) < 50_001
