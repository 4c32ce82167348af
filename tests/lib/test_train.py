"""The 5-D trainer (lesson 10): every configuration's loss curve equals one process's on the
same seed (5 AdamW steps; fp32; |Δloss| ≤ 2e-5 — the summation orders of replicas, shards
and micro-batches differ), bad configurations are refused before any process starts, the
log has one JSON object per step, and `torchrun` with two agents gives the same curve."""
import functools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from picolib.launch import WorkerError, run
from picolib.train import TrainConfig, build_parser, check_config, main, train

STEPS = 5
ROOT = Path(__file__).resolve().parents[2]


def _losses(nproc, **options):
    cfg = TrainConfig(**{"steps": STEPS, "progress": False, **options})
    check_config(cfg, nproc)
    return [r["loss"] for r in run(train, nproc, cfg, timeout=240)[0]]


@pytest.fixture(scope="module")
def reference():
    return _losses(1, micro_batches=2)


COMBINATIONS = {
    "dp4 DDP": (4, dict(dp=4)),
    "dp4 ZeRO-3": (4, dict(dp=4, zero=3)),
    "dp2×tp2 ZeRO-1": (4, dict(dp=2, tp=2, zero=1)),
    "dp2×tp2+SP ZeRO-2": (4, dict(dp=2, tp=2, sp=True, zero=2)),
    "tp2×pp2 1F1B": (4, dict(tp=2, pp=2)),
    "dp2×pp2 ZeRO-1 ZB-H1": (4, dict(dp=2, pp=2, zero=1, schedule="zb_h1")),
    "dp2×cp2 ring": (4, dict(dp=2, cp=2)),
    "cp2×tp2+SP Ulysses": (4, dict(cp=2, tp=2, sp=True, cp_algorithm="ulysses")),
    "pp2×cp2 all-gather": (4, dict(pp=2, cp=2, cp_algorithm="allgather")),
    "dp2×pp2×tp2+SP ZeRO-1": (8, dict(dp=2, pp=2, tp=2, sp=True, zero=1)),
    "dp2×cp2×tp2 ZeRO-2": (8, dict(dp=2, cp=2, tp=2, zero=2)),
    "pp2×dp2×cp2 interleaved": (8, dict(pp=2, dp=2, cp=2, schedule="interleaved")),
}


@pytest.mark.parametrize("name", COMBINATIONS)
def test_configuration_equals_one_process(name, reference):
    nproc, options = COMBINATIONS[name]
    got = _losses(nproc, micro_batches=2, **options)
    assert max(abs(g - r) for g, r in zip(got, reference, strict=True)) <= 2e-5, (got, reference)
    assert got[-1] < got[0]                                  # and it learns


EXPERTS = {
    "dp4 ep2": (4, dict(dp=4, ep=2)),
    "dp2×tp2 ep2": (4, dict(dp=2, tp=2, ep=2)),
    "dp4 ep2 ZeRO-2": (4, dict(dp=4, ep=2, zero=2)),
    "dp2×pp2 ep2 ZeRO-1 (DeepSeek-V3 style)": (4, dict(dp=2, pp=2, ep=2, zero=1, micro_batches=2)),
    "dp2×pp2×tp2 ep2 ZeRO-1": (8, dict(dp=2, pp=2, tp=2, ep=2, zero=1, micro_batches=2)),
    "dp2×cp2 ep2": (4, dict(dp=2, cp=2, ep=2, micro_batches=2)),
    "dp2×cp2×tp2 ep2 ZeRO-1": (8, dict(dp=2, cp=2, tp=2, ep=2, zero=1, micro_batches=2)),
}


@functools.cache       # one per count of token groups (2 or 4), not one per case
def _experts_reference(micro_batches):
    return _losses(1, experts=4, top_k=2, micro_batches=micro_batches)


@pytest.mark.parametrize("name", EXPERTS)
def test_experts_equal_one_process_holding_all_of_them(name):
    """Each rank's micro-batch is one token group of the MoE (its balancing loss), so the
    reference runs the same groups as micro-batches: dp·m of them, in the same order. The
    balancing loss reaches the gradients through each layer's backward (pipeline stages);
    under CP its statistics are summed over the cp ranks (a group is whole sequences)."""
    nproc, options = EXPERTS[name]
    want = _experts_reference(options["dp"] * options.get("micro_batches", 1))
    got = _losses(nproc, experts=4, top_k=2, **options)
    assert max(abs(g - r) for g, r in zip(got, want, strict=True)) <= 2e-5, (got, want)


def test_bf16_with_fp32_master_follows_the_fp32_curve(reference):
    got = _losses(2, dp=2, zero=1, precision="bf16", micro_batches=2)
    assert max(abs(g - r) for g, r in zip(got, reference)) < 0.05 and got != reference


def test_bf16_with_ddp_equals_one_process_with_the_same_recipe(reference):
    """--precision bf16 without ZeRO: DDP's bf16 compute copies of fp32 masters (gradients
    all-reduced in bf16). dp2 (DDP) and dp2×pp2 against one process with the same recipe:
    |Δloss| ≤ 2e-4 (4.1e-5 seen: bf16 matmuls over 2 sequences round differently from one
    over 4, and bf16 gradients summed over ranks round once more); the recipe is really
    bf16: the curve leaves the fp32 one (by 9.9e-4 seen)."""
    one = _losses(1, micro_batches=2, precision="bf16")
    assert max(abs(g - r) for g, r in zip(one, reference)) > 1e-4
    for options in (dict(dp=2), dict(dp=2, pp=2)):
        got = _losses(2 * options.get("pp", 1), micro_batches=2, precision="bf16", **options)
        assert max(abs(g - w) for g, w in zip(got, one, strict=True)) <= 2e-4, (options, got, one)


BAD = [
    (dict(dp=3), 4, r"the mesh dp=3 has 3 ranks, but the world has 4"),
    (dict(tp=3), 3, r"n_heads=4 .*3|3.*n_heads"),
    (dict(cp=2, seq=30), 2, r"sequence length 30 must divide by 4"),
    (dict(cp=8, cp_algorithm="ulysses", seq=32), 8, r"4 query heads .* over cp=8"),
    (dict(pp=8, micro_batches=8), 8, r"n_layers=4 is fewer than the 8 pipeline stages of 1f1b"),
    (dict(dp=2, batch=6, micro_batches=2), 2, r"batch of 6 sequences must divide into dp=2 replicas × 2"),
    (dict(pp=2, zero=3), 2, r"ZeRO-3 × pipeline parallelism is not supported"),
    (dict(schedule="gpipe2", pp=2), 2, r"unknown schedule 'gpipe2'"),
    (dict(sp=True), 1, r"sp .* needs tp ≥ 2"),
    (dict(batch=0), 1, r"--batch must be at least 1, not 0"),
    (dict(keep=0), 1, r"--keep must be at least 1"),
    (dict(save_every=-1), 1, r"--save-every must be ≥ 0, not -1"),
    (dict(preset="huge"), 1, r"unknown preset 'huge'"),
    (dict(pp=2, dp=2, schedule="dualpipe", micro_batches=4, experts=4, ep=2), 4, r"dualpipe .* use ep=1"),
    (dict(dp=2, experts=3, ep=2), 2, r"n_experts=3 does not divide by the ep size 2"),
    (dict(experts=2, top_k=3), 1, r"top_k=3 is larger than n_experts=2"),
    (dict(dp=3, batch=6, experts=4, ep=2), 3, r"ep=2 must divide dp=3"),
    (dict(dp=2, ep=2), 2, r"ep=2 spreads experts"),
    (dict(dp=2, ep=2, zero=3, experts=4), 2, r"zero=3 gathers each block over all dp=2 .* ep=2"),
]


@pytest.mark.parametrize("options, world, message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_bad_configuration_is_refused_naming_the_numbers(options, world, message):
    with pytest.raises(ValueError, match=message):
        check_config(TrainConfig(**options), world)


# what argparse itself says for a value outside an option's choices
CLI = {"unknown schedule 'gpipe2'": r"argument --schedule: invalid choice: 'gpipe2' \(choose from",
       "unknown preset 'huge'": r"argument --preset: invalid choice: 'huge' \(choose from 'tiny'"}
MORE = [(["--zero", "4"], r"argument --zero: invalid choice: 4 \(choose from 0, 1, 2, 3\)"),
        (["--precision", "fp16"], r"argument --precision: invalid choice: 'fp16'"),
        (["--recompute", "some"], r"argument --recompute: invalid choice: 'some'"),
        (["--cp", "2", "--cp-algorithm", "tree"], r"argument --cp-algorithm: invalid choice"),
        (["--cp", "2", "--cp-layout", "striped"], r"argument --cp-layout: invalid choice"),
        (["--data", "wiki"], r"--data wiki: no data file at wiki"),
        (["--backend", "mpi"], r"argument --backend: invalid choice: 'mpi'"),
        (["--dp", "0"], r"dp must be a positive integer, not 0"),
        (["--nproc", "0"], r"--nproc must be at least 1, not 0"),
        (["--resume", "/no/such/folder"], r"--resume /no/such/folder: no such folder"),
        (["--preset", "llama3-70b", "--backend", "gloo"],
         r"the llama3-70b preset's training state is [\d,]+ GiB .* add --dry-run")]


def _argv(options: dict, world: int) -> list[str]:
    argv = ["--nproc", str(world), "--no-progress"]
    for k, v in options.items():
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    return argv


@pytest.mark.parametrize("argv, message", [(_argv(o, w), CLI.get(m, m)) for o, w, m in BAD] + MORE,
                         ids=[m[:30] for _, _, m in BAD] + [" ".join(a) for a, _ in MORE])
def test_every_bad_configuration_is_a_command_line_error(argv, message, capsys, monkeypatch):
    """Through main(), as a user types it: exit status 2 and one line
    `python -m picolib.train: error: ...` on stderr, no traceback, and no rank started."""
    import picolib.launch
    monkeypatch.setattr(picolib.launch, "run", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m picolib.train: error: ") and re.search(message, err[-1]), err[-1]
    assert not any("Traceback" in line for line in err)


def test_help_lists_the_choices_of_every_enumerated_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for option, values in [("--zero", "{0,1,2,3}"), ("--precision", "{fp32,bf16}"),
                           ("--recompute", "{none,selective,full}"), ("--data", "{text,course,random,PATH}"),
                           ("--preset", "{tiny,small,base,150m,llama3-8b,llama3-70b,llama3-405b,deepseek-v3-like}"), ("--backend", "{auto,gloo,nccl}"),
                           ("--cp-algorithm", "{ring,allgather,ulysses}"),
                           ("--cp-layout", "{contiguous,zigzag}"), ("--schedule", "{afab,1f1b,")]:
        assert f"{option} {values}" in out, option


def test_command_line_refuses_before_starting_ranks_and_logs_json(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--nproc", "4", "--dp", "2", "--no-progress"])
    assert exit_.value.code == 2                       # argparse's way: one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m picolib.train: error: ") and "the world has 4" in err[-1]
    assert not any("Traceback" in line for line in err)
    log = tmp_path / "log.jsonl"
    records = main(["--dp", "2", "--steps", "3", "--log", str(log), "--no-progress",
                    "--trace", str(tmp_path / "trace.json")])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert [r["loss"] for r in lines] == [r["loss"] for r in records]
    assert lines[0]["sent_bytes"]["all_reduce"] > 0 and lines[0]["state_bytes"] > 0
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize("nproc, options, want", [
    (4, dict(dp=2, pp=2), {"all_reduce": ("DP",), "send": ("PP",)}),
    (4, dict(tp=2, cp=2), {"all_reduce": ("TP", "DP"), "send": ("CP",)}),
    (4, dict(dp=4, ep=2, experts=4, top_k=2), {"all_to_all": ("EP",), "all_reduce": ("DP",)}),
    (2, dict(dp=2, ep=2, experts=4, top_k=2), {"all_to_all": ("EP",), "all_reduce": ("DP",)}),
], ids=["dp2×pp2", "tp2×cp2 ring", "dp4 ep2", "dp2 ep2 (the all-to-all spans the replicas)"])
def test_traffic_by_kind_agrees_with_traffic_by_collective(nproc, options, want):
    """Sorting by the mesh dimensions a collective's ranks span (DP, TP, PP, CP, EP) against
    sorting by the collective's name: each op's bytes are the sum of its kinds' (every rank
    of these configurations sends the same)."""
    cfg = TrainConfig(steps=1, progress=False, micro_batches=2, **options)
    rec = run(train, nproc, cfg, timeout=120)[0][0]
    kinds = rec["sent_bytes_by_kind"]
    assert sorted(kinds) == sorted(k for ks in want.values() for k in ks)
    assert {op: sum(kinds[k] for k in ks) for op, ks in want.items()} == rec["sent_bytes"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_equal_one_node(tmp_path):
    """Two agents on this machine (--nnodes 2, c10d rendezvous on 127.0.0.1), 2 ranks each,
    dp2×tp2: the same loss curve as the same configuration from `launch.run`."""
    want = _losses(4, dp=2, tp=2)
    port, log = _free_port(), tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "picolib",
           "-m", "picolib.train", "--dp", "2", "--tp", "2", "--steps", str(STEPS), "--no-progress",
           "--log-file", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = []
    for a in agents:
        try:
            outputs.append(a.communicate(timeout=240)[0])
        finally:
            a.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 2e-5, (got, want)


def test_resume_continues_the_loss_curve_exactly(tmp_path):
    """Three steps, save, three more from the checkpoint = six straight (ZeRO-1, dp2×tp2)."""
    options = dict(dp=2, tp=2, zero=1, micro_batches=2)
    straight = _losses(4, **options, steps=6)
    first = _losses(4, **options, steps=3, save=str(tmp_path / "ckpt"))
    rest = _losses(4, **options, steps=6, resume=str(tmp_path / "ckpt"))
    assert first == straight[:3]
    assert max(abs(a - b) for a, b in zip(rest, straight[3:], strict=True)) <= 1e-6, (rest, straight)


def test_help_describes_the_trainer_in_a_whole_sentence(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    description = " ".join(build_parser().description.split())
    assert description.endswith(".") and description in out
    assert "every layout gives the one-process loss curve." in out


@pytest.mark.parametrize("argv, where", [(["--dp", "2"], "after the all-reduce"),
                                         (["--dp", "2", "--zero", "1"], "after the reduce-scatter")],
                         ids=["DDP", "ZeRO-1"])
def test_a_nan_gradient_stops_the_run_saying_what_to_change(argv, where):
    """A learning rate of 1e30 sends the weights to ~1e30 at step 0: step 1's forward
    overflows and its gradient is NaN. The trainer names the step and its own options, and
    does not pass on the wrappers' advice to "zero the gradients and go on" (it never does)."""
    with pytest.raises(WorkerError) as error:
        main(argv + ["--lr", "1e30", "--steps", "3", "--no-progress"])
    first = str(error.value).splitlines()[0]
    assert "FloatingPointError: step 1 (numbered as in the log): a gradient is NaN or inf" in first
    assert where in first and "--lr (this run: 1e+30)" in first and "--resume" in first
    assert "zero the gradients" not in first


def test_progress_bar_is_drawn_in_place_by_the_caller(capfd):
    """30 steps on 2 ranks: the bar (tqdm in this process, from rank 0's step records) is
    redrawn with carriage returns, so stdout has a few lines, not one `[rank 0]` line per
    update; it reaches 30/30 and the summary follows it."""
    records = main(["--nproc", "2", "--dp", "2", "--steps", "30", "--batch", "4", "--seq", "16"])
    out = capfd.readouterr().out
    lines = [line for line in out.split("\n") if line.strip()]
    assert len(records) == 30 and len(lines) <= 3, lines
    assert "[rank" not in out and "30/30" in out
    assert lines[-1].endswith(f"loss {records[-1]['loss']:.4f}, "
                              f"{records[-1]['tokens_per_s']:,.0f} tokens/s, "
                              f"MFU {records[-1]['mfu']:.3f}, HFU {records[-1]['hfu']:.3f}")


def test_lr_schedule_and_decay_groups_equal_one_process():
    """--warmup 2 --lr-schedule cosine --min-lr 1e-4 --weight-decay 0.1 (none on 1-D
    parameters): the learning rate of each step, logged, is the schedule's (worked out by
    hand below), and DDP (dp2×pp2) and ZeRO-2 (dp2) runs give the one-process curve."""
    options = dict(warmup=2, lr_schedule="cosine", min_lr=1e-4, weight_decay=0.1,
                   micro_batches=2, steps=6)
    cfg = TrainConfig(progress=False, **options)
    want = run(train, 1, cfg, timeout=240)[0]
    # warmup 1e-3·1/2, 1e-3; cosine over the 3 steps after: 1e-4 + 9e-4·(1 + cos(πt))/2
    lrs = [5e-4, 1e-3, 1e-3, 7.75e-4, 3.25e-4, 1e-4]
    assert all(abs(r["lr"] - lr) < 1e-12 for r, lr in zip(want, lrs, strict=True)), want
    for nproc, layout in [(4, dict(dp=2, pp=2)), (2, dict(dp=2, zero=2))]:
        got = _losses(nproc, **options, **layout)
        assert max(abs(g - w["loss"]) for g, w in zip(got, want, strict=True)) <= 2e-5, (layout, got)


def test_each_lr_schedule_at_its_ends():
    from picolib.compose import lr_factor
    base = dict(steps=11, lr=1e-3, min_lr=1e-4)
    shapes = {"constant": [1, 1, 1, 1, 1], "linear": [1, 0.91, 0.55, 0.19, 0.1],
              "cosine": [1, 1 - 0.9 * 0.024471741852423234, 0.55, 0.1 + 0.9 * 0.024471741852423234, 0.1],
              "wsd": [1, 1, 1, 0.55, 0.1]}   # constant to t = 0.8, then linear
    for name, values in shapes.items():
        cfg = TrainConfig(lr_schedule=name, **base)
        got = [lr_factor(cfg, s) for s in (0, 1, 5, 9, 10)]
        assert all(abs(g - v) < 1e-12 for g, v in zip(got, values)), (name, got)
    wsd = TrainConfig(lr_schedule="wsd", warmup=1, **base)   # t = (step - 1)/9 after warmup
    assert [round(lr_factor(wsd, s), 6) for s in (0, 8, 9, 10)] == [1.0, 1.0, 0.6, 0.1]


def test_weight_decay_spares_norm_weights_only():
    """The decay groups, by the model's own names: every norm weight (the tiny Llama's only
    1-D parameters) without decay, every matrix and embedding with it."""
    from picolib.compose import decay_groups
    from picolib.model import TinyLlama
    model = TinyLlama(TrainConfig().model_config())
    decay, spared = decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in spared["params"]) == sorted(
        n for n in names.values() if n.endswith("norm.weight"))
    assert (decay["weight_decay"], spared["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) + len(spared["params"]) == len(names) and spared["params"]
