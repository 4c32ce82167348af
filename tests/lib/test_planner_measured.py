"""The planner against picolib's own runs, byte for byte: per-rank parameters, gradients,
optimizer state and saved activations (picolib.memory, ZeRO.memory) and the bytes each rank
sends per step (picolib.comm.Ledger), for DDP, ZeRO-1/2/3 (fp32 and bf16), TP, TP+SP and
pipeline schedules on real gloo ranks; DDP and ZeRO at world size 1024 on PyTorch's fake
process group (one process, no data moved)."""

import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.launch import run
from picolib.memory import SavedActivations, grad_bytes, optimizer_state_bytes, param_bytes
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.planner import Parallelism, layer_activation_bytes, memory, traffic

# Odd sizes: units that do not divide by 4 ranks, so ZeRO pads (as in tests/lib/test_zero.py)
ODD = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                  ffn_hidden=23, max_seq=16, seed=3)
TPC = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
PPC = LlamaConfig(vocab_size=64, hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64)
MB, SEQ = 2, 8


def exact(**kw):
    """The planner set to what these runs do: fp32, picolib's activation count."""
    return Parallelism(precision="fp32", activations="picolib", flash=False, seq=SEQ,
                       micro_batch_size=MB, **kw)


# ----------------------------------------------------------------------------- DDP and ZeRO
def _dp_step(cfg, kind, dtype):
    from picolib.data_parallel import DDP
    from picolib.zero import ZeRO
    r = dist.get_rank()
    model = TinyLlama(cfg)
    x, y = random_tokens(MB, SEQ, cfg.vocab_size, seed=r)
    if kind == 0:
        wrapped = DDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        wrapped = ZeRO(model, kind, param_dtype=dtype)
    with comm.Ledger() as led, SavedActivations() as act:   # ZeRO-3's weights are no activations
        model.loss(x, y).backward()
        if kind == 0:
            opt.step()
        else:
            wrapped.step()
    held = (wrapped.memory() if kind else
            {"params": param_bytes(model), "grads": grad_bytes(model),
             "optimizer": optimizer_state_bytes(opt)})
    # without `model` the counter cannot tell the RoPE tables (buffers, saved by view) from
    # activations: take their bytes off
    tables = sum(b.untyped_storage().nbytes() for b in model.buffers())
    return held, act.peak - tables, led.total("sent_bytes")


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_and_zero_fp32_bytes_equal_the_plan(n):
    for kind in (0, 1, 2, 3):
        par = exact(dp=n, zero=kind)
        plan, sent = memory(ODD, par), traffic(ODD, par)
        for rank, (held, peak, measured) in enumerate(run(_dp_step, n, ODD, kind, torch.float32)):
            assert held == {k: plan[k] for k in ("params", "grads", "optimizer")}, (kind, rank)
            assert peak == plan["activations"] > 0, (kind, rank)
            assert measured == sent["dp"] == sent["total"] > 0, (kind, rank)


def test_zero_bf16_with_fp32_master_equals_the_plan():
    n = 2
    for stage in (1, 2, 3):
        par = Parallelism(dp=n, zero=stage, precision="bf16", seq=SEQ, micro_batch_size=MB)
        plan, sent = memory(ODD, par), traffic(ODD, par)
        for held, _, measured in run(_dp_step, n, ODD, stage, torch.bfloat16):
            assert held == {k: plan[k] for k in ("params", "grads", "optimizer")}, stage
            assert measured == sent["dp"], stage


# ----------------------------------------------------------------------------- TP, TP+SP
def _tp_step(cfg, sp):
    from picolib.tensor_parallel import apply_tensor_parallel
    model = apply_tensor_parallel(TinyLlama(cfg), sequence_parallel=sp)
    x, y = random_tokens(MB, SEQ, cfg.vocab_size, seed=1)
    with comm.Ledger() as led, SavedActivations(model) as act:
        model.loss(x, y).backward()
    block = sum(v for k, v in act.by_module.items() if k.startswith("blocks.0."))
    return param_bytes(model), block, led.total("sent_bytes")


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tensor_and_sequence_parallel_bytes_equal_the_plan(tp, sp):
    """tp = 4 > 2 KV heads: each KV head is held by 2 ranks, whose weight gradients are summed
    (one more all-reduce a block in backward) — the plan counts it."""
    par = exact(tp=tp, sp=sp)
    plan, sent = memory(TPC, par), traffic(TPC, par)
    per_layer = layer_activation_bytes(TPC, par)
    for params, block, measured in run(_tp_step, tp, TPC, sp):
        assert params == plan["params"]
        assert block == per_layer
        assert measured == sent["tp"] == sent["total"] > 0


# ----------------------------------------------------------------------------- pipelines
def _pp_step(cfg, name, m):
    from picolib.pipeline_parallel import run_schedule, schedule_stages
    from picolib.pipeline_schedules import make_schedule
    rank = dist.get_rank()
    sched = make_schedule(name, dist.get_world_size(), m)
    stages = schedule_stages(TinyLlama(cfg), sched)
    mine = {s: stages[s] for s in sched.stages_of(rank)}
    tokens, targets = random_tokens(MB * m, SEQ, cfg.vocab_size, seed=1)
    act = SavedActivations(torch.nn.ModuleList(mine.values()), per_module=False)
    # one storage per micro-batch, as a data loader gives (the counter counts a storage whole)
    own = [[t.clone() for t in x.chunk(m)] for x in (tokens, targets)]
    with comm.Ledger() as led:
        run_schedule(sched, mine, *own, measure=act)
    return act.peak, led.total("sent_bytes"), param_bytes(torch.nn.ModuleList(mine.values()))


def _pp_all(cfg):
    return {(name, m): _pp_step(cfg, name, m) for name in ("afab", "1f1b") for m in (1, 3, 6)}


def test_pipeline_in_flight_activations_and_sends_equal_the_plan():
    p = 4
    results = run(_pp_all, p, PPC, timeout=180)
    for rank, res in enumerate(results):
        for (name, m), (peak, sent, params) in res.items():
            par = exact(pp=p, schedule=name, micro_batches=m)
            plan = memory(PPC, par, pp_rank=rank)
            assert peak == plan["activations"], (name, m, rank)
            assert params == plan["params"], (name, m, rank)
            assert sent == traffic(PPC, par, pp_rank=rank)["pp"] > 0, (name, m, rank)


# ----------------------------------------------------------------------------- 1,024 ranks
def test_ddp_and_zero_on_1024_fake_ranks_send_what_the_plan_says():
    from picolib.tryit.lesson11 import fake_pg_traffic   # the run lesson 11b shows
    out = fake_pg_traffic(ODD)
    for stage in (0, 1, 2, 3):
        sent, mem, calls = out[stage]
        sizes = sorted({size for _, _, size in calls})
        par = exact(dp=1024, zero=stage)
        assert sizes == [1024] and sent == traffic(ODD, par)["dp"] > 0, stage
        if stage:
            plan = memory(ODD, par)
            assert mem == {k: plan[k] for k in ("params", "grads", "optimizer")}, stage


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (2, 2)])
def test_context_parallel_ring_bytes_equal_the_plan(cp, tp):
    """The trainer's ledger (busiest rank, one step): the ring's sends equal the planner's cp
    bytes, and the gradient all-reduce over dp×cp its dp bytes (one bucket here)."""
    from picolib.planner import traffic
    from picolib.train import TrainConfig, train

    seq, batch = 32, 2
    cfg = TrainConfig(cp=cp, tp=tp, seq=seq, batch=batch, steps=1, progress=False)
    sent = run(train, cp * tp, cfg, timeout=120)[0][0]["sent_bytes"]
    par = Parallelism(cp=cp, tp=tp, seq=seq, micro_batch_size=batch, precision="fp32",
                      activations="picolib")
    plan = traffic(cfg.model_config(), par)
    assert sent["send"] == plan["cp"]
    if tp == 1:
        assert sent["all_reduce"] == plan["dp"]


def test_expert_parallel_all_to_all_bytes_equal_the_plan_under_even_routing():
    """With top_k = n_experts every token goes to every expert: routing is even and the
    planner's all-to-all bytes (dispatch, combine, both passes, and the counts) are exact."""
    from picolib.planner import MoEShape, traffic
    from picolib.train import TrainConfig, train

    cfg = TrainConfig(dp=2, ep=2, experts=4, top_k=4, seq=16, batch=2, steps=1, progress=False)
    sent = run(train, 2, cfg, timeout=120)[0][0]["sent_bytes"]
    mcfg = cfg.model_config()
    par = Parallelism(dp=2, ep=2, seq=16, micro_batch_size=1, precision="fp32", activations="picolib")
    plan = traffic(mcfg, par, moe=MoEShape(n_experts=4, top_k=4, expert_ffn=mcfg.ffn_hidden))
    assert sent["all_to_all"] == plan["ep"]
