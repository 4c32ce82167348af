"""DualPipe in the trainer (issue 29): its two copies of each stage (pipeline ranks r and
p−1−r) are a group of the mesh (`Mesh.pairs`), and the one gradient path — DDP or ZeRO over
the replicas, with `groups=` — sums their gradients with the rule it uses for experts (sum
over the holders, divide by the data-parallel size). So `python -m picolib.train --pp 2
--schedule dualpipe` gives the one-process loss curve and gradient norm, on DDP and ZeRO,
with one replica or two."""
import json

import pytest
import torch.distributed as dist

from picolib.launch import run
from picolib.mesh import Mesh
from picolib.train import TrainConfig, check_config, main, train

STEPS = 4


def _records(nproc, **options):
    cfg = TrainConfig(**{"steps": STEPS, "progress": False, **options})
    check_config(cfg, nproc)
    return run(train, nproc, cfg, timeout=240)[0]


@pytest.fixture(scope="module")
def reference():
    return _records(1, micro_batches=4)


def _pair_layout():
    mesh = Mesh(pp=4, dp=2)
    mesh.pairs()
    return (mesh.coordinate("pp"), mesh.coordinate("dp"), mesh.peers("pair"),
            dist.get_process_group_ranks(mesh.group("pair", "dp")))


def test_pairs_are_the_mirror_pipeline_ranks():
    """Each rank's pair is the rank at pipeline coordinate p−1−r with the same dp coordinate;
    pair × dp is both pairs' replicas. Read from the groups the mesh built, against the
    mesh's row-major rank formula (rank = pp·dp_size + dp)."""
    for rank, (pp, dp, pair, holders) in enumerate(run(_pair_layout, 8)):
        assert rank == pp * 2 + dp
        assert pair == sorted([pp * 2 + dp, (3 - pp) * 2 + dp])
        assert holders == sorted(q * 2 + d for q in (pp, 3 - pp) for d in (0, 1))


@pytest.mark.parametrize("nproc, options", [
    (2, dict(pp=2)), (2, dict(pp=2, zero=1)), (4, dict(pp=2, dp=2)),
    (4, dict(pp=2, dp=2, zero=1)), (4, dict(pp=4, zero=2, micro_batches=8)),
    (4, dict(pp=2, cp=2, zero=1)),
], ids=["pp2 DDP", "pp2 ZeRO-1", "dp2×pp2 DDP", "dp2×pp2 ZeRO-1", "pp4 ZeRO-2 m8", "cp2×pp2 ZeRO-1"])
def test_dualpipe_trainer_equals_one_process(nproc, options, reference):
    got = _records(nproc, **{"micro_batches": 4, "schedule": "dualpipe", **options})
    for g, r in zip(got, reference, strict=True):
        assert abs(g["loss"] - r["loss"]) <= 2e-5, (options, got, reference)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (options, g, r)
    assert got[-1]["loss"] < got[0]["loss"]


def test_checkpoint_of_a_pair_resumes_on_another_pair(tmp_path, reference):
    """Saved from dp2×pp2 ZeRO-1 (each stage sharded over its pair × dp: every element written
    once), resumed at pp2 with DDP (both copies of each stage read whole): the one-process
    curve goes on."""
    dual = dict(micro_batches=4, schedule="dualpipe")
    _records(4, pp=2, dp=2, zero=1, steps=2, save=str(tmp_path / "ckpt"), **dual)
    rest = _records(2, pp=2, resume=str(tmp_path / "ckpt"), **dual)
    assert max(abs(a["loss"] - r["loss"]) for a, r in zip(rest, reference[2:], strict=True)) <= 2e-5


def test_command_line_runs_dualpipe(tmp_path, reference):
    """The command line itself (argparse, check, launch) with --schedule dualpipe."""
    log = tmp_path / "log.jsonl"
    main(["--nproc", "2", "--pp", "2", "--schedule", "dualpipe", "--micro-batches", "4",
          "--steps", str(STEPS), "--no-progress", "--log", str(log)])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert max(abs(a["loss"] - r["loss"]) for a, r in zip(lines, reference, strict=True)) <= 2e-5
    assert lines[0]["sent_bytes_by_kind"]["DP"] > 0          # the pair's gradients: DP's traffic


def test_dry_run_refuses_dualpipe_saying_why():
    from picolib.dry_run import dry_run
    with pytest.raises(NotImplementedError, match="dualpipe: its pairs' gradients"):
        dry_run(TrainConfig(pp=2, schedule="dualpipe", micro_batches=4), 2)


def _stages_out_of_order():
    from picolib.model import LlamaConfig, TinyLlama
    from picolib.pipeline_parallel import pair_gradient_groups, schedule_stages
    from picolib.pipeline_schedules import make_schedule
    sched = make_schedule("dualpipe", 2, 4)
    built = schedule_stages(TinyLlama(LlamaConfig(hidden=16, n_layers=2, n_heads=2, n_kv_heads=1,
                                                  ffn_hidden=32, max_seq=8)), sched)
    mine = {s: built[s] for s in sched.stages_of(dist.get_rank())}   # by stage index: rank 1 [1, 2]
    pair_gradient_groups(mine, Mesh(pp=2))


def test_pair_groups_refuse_stages_out_of_the_pairs_order():
    """Rank 1 holds the down copy of layers 1 (stage 1) and the up copy of layers 0 (stage 2);
    its pair, rank 0, lists layers 0 first. Wrappers built in stage order would broadcast and
    reduce different layers against each other (gloo: "collective mismatch")."""
    from picolib.launch import WorkerError
    with pytest.raises(WorkerError, match=r"stages \[1, 2\] are not in schedule_stages' order"):
        run(_stages_out_of_order, 2)


def test_param_placement_puts_both_copies_on_each_rank_of_a_pair():
    """Where a parameter lives (clipping and checkpoints read it): at pp = 2 each rank holds
    the whole model (the down copy of its half, the up copy of the other), and the replicas a
    gradient is reduced over are both ranks — the ranks the wrapper's pair group holds."""
    from picolib.param_placement import placements
    from picolib.parallel_layout import rank_stages
    from picolib.model import TinyLlama
    cfg = TrainConfig(pp=2, schedule="dualpipe", micro_batches=4)
    names = {n for n, _ in TinyLlama(cfg.model_config()).named_parameters()}
    assert rank_stages(cfg, 4, 0) == [(0, range(0, 2), True, False), (3, range(2, 4), False, True)]
    assert rank_stages(cfg, 4, 1) == [(1, range(2, 4), False, True), (2, range(0, 2), True, False)]
    for rank in (0, 1):
        placed = placements(cfg, rank)
        assert {p.name for p in placed} == names and len(placed) == len(names)
        assert {p.replicas for p in placed} == {(0, 1)}
