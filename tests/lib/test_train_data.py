"""The trainer's data and validation (`--data PATH`, `--eval-every N --eval-batches K`):
val_loss is the mean over every held-out token on every layout and equals one process
(|Δ| ≤ 2e-5, the trainer tests' tolerance: the layouts sum in other orders), and on one
process it equals the mean cross-entropy of the untouched model over the held-out tokens,
computed here without the trainer; each rank reads only its own rows and positions of a
step's batch; a token file gives what its text gives; a resumed run sees the batches of the
uninterrupted one, because the checkpoint holds the position in the data; bad data is a
command-line error before any rank starts."""
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from picolib.data import COURSE, TokenData, prepare
from picolib.launch import run
from picolib.train import TrainConfig, check_config, main, train

TOL = 2e-5
BASE = dict(data="course", steps=2, eval_every=1, eval_batches=2, micro_batches=2, progress=False)


def _records(nproc, **options):
    cfg = TrainConfig(**{**BASE, **options})
    check_config(cfg, nproc)
    return run(train, nproc, cfg, timeout=240)[0]


def _curves(records):
    return [r["loss"] for r in records], [r["val_loss"] for r in records]


@pytest.fixture(scope="module")
def reference():
    return _curves(_records(1))


LAYOUTS = {"dp2": (2, dict(dp=2)), "tp2": (2, dict(tp=2)), "pp2": (2, dict(pp=2)),
           "cp2": (2, dict(cp=2)),
           "pp2×dp2×cp2 interleaved": (8, dict(pp=2, dp=2, cp=2, schedule="interleaved"))}


@pytest.mark.parametrize("name", LAYOUTS)
def test_val_loss_equals_one_process_on_every_layout(name, reference):
    nproc, options = LAYOUTS[name]
    loss, val = _curves(_records(nproc, **options))
    assert max(abs(a - b) for a, b in zip(val, reference[1], strict=True)) <= TOL, (val, reference)
    assert max(abs(a - b) for a, b in zip(loss, reference[0], strict=True)) <= TOL
    assert val[1] < val[0]       # the model learns what it never trained on


def test_val_loss_with_experts_equals_one_process_holding_all_of_them():
    """dp4 with the experts over ep2: as in test_train, the reference runs each rank's
    micro-batch as one of its own (the balancing loss's token groups), dp·m of them."""
    opts = dict(experts=4, top_k=2)
    loss, val = _curves(_records(4, dp=4, ep=2, **opts))
    want_loss, want_val = _curves(_records(1, **{**opts, "micro_batches": 8}))
    assert max(abs(a - b) for a, b in zip(val + loss, want_val + want_loss, strict=True)) <= TOL


def test_val_loss_is_the_mean_over_the_held_out_tokens_computed_independently():
    """lr 0: the weights stay the initial ones (AdamW moves nothing), so val_loss must be the
    initial model's cross-entropy summed over every held-out token and divided by their
    number — computed here from the file's last tenth, with torch's own cross-entropy."""
    from picolib.model import TinyLlama
    cfg = TrainConfig(**{**BASE, "steps": 1, "lr": 0.0, "eval_batches": 3})
    got = _records(2, dp=2, lr=0.0, steps=1, eval_batches=3)[0]["val_loss"]
    raw = COURSE.read_bytes()
    held = np.frombuffer(raw[len(raw) - int(len(raw) * 0.1):], dtype=np.uint8).astype(np.int64)
    n = cfg.eval_batches * cfg.batch * cfg.seq          # consecutive windows from its start
    x = torch.from_numpy(held[:n].copy()).view(-1, cfg.seq)
    y = torch.from_numpy(held[1:n + 1].copy()).view(-1, cfg.seq)
    model = TinyLlama(cfg.model_config())
    with torch.no_grad():
        total = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    assert abs(got - total / y.numel()) <= TOL, (got, total / y.numel())


def test_each_rank_reads_only_its_rows_and_positions():
    """dp2 × cp2: a spy on the token array records every position read. Each rank reads its
    dp rows' windows, and of them only its cp chunks (and the next token of each, the
    targets); the four ranks together read the global batch, no rank all of it."""
    cfg = TrainConfig(data="course", dp=2, cp=2, batch=4, seq=16, progress=False)
    check_config(cfg, 4)
    read = run(_read_by_rank, 4, cfg, timeout=120)
    data = TokenData("course")
    starts = data.global_starts(3, cfg.batch, cfg.seq, cfg.seed)
    want_all = {s + i for s in starts for i in range(cfg.seq + 1)}
    got_all = set().union(*(set(r["read"]) for r in read))
    assert got_all == want_all
    for r in read:
        from picolib.context_parallel import positions
        cols = positions(cfg.cp_layout, r["cp"], cfg.cp, cfg.seq).tolist()
        rows = starts[r["dp"] * 2:(r["dp"] + 1) * 2]
        assert set(r["read"]) == {s + c + k for s in rows for c in cols for k in (0, 1)}
        assert len(set(r["read"])) < len(want_all) // 2
        full = data.batch(cfg.batch, cfg.seq, 3, cfg.seed)        # and the right tokens
        for got, whole in zip(r["batch"], full):
            assert torch.equal(torch.tensor(got), whole[r["dp"] * 2:(r["dp"] + 1) * 2][:, cols])


class _Spy:
    """A token array that records the positions read from it."""

    def __init__(self, arr, log, offset=0):
        self.arr, self.log, self.offset = arr, log, offset

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start = key.start or 0
            return _Spy(self.arr[key], self.log, self.offset + start)
        self.log.extend((self.offset + np.asarray(key)).tolist())
        return self.arr[key]

    def __array__(self, dtype=None, copy=None):
        self.log.extend(range(self.offset, self.offset + len(self.arr)))
        return np.asarray(self.arr, dtype=dtype)


def _read_by_rank(cfg):
    from picolib import compose, train as trainer
    from picolib.mesh import Mesh
    mesh = Mesh("cpu", dp=cfg.dp, cp=cfg.cp, pp=1, tp=1)
    data, _ = compose.open_data(cfg, check=False)
    log = []
    data.tokens = _Spy(data.tokens, log)
    tokens, targets = trainer._batch(cfg, data, 3, mesh)
    return {"dp": mesh.coordinate("dp"), "cp": mesh.coordinate("cp"), "read": log,
            "batch": [torch.cat(tokens).tolist(), torch.cat(targets).tolist()]}


def test_a_token_file_trains_and_evaluates_as_its_text(tmp_path, reference):
    src = tmp_path / "course.txt"
    src.write_bytes(COURSE.read_bytes())
    prepare(src, tmp_path / "course.bin")
    for path in (src, tmp_path / "course.bin"):
        assert _curves(_records(1, data=str(path))) == reference


def test_resumed_run_sees_the_batches_of_the_uninterrupted_one(tmp_path):
    """Two steps saved at dp2, resumed for two more at tp2: the last two losses and
    val_losses are the uninterrupted run's; the checkpoint holds the data position."""
    whole = _records(1, steps=4, eval_every=2)
    _records(2, dp=2, steps=2, eval_every=2, save=str(tmp_path / "ck"))
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(str(tmp_path / "ck" / "step-000002")).read_metadata().state_dict_metadata
    assert "data.position" in saved
    rest = _records(2, tp=2, steps=4, eval_every=2, resume=str(tmp_path / "ck"))
    assert [r["step"] for r in rest] == [2, 3]
    for a, b in zip(rest, whole[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= TOL and ("val_loss" in a) == ("val_loss" in b)
    assert abs(rest[-1]["val_loss"] - whole[-1]["val_loss"]) <= TOL


def test_a_saved_data_position_is_where_the_resumed_run_reads(tmp_path):
    """The position read back is the one written (here moved by 5 batches), not the step."""
    ck = tmp_path / "ck"
    run(_save_with_position, 1, TrainConfig(progress=False), str(ck), timeout=120)
    into = run(_load_position, 1, TrainConfig(progress=False), str(ck / "step-000002"), timeout=120)[0]
    assert into == {"data_position": 7, "next_step": 2}


def _save_with_position(cfg, root):
    from picolib import checkpoint, compose
    from picolib.mesh import Mesh
    stages, wrappers, optimizers, _, _ = compose.build(cfg, Mesh("cpu", dp=1, cp=1, pp=1, tp=1))
    checkpoint.save(root, cfg, stages, wrappers, optimizers, 2, data_position=7)


def _load_position(cfg, path):
    from picolib import checkpoint, compose
    from picolib.mesh import Mesh
    stages, wrappers, optimizers, _, _ = compose.build(cfg, Mesh("cpu", dp=1, cp=1, pp=1, tp=1))
    into = {}
    into["next_step"] = checkpoint.load_into(path, cfg, stages, wrappers, optimizers, into=into)
    return into


def _bad_files(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_text("a few words only, " * 10)
    big = np.arange(5000, dtype=np.uint16)
    big.tofile(tmp_path / "big.bin")                       # ids up to 4999: no json, scanned
    return [
        (["--data", str(tmp_path / "nope.txt")], r"no data file at"),
        (["--data", str(tmp_path)], r"no data file at"),
        (["--data", str(tmp_path / "latin1.txt")], r"is not UTF-8 text \(byte 3\)"),
        (["--data", str(tmp_path / "odd.bin")], r"holds 3 bytes, not a whole number of uint16"),
        (["--data", str(tmp_path / "empty.txt")], r"is empty"),
        (["--data", str(tmp_path / "big.bin")], r"reach 4999, beyond the model's vocabulary of 256"),
        (["--data", str(tmp_path / "short.txt"), "--eval-every", "5"],
         r"held-out split \(18 tokens\) holds 0 batches of 8×32 tokens, fewer than --eval-batches 4"),
        (["--data", "course", "--eval-every", "5", "--eval-batches", "10000"],
         r"fewer than --eval-batches 10000"),
        (["--eval-every", "5"], r"--data text has none"),
        (["--data", "random", "--eval-every", "5"], r"--data random has none"),
        (["--data", "course", "--eval-every", "-1"], r"--eval-every must be ≥ 0"),
        (["--data", "course", "--eval-batches", "0"], r"--eval-batches must be at least 1"),
    ]


def test_bad_data_is_a_command_line_error_before_any_rank(tmp_path, capsys, monkeypatch):
    import picolib.launch
    monkeypatch.setattr(picolib.launch, "run", lambda *a, **k: pytest.fail("a rank was started"))
    for argv, message in _bad_files(tmp_path):
        with pytest.raises(SystemExit) as exit_:
            main(["--no-progress", "--steps", "1"] + argv)
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("python -m picolib.train: error: ") and re.search(message, err[-1]), \
            (argv, err[-1])
        assert not any("Traceback" in line for line in err)


def test_command_line_logs_val_loss_in_records_and_summary(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    records = main(["--data", "course", "--steps", "3", "--eval-every", "2", "--eval-batches", "1",
                    "--log", str(log)])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert ["val_loss" in r for r in lines] == [False, True, True]    # step 1, and the last
    assert [r.get("val_loss") for r in lines] == [r.get("val_loss") for r in records]
    out = capsys.readouterr().out
    assert f"val_loss {lines[-1]['val_loss']:.4f}" in out and math.isfinite(lines[-1]["val_loss"])
