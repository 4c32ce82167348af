"""A plan the planner's search finds runs as it is (issue 29): written as JSON
(`Plan.to_json`), read back equal, and handed to the trainer (`--plan FILE`), which trains
the plan's layout with the bytes the planner priced and the one-process losses; a published
model's plan dry-runs (`--dry-run --plan FILE`) holding what the planner counted. A plan the
trainer cannot run is refused before any process starts, one line naming why (exit 2)."""
import pytest

from picolib import plan_search, train
from picolib.compose import MODEL_PRESETS, TrainConfig, check_config
from picolib.dry_run import dry_run
from picolib.model import LlamaConfig
from picolib.parallel_layout import Layout, layout_of
from picolib.plan_search import search, trainer_refuses
from picolib.planner import LLAMA3_70B, MoEShape, Parallelism, Plan, memory, traffic

TINY = LlamaConfig(**MODEL_PRESETS["tiny"])


def test_a_searched_plan_the_trainer_and_the_dry_run_read_one_layout(tmp_path):
    """The search's plan, the trainer's run of it and the dry run of it read one Layout:
    every Layout field of the run and of the dry run is the plan's (a field a translation
    dropped would differ here), and the three agree on the bytes: the planner's state and
    bytes by kind are the trainer's busiest rank's and the dry run's, and the losses are one
    process's."""
    found = search(TINY, 4, 8, 32, precision="fp32", activations="picolib", trainer=True)
    plan, path = found[0]["plan"], tmp_path / "plan.json"
    plan.to_json(str(path))
    assert Plan.from_json(path.read_text()) == plan and plan.par is found[0]["par"]
    cfg = TrainConfig.from_plan(plan)
    assert layout_of(cfg) == layout_of(plan.par) and isinstance(plan.par, Layout)
    assert (cfg.world_size, cfg.batch) == (plan.par.n_gpus, 8)    # the search's 4 GPUs, 8 sequences
    records = train.main(["--plan", str(path), "--steps", "2", "--no-progress"])
    dry = train.main(["--dry-run", "--plan", str(path)])
    assert all(Layout(**r["layout"]) == layout_of(plan.par) for r in dry)
    one = train.main(["--nproc", "1", "--batch", "8", "--seq", "32", "--steps", "2",
                      "--recompute", plan.par.recompute, "--no-progress"])
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    # the layout the planner priced is the one that ran and the one the dry run built
    par = plan.par
    state = max(sum(memory(plan.model, par, r)[k] for k in ("params", "grads", "optimizer"))
                for r in range(par.pp))
    sent = [traffic(plan.model, par, r) for r in range(par.pp)]
    kinds = {k.upper(): b for k in ("dp", "tp", "pp", "cp", "ep") if (b := max(s[k] for s in sent))}
    assert (records[0]["state_bytes"], records[0]["sent_bytes_by_kind"]) == (state, kinds)
    assert max(r["params"] + r["grads"] + r["optimizer"] for r in dry) == state
    assert {k.upper(): b for k in ("dp", "tp", "pp", "cp", "ep")
            if (b := max(r["sent"][k] for r in dry))} == kinds


def test_a_published_models_searched_plan_dry_runs(tmp_path):
    """Llama 3 8B on 16 H100s, searched from the command line: the dry run builds the plan
    on its 16 ranks and each pipeline position holds the planner's parameters, peak
    gradients and optimizer state, to the byte."""
    path = tmp_path / "plan.json"
    found = plan_search.main(["--preset", "llama3-8b", "--gpus", "16", "--batch", "16",
                              "--seq", "8192", "--max-pp", "4", "--top", "1", "--json", str(path)])
    plan = Plan.from_json(path.read_text())
    assert plan == found[0]["plan"]
    reports = train.main(["--dry-run", "--plan", str(path), "--gpu", "H100-SXM"])
    assert sorted(r["pp_rank"] for r in reports) == list(range(plan.par.pp))
    assert all(0 <= r["rank"] < 16 for r in reports)
    for r in reports:
        mem = memory(plan.model, plan.par, r["pp_rank"])
        assert (r["params"], r["grads_peak"], r["optimizer"]) == \
            (mem["params"], mem["grads"], mem["optimizer"])


def test_the_search_skips_what_the_trainer_refuses(tmp_path, capsys):
    """Llama 3 70B on 64 GPUs: the fastest layout that fits is ZeRO-3 with full
    recomputation, which picolib's trainer refuses; with trainer=True the search goes on to
    one it runs. The refused plan, handed to the dry run, is one line and exit 2."""
    fastest = search(LLAMA3_70B, 64, 64, 8192, top=1, max_pp=4)[0]
    why = trainer_refuses(fastest["plan"])
    assert (fastest["par"].zero, fastest["par"].recompute) == (3, "full") and "ZeRO-3" in why
    runs = search(LLAMA3_70B, 64, 64, 8192, top=3, max_pp=4, trainer=True)
    assert runs and all(trainer_refuses(r["plan"]) is None for r in runs)
    assert runs[0]["time"]["seconds"] > fastest["time"]["seconds"]
    path = tmp_path / "refused.json"
    fastest["plan"].to_json(str(path))
    with pytest.raises(SystemExit) as e:
        train.main(["--dry-run", "--plan", str(path)])
    assert e.value.code == 2 and "ZeRO-3 frees parameters" in capsys.readouterr().err


@pytest.mark.parametrize("plan, options, message", [
    (Plan(TINY, Parallelism(dp=2, seq=32, precision="fp8")), {}, "not 'fp8'"),
    (Plan(TINY, Parallelism(dp=2, ep=2, seq=32), MoEShape(4, 2, 64, shared=1)), {}, "shared"),
    (Plan(TINY, Parallelism(dp=2, ep=2, seq=32), MoEShape(4, 2, 32)), {}, "expert_ffn=32"),
    (Plan(TINY, Parallelism(dp=2, seq=32)), {"dp": 4}, "--dp 4 contradicts the plan"),
    (Plan(TINY.replace(hidden=48), Parallelism(seq=32)), {"preset": "tiny"}, "--preset tiny contradicts"),
])
def test_what_the_trainer_cannot_run_as_planned(tmp_path, capsys, plan, options, message):
    with pytest.raises(ValueError, match=message):
        check_config(TrainConfig.from_plan(plan, **options), read_data=False)
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    flags = [f"--{k}={v}" for k, v in options.items()]
    with pytest.raises(SystemExit) as e:
        train.main(["--plan", str(path), *flags])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("python -m picolib.train: error: ") \
        and message in err, err


def test_a_plan_for_a_shape_no_preset_has_runs(tmp_path):
    """A plan's model need not be a preset: hidden 48 (no preset has it) runs as planned —
    the run carries the plan's shape, its busiest rank holds the state the planner counted
    for that shape (a preset's model would hold other bytes), and dp=2 gives the losses of
    the same plan on one process."""
    shape = TINY.replace(hidden=48, ffn_hidden=96)
    plans = {n: Plan(shape, Parallelism(dp=n, micro_batch_size=4 // n, seq=32, precision="fp32",
                                        activations="picolib")) for n in (1, 2)}
    cfg = TrainConfig.from_plan(plans[2])
    assert (cfg.preset, cfg.model_config().hidden, cfg.model_config().ffn_hidden) == (None, 48, 96)
    check_config(cfg)
    runs = {}
    for n, plan in plans.items():
        plan.to_json(str(tmp_path / f"plan{n}.json"))
        runs[n] = train.main(["--plan", str(tmp_path / f"plan{n}.json"), "--steps", "2", "--no-progress"])
    state = sum(memory(shape, plans[2].par, 0)[k] for k in ("params", "grads", "optimizer"))
    assert runs[2][0]["state_bytes"] == state != \
        sum(memory(TINY, plans[2].par, 0)[k] for k in ("params", "grads", "optimizer"))
    assert [r["loss"] for r in runs[2]] == pytest.approx([r["loss"] for r in runs[1]], rel=1e-5)
    with pytest.raises(ValueError, match="give a preset \\('tiny'\\) or a model, not both"):
        check_config(TrainConfig(model=shape), read_data=False)


def test_every_layout_field_reaches_the_run():
    """A plan that sets every field the old translations renamed or dropped (interleaved
    chunks, recomputation, the CP algorithm, experts): the run and its dry run hold them as
    the plan does; only the micro-batch size becomes the trainer's global batch (dp × m ×
    mbs). Options the plan does not set pass through, agreeing ones are accepted."""
    plan = Plan(TINY, Parallelism(dp=4, pp=2, ep=2, zero=1, schedule="interleaved", chunks=2,
                                  micro_batches=4, micro_batch_size=2, seq=64, precision="fp32",
                                  recompute="selective", cp_algorithm="allgather"),
                MoEShape(4, 2, TINY.ffn_hidden))
    assert (plan.par.experts, plan.par.top_k) == (4, 2)        # the MoE's counts, in the layout
    cfg = TrainConfig.from_plan(plan, steps=3, lr=5e-4, dp=4)
    assert layout_of(cfg) == layout_of(plan.par) == layout_of(Plan.from_json(plan.to_json()).par)
    assert (cfg.v, cfg.batch, cfg.preset, cfg.steps, cfg.lr, cfg.micro_batch_size) == \
        (2, 32, "tiny", 3, 5e-4, 2)
    check_config(cfg)
    assert {Layout(**r["layout"]) for r in dry_run(cfg, cfg.world_size)} == {layout_of(plan.par)}
    with pytest.raises(ValueError, match="unknown fields \\['tpp'\\]"):
        Plan.from_json('{"model": {}, "par": {"tpp": 2}}')
