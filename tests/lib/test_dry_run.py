"""The dry run (picolib/dry_run.py): meta tensors over the fake process group give the same
bytes as the trainer's real run, refuse what a real run refuses, and size Llama-3-70B on
640 ranks without allocating it."""
import pytest

from picolib.compose import TrainConfig
from picolib.dry_run import dry_run, main, representatives

KINDS = ("dp", "tp", "pp", "cp", "ep")


def _busiest(reports):
    """What the trainer logs: each figure's maximum over the ranks."""
    return {"state_bytes": max(r["params"] + r["grads"] + r["optimizer"] for r in reports),
            "activation_bytes": max(r["activations"] for r in reports),
            "sent_bytes_by_kind": {k.upper(): b for k in KINDS
                                   if (b := max(r["sent"][k] for r in reports))}}


@pytest.mark.parametrize("layout", [
    dict(dp=2, pp=2, zero=1, micro_batches=4, batch=8, seq=16),            # 1F1B, ZeRO-1
    dict(dp=2, tp=2, sp=True, zero=2, batch=4, seq=16),                    # TP+SP, ZeRO-2
    dict(cp=2, dp=2, zero=1, batch=4, seq=16),                             # ring attention
    dict(dp=2, pp=2, schedule="interleaved", micro_batches=4, batch=8, seq=16),  # DDP
    dict(dp=2, pp=3, zero=1, micro_batches=3, batch=6, seq=16),            # uneven: 1, 2, 1 layers
    # every token to every expert: the real routing is the dry run's balanced one exactly
    dict(dp=2, cp=2, experts=2, top_k=2, ep=2, zero=1, batch=4, seq=16),
])
def test_dry_run_equals_the_real_run(layout):
    """Same layout, the trainer on gloo ranks with real tensors: the busiest rank's state,
    activations and bytes by kind are the dry run's, to the byte."""
    from picolib import train
    from picolib.launch import run
    cfg = TrainConfig(**layout, steps=1, progress=False)
    reports = dry_run(cfg, cfg.world_size)
    assert [r["rank"] for r in reports] == representatives(cfg)
    real = run(train.train, cfg.world_size, cfg)[0][0]
    dry = _busiest(reports)
    assert dry == {k: real[k] for k in dry}
    assert all(r["activations"] > 0 and r["params"] > 0 for r in reports)


def test_refusals():
    with pytest.raises(ValueError, match="world has 640"):      # dp·tp·pp = 320
        dry_run(TrainConfig(preset="llama3-70b", dp=10, tp=8, pp=4, batch=160,
                            micro_batches=16, seq=8192), 640)
    with pytest.raises(ValueError, match="tp"):                  # 3 divides no head count
        dry_run(TrainConfig(preset="llama3-8b", tp=3, seq=8192, batch=8), 3)
    with pytest.raises(ValueError, match="n_layers=126 is fewer than the 256 pipeline stages"):
        dry_run(TrainConfig(preset="llama3-405b", dp=8, tp=8, pp=128, schedule="interleaved",
                            micro_batches=128, batch=1024, seq=8192), 8192)
    with pytest.raises(SystemExit) as e:                         # the command line: argparse's exit 2
        main(["--preset", "llama3-70b", "--dp", "10", "--tp", "8", "--pp", "4", "--world", "640"])
    assert e.value.code == 2


def test_llama3_70b_on_640_ranks(tmp_path):
    """dp 20 × tp 8 × pp 4, SP, ZeRO-1, 4 micro-batches of one 8k sequence, bf16: every
    parameter is meta (the model is 70.6 B parameters, 141 GB in bf16; this process and its
    ranks never hold more than a fraction of one GB), and the four pipeline positions hold
    the whole model once per tp × dp replica."""
    import json
    out = tmp_path / "plan.json"
    reports = main(["--preset", "llama3-70b", "--dp", "20", "--tp", "8", "--pp", "4", "--sp",
                    "--zero", "1", "--micro-batches", "4", "--batch", "80", "--seq", "8192",
                    "--precision", "bf16", "--world", "640", "--gpu", "H100-SXM", "--json", str(out)])
    assert json.loads(out.read_text()) == reports
    assert [r["pp_rank"] for r in reports] == [0, 1, 2, 3]
    from picolib.compose import MODEL_PRESETS
    from picolib.model import LlamaConfig, param_count
    n = param_count(LlamaConfig(**MODEL_PRESETS["llama3-70b"]))
    # bf16 parameters: 2 bytes each; the tp ranks of a stage hold 1/8 each, plus the norms
    # every tp rank holds whole (2 per block, one final) — so a little more than n·2/8 in all
    held = sum(r["params"] for r in reports)
    assert n * 2 / 8 < held < n * 2 / 8 * 1.001
    assert all(r["sent"]["tp"] > r["sent"]["dp"] > 0 and r["sent"]["pp"] > 0 for r in reports)
    assert all(isinstance(r["fits"], bool) for r in reports)
    assert max(r["max_rss"] for r in reports) < 2e9 < reports[0]["params"]   # never held


def _planner(cfg, pp_rank, recompute=None):
    """The planner's bytes for one pipeline position of a trainer configuration: its layout
    as it is (`Parallelism.of`), counted with the Llama-block activation model
    (`recompute="selective"`: no s×s scores, as flash)."""
    from picolib import planner
    par = planner.Parallelism.of(cfg, activations="picolib", recompute=recompute or cfg.recompute)
    mcfg = cfg.model_config()
    return planner.memory(mcfg, par, pp_rank), planner.traffic(mcfg, par, pp_rank)


def _exact(report, mem, sent):
    """(dry run, planner) pairs that differ: state per rank and bytes sent by kind."""
    pairs = {"params": (report["params"], mem["params"]),
             "grads": (report["grads_peak"], mem["grads"]),
             "optimizer": (report["optimizer"], mem["optimizer"]),
             **{k: (report["sent"][k], sent[k]) for k in KINDS}}
    return {k: v for k, v in pairs.items() if v[0] != v[1]}


@pytest.mark.parametrize("layout", [
    dict(dp=2, zero=3, batch=4, seq=16),
    dict(pp=2, dp=2, zero=2, micro_batches=4, batch=8, seq=16),       # whole grads accumulate
    dict(pp=3, dp=2, zero=2, micro_batches=3, batch=6, seq=16),       # uneven: 1, 2, 1 layers
    dict(pp=2, schedule="zb_h1", micro_batches=4, batch=8, seq=16, tp=2),
    dict(cp=2, dp=2, zero=1, batch=4, seq=16),
    dict(preset="llama3-8b", dp=4, tp=8, pp=2, sp=True, zero=1, micro_batches=4, batch=16,
         seq=8192, precision="bf16"),                                   # 64 ranks, real shapes
])
def test_planner_state_and_traffic_equal_the_dry_run(layout):
    """The planner's formulas against the code: state bytes and bytes sent by kind per
    pipeline position, to the byte. (Saved activations differ: the planner's "picolib"
    count misses a few tensors of TP, CP and the ends, and assumes eager attention — see
    the report of issue 23.) Gradients: the planner's are the peak (ZeRO-2 holds whole
    gradients while micro-batches accumulate, 3× the shard here), the dry run's grads_peak;
    its `grads` is what is held after the step, as the trainer logs."""
    cfg = TrainConfig(**layout)
    for r in dry_run(cfg, cfg.world_size):
        assert _exact(r, *_planner(cfg, r["pp_rank"])) == {}


# Real shapes, world sizes up to 16,384: one representative rank per pipeline position
# asked for (`pp`). bf16 runs, DDP and ZeRO alike, hold bf16 weights and gradients and fp32
# masters: the planner's mixed precision.
B16 = dict(precision="bf16")
GRID = {
    "ZeRO-3, TP8+SP, ring CP4, 16,384 ranks": (dict(
        preset="llama3-8b", dp=512, tp=8, sp=True, cp=4, zero=3, batch=512, seq=4096, **B16), [0]),
    "ZeRO-2, TP8, Ulysses CP2, 2 micro-batches": (dict(
        preset="llama3-8b", dp=16, tp=8, cp=2, cp_algorithm="ulysses", zero=2, micro_batches=2,
        batch=32, seq=2048, **B16), [0]),
    "ZeRO-1, TP4, interleaved PP4×2": (dict(
        preset="llama3-8b", dp=8, tp=4, pp=4, schedule="interleaved", chunks=2, zero=1,
        micro_batches=8, batch=64, seq=4096, **B16), [0, 3]),
    "ZeRO-2, TP8+SP, ZB-H1 PP4, 2,048 ranks": (dict(
        preset="llama3-8b", dp=64, tp=8, sp=True, pp=4, schedule="zb_h1", zero=2,
        micro_batches=8, batch=512, seq=4096, **B16), [0, 3]),
    "DDP fp32, TP8, ZB-H1 PP4 (W with no weight left)": (dict(
        preset="llama3-8b", dp=2, tp=8, pp=4, schedule="zb_h1", micro_batches=8, batch=16,
        seq=1024), [3]),
    "DDP bf16, TP4, 1F1B PP2": (dict(
        preset="llama3-8b", dp=4, tp=4, pp=2, micro_batches=2, batch=8, seq=2048, **B16), [0, 1]),
    "DDP fp32, TP8, 1F1B PP2, 16,384 ranks": (dict(
        preset="llama3-8b", dp=1024, tp=8, pp=2, micro_batches=2, batch=2048, seq=2048), [0, 1]),
    "MoE 8×top-2, EP8, TP4+SP, ZeRO-1": (dict(
        preset="llama3-8b", experts=8, top_k=2, ep=8, dp=32, tp=4, sp=True, zero=1, batch=32,
        seq=4096, **B16), [0]),
    "MoE 8×top-2, EP4, ring CP2, AFAB PP2, ZeRO-2": (dict(
        preset="llama3-8b", experts=8, top_k=2, ep=4, dp=8, cp=2, pp=2, schedule="afab", zero=2,
        micro_batches=2, batch=16, seq=4096, **B16), [0, 1]),
}


@pytest.mark.parametrize("name", GRID)
def test_planner_is_exact_at_real_shapes(name):
    """The planner against the trainer's own code on meta tensors: parameters, gradients
    (their peak), optimizer state and bytes sent by kind (DP, TP, PP, CP, EP) per rank, equal
    to the byte. Saved activations are a bounded gap, not an equality: the planner's
    Llama-block count with the s×s scores dropped (recompute="selective", what a flash
    kernel saves) is within 6 % of the dry run's flash attention on dense layouts (it counts
    K and V after the grouped-query repeat, the dry run's flash kernel saves them unrepeated
    with one log-sum-exp per row, and the CP and TP ends differ by a few tensors). Two
    known larger gaps, where the planner counts too little: ZB-H1 keeps each split
    backward's weight-gradient inputs from B until its W (the planner frees them at B), and
    a mixture of experts saves its experts' inputs for top_k copies of the tokens (the planner
    counts a dense MLP)."""
    from picolib.parallel_layout import rank_at
    layout, pps = GRID[name]
    cfg = TrainConfig(**layout)
    reports = dry_run(cfg, cfg.world_size, ranks=[rank_at(cfg, pp=p, dp=0, cp=0, tp=0) for p in pps])
    for r in reports:
        assert _exact(r, *_planner(cfg, r["pp_rank"])) == {}, (name, r["pp_rank"])
        planned = _planner(cfg, r["pp_rank"], recompute="selective")[0]["activations"]
        if cfg.experts:                                  # the known gaps: the planner counts less
            assert r["activations"] > 1.1 * planned, (name, r["pp_rank"])
        elif cfg.schedule == "zb_h1" and r["pp_rank"] == cfg.pp - 1:
            assert r["activations"] > planned, (name, r["pp_rank"])
        else:
            # within 6 % under torch 2.13; torch 2.11 (an H100 machine's) saves 6.1 % less on
            # ZB-H1's first stage (3,024,306,176 bytes against the planner's 3,221,422,080)
            assert abs(r["activations"] / planned - 1) < 0.07, (name, r["pp_rank"], r["activations"], planned)
    assert all(r["sent"][k] > 0 for r in reports for k in KINDS
               if {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep}[k] > 1)


def test_deepseek_v3_like_with_expert_parallelism(capsys):
    """256 experts, 8 a token, over EP 64 (DeepSeek-V3's sizes on picolib's blocks): each
    rank holds 4 experts of each of the 61 layers; the all-to-alls are sized by the balanced
    routing the dry run assumes (and says it does), and equal the planner's."""
    reports = main(["--preset", "deepseek-v3-like", "--experts", "256", "--top-k", "8",
                    "--ep", "64", "--dp", "64", "--tp", "8", "--zero", "1", "--batch", "64",
                    "--seq", "4096", "--precision", "bf16", "--world", "512"])
    assert "balanced routing" in capsys.readouterr().out
    cfg = TrainConfig(preset="deepseek-v3-like", experts=256, top_k=8, ep=64, dp=64, tp=8,
                      zero=1, batch=64, seq=4096, precision="bf16")
    (r,) = reports
    assert _exact(r, *_planner(cfg, 0)) == {} and r["sent"]["ep"] > r["sent"]["dp"] > 0


def test_the_trainer_command_hands_dry_run_over_and_still_trains(tmp_path, capsys):
    """`python -m picolib.train --dry-run ...` is the dry run (nothing trained, a report per
    pipeline position); without it the same command trains; `--dry` alone is refused."""
    from picolib import train
    reports = train.main(["--dry-run", "--pp", "2", "--dp", "2", "--micro-batches", "2",
                          "--batch", "4", "--world", "4", "--json", str(tmp_path / "r.json")])
    assert [r["pp_rank"] for r in reports] == [0, 1] and all(r["params"] > 0 for r in reports)
    records = train.main(["--nproc", "1", "--steps", "2", "--no-progress"])
    assert [r["step"] for r in records] == [0, 1]
    with pytest.raises(SystemExit) as e:
        train.main(["--dry", "--steps", "1"])
    assert e.value.code == 2 and "write --dry-run in full" in capsys.readouterr().err


def _step_sent_by_kind(cfg):
    """One rank of a real run: the trainer's build and step (`step.forward_backward`, then
    the wrappers' step, as `train.train` runs them), its bytes sent by kind."""
    import torch
    from picolib import compose
    from picolib.comm import Ledger
    from picolib.mesh import Mesh
    from picolib.step import forward_backward, sent_by_kind
    mesh = Mesh("cpu", **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    stages, wrappers, optimizers, sched, _ = compose.build(cfg, mesh)
    ids = torch.randint(0, 64, (cfg.batch, cfg.seq)).chunk(cfg.dp)[mesh.coordinate("dp")]
    tokens = list(ids.chunk(cfg.micro_batches))
    with Ledger() as led:
        forward_backward(cfg, stages, wrappers, sched, mesh, tokens, tokens)
        for opt in optimizers:
            opt.step()
    return mesh.coordinate("pp"), sent_by_kind(led, mesh)


def test_zb_h1_under_tp_syncs_every_stage_on_real_ranks():
    """ZB-H1 splits backward into B and W; under TP every Linear's weight gradient comes in
    B, so a later stage's last W computes nothing and no DDP hook fires while sync is on.
    The gradients accumulated without sync must still be all-reduced (DDP.step does it):
    every rank sends the planner's DP bytes (before the fix the last stage sent none, and
    its replicas drifted apart)."""
    from picolib.launch import run
    cfg = TrainConfig(dp=2, tp=2, pp=2, schedule="zb_h1", micro_batches=4, batch=8, seq=16)
    for pp_rank, sent in run(_step_sent_by_kind, cfg.world_size, cfg):
        assert sent.get("DP", 0) == _planner(cfg, pp_rank)[1]["dp"] > 0


def test_fast_arithmetic_holds_inside_its_block_only():
    """PyTorch's meta add keeps a transposed input's layout; the shape rule makes a contiguous
    result. Inside the block the rule runs (where this torch accepts it), after it PyTorch's
    own kernel is back: the registration does not leak."""
    import torch

    from picolib.meta import fast_arithmetic
    a = torch.empty(4, 3, device="meta").t()                 # strides (1, 3)
    own = (a + a).stride()
    assert own != (4, 1), own
    with fast_arithmetic() as ops:
        inside = (a + a).stride(), (a * 2).shape
    if "add.Tensor" in ops:
        assert inside[0] == (4, 1), inside
    assert inside[1] == (3, 4)
    assert (a + a).stride() == own


def test_the_sync_hook_sees_every_switch_until_removed():
    """The hook the dry run samples gradients by: called with each setting, no_sync included."""
    from picolib.flat import GradientSyncSwitch
    switch, seen = GradientSyncSwitch(), []
    handle = switch.register_sync_hook(lambda w, on: seen.append((w, on)))
    switch.set_requires_gradient_sync(False)
    with switch.no_sync():
        pass
    handle.remove()
    switch.set_requires_gradient_sync(True)
    assert seen == [(switch, False), (switch, False), (switch, False)]
    assert GradientSyncSwitch()._sync is True and "_sync_hooks" not in vars(GradientSyncSwitch)
