"""Techniques combined on one mesh, each run equal to one process that sees the same global
batch: the loss of every step and every weight after 3 Adam steps (fp32; atol 1e-5 on
weights — the summation order of micro-batch, replica and shard gradients differs).
4 ranks: dp2×pp2 (DDP, ZeRO-1; 1F1B, ZB-H1), dp2×tp2 (±SP; DDP with and without gradient
accumulation), tp2×pp2 (±SP), ZeRO-1/2/3 × tp2+SP; 8 ranks: dp2×pp2×tp2+SP with ZeRO-1.
The transforms run in the documented order: tensor (+sequence) parallel, split into
stages, data parallel on each stage.

Adam divides each gradient element by √v + eps: where an element is near zero, rounding
noise from a different summation order becomes a step of up to lr. With eps = 1e-6 that
moved a few embedding rows by 2e-5 (seen); eps = 1e-3 bounds the amplification, and the
weights then agree within 1e-6."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from picolib.comm import Ledger
from picolib.context_parallel import apply_context_parallel, shard_sequence
from picolib.data_parallel import DDP
from picolib.launch import WorkerError, run
from picolib.mesh import Mesh
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.pipeline_parallel import run_schedule, split_stages
from picolib.pipeline_schedules import make_schedule
from picolib.tensor_parallel import apply_tensor_parallel
from picolib.zero import ZeRO

CFG = LlamaConfig(hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=16)
STEPS, BATCH, SEQ, LR, EPS = 3, 8, 8, 1e-2, 1e-3
CP_LAYOUT = "zigzag"


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


def _parallel(model, mesh, sp, pp, cp_algorithm="ring"):
    """The transforms in their order: TP (+SP) over the mesh's tp, CP over its cp, then this
    rank's stage."""
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=sp)
    if mesh.size("cp") > 1:
        apply_context_parallel(model, mesh, layout=CP_LAYOUT, algorithm=cp_algorithm)
    return split_stages(model, mesh.size("pp"))[pp] if mesh.size("pp") > 1 else model


def _train(sizes, wrapper, sp=False, schedule="1f1b", m=2, cp_algorithm="ring"):
    """3 Adam steps on this rank's part of the model; `wrapper`: "ddp", "zero1/2/3" or None
    (no data parallelism). Without a pipeline the m micro-batches accumulate under no_sync.
    Context-parallel ranks are replicas of the weights too: the wrapper reduces over dp×cp."""
    mesh = Mesh(**sizes)
    dp, pp, n_dp, n_pp = (mesh.coordinate("dp"), mesh.coordinate("pp"), mesh.size("dp"),
                          mesh.size("pp"))
    cp, n_cp = mesh.coordinate("cp"), mesh.size("cp")
    replicas = mesh.group("dp", "cp") if n_cp > 1 else mesh.group("dp")
    part = _parallel(TinyLlama(CFG), mesh, sp, pp, cp_algorithm)
    dp_part, opt = None, None
    if wrapper == "ddp":
        dp_part = DDP(part, group=replicas)
    elif wrapper is not None:
        dp_part = opt = ZeRO(part, int(wrapper[-1]), group=replicas, optimizer="adam",
                             lr=LR, eps=EPS)   # ZeRO owns its optimizer
    opt = opt or torch.optim.Adam(part.parameters(), lr=LR, eps=EPS)
    losses, syncs = [], []
    for step in range(STEPS):
        tokens, targets = (list(shard_sequence(t.chunk(n_dp)[dp], CP_LAYOUT, cp, n_cp).chunk(m))
                           for t in _batch(step))  # this replica's share, its slice of the sequence
        with Ledger() as led:
            if n_pp > 1:
                loss = run_schedule(make_schedule(schedule, n_pp, m), {pp: part}, tokens, targets,
                                    group_ranks=mesh.peers("pp"),
                                    data_parallel={pp: dp_part} if dp_part else None)["loss"]
            else:
                loss = 0
                for i, (x, y) in enumerate(zip(tokens, targets, strict=True)):
                    last = i == m - 1
                    with contextlib.nullcontext() if last or not dp_part else dp_part.no_sync():
                        micro = part.loss(x, y) / m
                        micro.backward()
                    loss = loss + micro.detach()
        syncs.append(led.count("all_reduce") + led.count("reduce_scatter"))
        opt.step()
        opt.zero_grad()
        if loss is not None:  # the replica's mean loss; the global one is their mean
            total = loss.reshape(1).clone()
            dist.all_reduce(total, group=replicas)
            losses.append(total.item() / (n_dp * n_cp))
    got = dp_part.gather_parameters() if wrapper == "zero3" else dict(part.named_parameters())
    expected = _parallel(_reference_model(), mesh, sp, pp, cp_algorithm)   # the trained weights, cut alike
    errors = {n: (got[n] - e).abs().max().item() for n, e in expected.named_parameters()}
    coords = {d: mesh.coordinate(d) for d in ("pp", "dp", "cp", "tp")}
    units = None if dp_part is None else (
        len(dp_part.buckets) if wrapper == "ddp" else len(dp_part.unit_numels()))
    return coords, losses, {n: t.detach().clone() for n, t in got.items()}, errors, (syncs, units)


def _check(results, n_last):
    """Every loss and weight equals the reference; replicas along dp hold equal weights."""
    losses = [r[1] for r in results if r[1]]
    assert len(losses) == n_last, [r[1] for r in results]   # the ranks that end in the loss
    for got in losses:
        for g, want in zip(got, _REF_LOSSES, strict=True):
            assert abs(g - want) < 1e-5, (got, _REF_LOSSES)
    replicas = {}
    for coords, _, params, errors, _ in results:
        assert errors and max(errors.values()) < 1e-5, (coords, errors)
        key = (coords["pp"], coords["tp"])
        if key in replicas:   # the other data-parallel replica of this part: the very same
            for name, value in params.items():
                torch.testing.assert_close(value, replicas[key][name], atol=0, rtol=0, msg=name)
        replicas[key] = params


@pytest.mark.parametrize("wrapper", ["ddp", "zero1"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_dp2_pp2_equals_one_process(wrapper, schedule):
    results = run(_train, 4, {"pp": 2, "dp": 2}, wrapper, False, schedule, timeout=180)
    _check(results, n_last=2)
    for *_, (syncs, units) in results:   # one reduction per bucket or unit per step, not per micro-batch
        assert syncs == [units] * STEPS, (syncs, units)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("m", [1, 2], ids=["one-batch", "accumulate-2"])
def test_dp2_tp2_equals_one_process(sp, m):
    _check(run(_train, 4, {"dp": 2, "tp": 2}, "ddp", sp, "1f1b", m, timeout=180), n_last=4)


@pytest.mark.parametrize("sp, schedule", [(False, "1f1b"), (True, "1f1b"), (True, "zb_h1")])
def test_tp2_pp2_equals_one_process(sp, schedule):
    """The head's f (or all-gather under SP) and the vocab-parallel loss travel with the
    last stage; under SP the stages send (b, s/tp, h) and RoPE sees all s positions."""
    _check(run(_train, 4, {"pp": 2, "tp": 2}, None, sp, schedule, timeout=180), n_last=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_over_tp2_sp_equals_one_process(stage):
    """The norms' gradients are summed over tp inside backward, before ZeRO reduce-scatters."""
    _check(run(_train, 4, {"dp": 2, "tp": 2}, f"zero{stage}", True, "1f1b", 2, timeout=180),
           n_last=4)


def test_dp2_pp2_tp2_sp_zero1_on_8_ranks_equals_one_process():
    _check(run(_train, 8, {"pp": 2, "dp": 2, "tp": 2}, "zero1", True, "1f1b", timeout=300),
           n_last=4)


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses"])
def test_dp2_cp2_equals_one_process(algorithm):
    """Zig-zag context parallelism inside data parallelism: DDP over the 4 ranks of dp×cp."""
    _check(run(_train, 4, {"dp": 2, "cp": 2}, "ddp", False, "1f1b", 1, algorithm, timeout=180),
           n_last=4)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_cp2_tp2_equals_one_process(sp):
    """Ring attention over the heads a TP rank holds; DDP sums the weights' gradients over cp."""
    _check(run(_train, 4, {"cp": 2, "tp": 2}, "ddp", sp, "1f1b", 1, timeout=180), n_last=4)


def test_zero1_over_cp2_tp2_sp_equals_one_process():
    _check(run(_train, 4, {"cp": 2, "tp": 2}, "zero1", True, "1f1b", 2, "ulysses", timeout=180),
           n_last=4)


def _reference_model():
    model = TinyLlama(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_REF_PARAMS[name])
    return model


_REF_LOSSES, _REF_PARAMS = _reference()


def _zero3_pp():
    mesh = Mesh(pp=2, dp=2)
    pp = mesh.coordinate("pp")
    stage = split_stages(TinyLlama(CFG), 2)[pp]
    z3 = ZeRO(stage, 3, group=mesh.group("dp"), optimizer="adam", lr=LR)
    tokens, targets = random_tokens(4, SEQ, CFG.vocab_size, seed=0)
    run_schedule(make_schedule("1f1b", 2, 2), {pp: stage}, list(tokens.chunk(2)),
                 list(targets.chunk(2)), group_ranks=mesh.peers("pp"), data_parallel={pp: z3})


def test_zero3_with_a_pipeline_is_refused_naming_both():
    with pytest.raises(WorkerError, match="ZeRO-3 × pipeline parallelism is not supported"):
        run(_zero3_pp, 4, timeout=60)
