"""Techniques combined on one mesh (dp×pp with DDP and ZeRO-1, dp×tp and dp×tp+SP with DDP),
each run equal to one process that sees the same
global batch: the loss of every step and every weight after 3 Adam steps (fp32; atol
1e-5 on weights — the summation order of micro-batch and replica gradients differs).

Adam divides each gradient element by √v + eps: where an element is near zero, rounding
noise from a different summation order becomes a step of up to lr. With eps = 1e-6 that
moved a few embedding rows by 2e-5 (seen); eps = 1e-3 bounds the amplification, and the
weights then agree within 1e-6."""
import pytest
import torch
import torch.distributed as dist

from picolib.comm import Ledger
from picolib.data_parallel import DDP
from picolib.launch import run
from picolib.mesh import Mesh
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.pipeline_parallel import build_stages, run_schedule
from picolib.pipeline_schedules import make_schedule
from picolib.sequence_parallel import SPLlama
from picolib.tensor_parallel import TPLlama
from picolib.zero import ZeRO

CFG = LlamaConfig(hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=16)
STEPS, BATCH, SEQ, LR, EPS = 3, 8, 8, 1e-2, 1e-3


def _batch(step):
    return random_tokens(BATCH, SEQ, CFG.vocab_size, seed=100 + step)


def _reference():
    model = TinyLlama(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        tokens, targets = _batch(step)
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _dp_pp(wrapper, schedule, m):
    mesh = Mesh(pp=2, dp=2)
    pp, dp = mesh.coordinate("pp"), mesh.coordinate("dp")
    model = TinyLlama(CFG)
    sched = make_schedule(schedule, 2, m)
    stage = build_stages(model, 2)[pp]
    if wrapper == "ddp":
        dp_stage = DDP(stage, group=mesh.group("dp"))
        opt = torch.optim.Adam(stage.parameters(), lr=LR, eps=EPS)
    else:
        dp_stage = ZeRO(stage, 1, group=mesh.group("dp"), optimizer="adam", lr=LR, eps=EPS)
    losses, syncs = [], []
    for step in range(STEPS):
        tokens, targets = (t.chunk(2)[dp] for t in _batch(step))  # this replica's half
        with Ledger() as led:
            out = run_schedule(sched, {pp: stage}, list(tokens.chunk(m)), list(targets.chunk(m)),
                               group_ranks=mesh.peers("pp"), data_parallel={pp: dp_stage})
        syncs.append(led.count("all_reduce") + led.count("reduce_scatter"))
        stepper = opt if wrapper == "ddp" else dp_stage  # ZeRO owns its optimizer
        stepper.step()
        stepper.zero_grad()
        if out["loss"] is not None:  # the replica's mean loss; the global one is their mean
            loss = out["loss"].reshape(1).clone()
            dist.all_reduce(loss, group=mesh.group("dp"))
            losses.append(loss.item() / 2)
    names = {id(p): n for n, p in model.named_parameters()}
    per_step = len(dp_stage.buckets) if wrapper == "ddp" else len(dp_stage.unit_numels())
    assert syncs == [per_step] * STEPS, (syncs, per_step)  # once per step, not per micro-batch
    return losses, {names[id(p)]: p.detach().clone() for p in stage.parameters()}


@pytest.mark.parametrize("wrapper", ["ddp", "zero1"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_dp2_pp2_equals_one_process(wrapper, schedule):
    ref_losses, ref_params = _REF_LOSSES, _REF_PARAMS
    results = run(_dp_pp, 4, wrapper, schedule, 2, timeout=180)
    losses = [r[0] for r in results if r[0]]
    assert len(losses) == 2 and losses[0] == losses[1]  # the last stage of each replica
    for got, want in zip(losses[0], ref_losses, strict=True):
        assert abs(got - want) < 1e-5
    params = {}
    for rank, (_, p) in enumerate(results):
        for name, value in p.items():
            if name in params:  # the other replica of this stage holds the same weights
                torch.testing.assert_close(value, params[name], atol=0, rtol=0)
            params[name] = value
    assert params.keys() == ref_params.keys()
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, atol=1e-5, rtol=1e-4, msg=name)


def _reference_model():
    model = TinyLlama(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_REF_PARAMS[name])
    return model


_REF_LOSSES, _REF_PARAMS = _reference()


def _dp_tp(sp):
    """DDP over dp of a tensor-parallel (optionally sequence-parallel) model over tp."""
    mesh = Mesh(dp=2, tp=2)
    dp, wrap = mesh.coordinate("dp"), (SPLlama if sp else TPLlama)
    model = wrap(TinyLlama(CFG), group=mesh.group("tp"))
    DDP(model, group=mesh.group("dp"))  # its gradient hooks on the parameters do the work
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.chunk(2)[dp] for t in _batch(step))
        loss = model.loss(tokens, targets)
        loss.backward()
        if sp:
            model.finalize_grads()  # the norms saw s/tp tokens each: sum over tp
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total, group=mesh.group("dp"))
        losses.append(total.item() / 2)
    expected = wrap(_reference_model(), group=mesh.group("tp"))  # the trained weights' shards
    errors = {n: (p - e).abs().max().item() for (n, p), e in
              zip(model.named_parameters(), expected.parameters(), strict=True)}
    return losses, errors


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dp2_tp2_equals_one_process(sp):
    for losses, errors in run(_dp_tp, 4, sp, timeout=180):
        for got, want in zip(losses, _REF_LOSSES, strict=True):
            assert abs(got - want) < 1e-5
        assert max(errors.values()) < 1e-5, errors


def _zero3_pp():
    mesh = Mesh(pp=2, dp=2)
    pp = mesh.coordinate("pp")
    stage = build_stages(TinyLlama(CFG), 2)[pp]
    z3 = ZeRO(stage, 3, group=mesh.group("dp"), optimizer="adam", lr=LR)
    tokens, targets = random_tokens(4, SEQ, CFG.vocab_size, seed=0)
    run_schedule(make_schedule("1f1b", 2, 2), {pp: stage}, list(tokens.chunk(2)),
                 list(targets.chunk(2)), group_ranks=mesh.peers("pp"), data_parallel={pp: z3})


def test_zero3_with_a_pipeline_is_refused_naming_both():
    from picolib.launch import WorkerError
    with pytest.raises(WorkerError, match="ZeRO-3 × pipeline parallelism is not supported"):
        run(_zero3_pp, 4, timeout=60)


def _zero_over_sp():
    mesh = Mesh(dp=2, tp=2)
    model = SPLlama(TinyLlama(CFG), group=mesh.group("tp"))
    ZeRO(model, 1, group=mesh.group("dp"))


def test_zero_with_sequence_parallelism_is_refused_naming_both():
    """Not supported yet (the norms' gradients must be summed over tp before ZeRO reduces
    them; before this check the result was silently off by 1e-2): a clear error instead."""
    from picolib.launch import WorkerError
    with pytest.raises(WorkerError, match="ZeRO × sequence parallelism is not supported"):
        run(_zero_over_sp, 4, timeout=60)
