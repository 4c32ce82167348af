"""TeraPipe on real ranks: the loss and every gradient equal one process for p = 2 and 4,
uniform, DP-chosen, ragged and single-slice (GPipe) slicings, with and without
micro-batches, eager and SDPA attention; the measured emulated makespan follows the
simulator; bad plans fail before any rank starts."""
import pytest
import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.model import AttentionCore, LlamaConfig, TinyLlama, random_tokens
from picolib.pipeline_parallel import stage_grads
from picolib.terapipe import (SliceKVCache, TeraPipePlan, measure_costs, run_terapipe,
                              simulate_plan, terapipe_stage, use_kv_cache)
from picolib.terapipe_slicer import CostModel, dp_slices, pipeline_latency, uniform_slices
from picolib.timeline import Timeline, makespan, merge

CFG = LlamaConfig(hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=32)
SEQ, BATCH = 12, 2
COST = CostModel(a=1.0, b=0.1, d=0.05, e=0.02)        # later tokens cost more


def _slicings(p):
    dp, _ = dp_slices(SEQ, p, COST)
    return {"uniform": uniform_slices(SEQ, 3), "dp": dp, "ragged": (5, 1, 6),
            "one slice": (SEQ,), "every token": (1,) * SEQ}


def _cases(p):
    return [(name, slices, m, impl) for name, slices in _slicings(p).items() for m in (1, 2)
            for impl in ("eager", "sdpa") if impl == "eager" or name in ("ragged", "dp")]


def _all_steps(p, cases):
    out = {}
    for name, slices, m, impl in cases:
        cfg = CFG.replace(attn_impl=impl)
        model = TinyLlama(cfg)
        plan = TeraPipePlan(slices, p, cfg.n_layers, n_micro=m)
        stage = terapipe_stage(model, plan, dist.get_rank())
        tokens, targets = random_tokens(BATCH, SEQ, cfg.vocab_size, seed=3)
        res = run_terapipe(plan, stage, tokens, targets)
        out[(name, m, impl)] = (res["loss"], stage_grads(stage, model))
    return out


def _reference(impl):
    model = TinyLlama(CFG.replace(attn_impl=impl))
    tokens, targets = random_tokens(BATCH, SEQ, CFG.vocab_size, seed=3)
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.detach(), {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.parametrize("p", [2, 4])
def test_terapipe_matches_one_process(p):
    """fp32, atol 1e-5: slices sum their token losses and gradients in another order."""
    cases = _cases(p)
    assert len(_slicings(p)["dp"]) > 1                  # the DP does cut the sequence
    results = run(_all_steps, p, p, cases, timeout=240)
    refs = {impl: _reference(impl) for impl in ("eager", "sdpa")}
    for name, slices, m, impl in cases:
        key = (name, m, impl)
        losses = [r[key][0] for r in results]
        assert all(x is None for x in losses[:-1]), key          # only the last rank has it
        ref_loss, ref_grads = refs[impl]
        torch.testing.assert_close(losses[-1], ref_loss, atol=1e-5, rtol=1e-5)
        grads = {k: g for r in results for k, g in r[key][1].items()}
        assert grads.keys() == ref_grads.keys(), key              # every parameter, once
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-4,
                                       msg=lambda s: f"{key} {k}: {s}")


def test_without_the_cache_the_gradients_differ():
    """The check above can fail: slices that do not see their context give another loss."""
    model = TinyLlama(CFG)
    tokens, targets = random_tokens(BATCH, SEQ, CFG.vocab_size, seed=3)
    whole = model.loss(tokens, targets)
    alone = sum(model.loss(tokens[:, a:a + 4], targets[:, a:a + 4]) for a in (0, 4, 8)) / 3
    assert abs(whole.item() - alone.item()) > 1e-4


def _emulated(p, slices, cost_scale):
    model = TinyLlama(CFG)
    plan = TeraPipePlan(slices, p, CFG.n_layers)
    stage = terapipe_stage(model, plan, dist.get_rank())
    tokens, targets = random_tokens(1, SEQ, CFG.vocab_size, seed=3)
    cost = lambda l, c: cost_scale * COST(l, c)
    run_terapipe(plan, stage, tokens, targets)                    # warm-up
    tl = Timeline(emulate={})
    dist.barrier()
    run_terapipe(plan, stage, tokens, targets, timeline=tl, cost=cost)
    return tl.events


def test_emulated_run_follows_the_schedule():
    """Cost emulation (each op sleeps to its cost): the ranks run the slices in the plan's
    order (forwards, then backwards in reverse), and the makespan is never below the
    simulated one (= Σt + (K−1)·max t). How close it comes is measured in bench/terapipe.py."""
    p, slices, scale = 2, (6, 4, 2), 0.005
    events = merge(run(_emulated, p, p, slices, scale))
    predicted = pipeline_latency(slices, lambda l, c: scale * COST(l, c), p)
    assert makespan(simulate_plan(TeraPipePlan(slices, p, 4), lambda l, c: scale * COST(l, c))) \
        == pytest.approx(predicted)
    assert makespan(events) >= predicted * 0.999
    for r in range(p):
        mine = [(e["name"], e["meta"]["slice"]) for e in events if e["rank"] == r]
        assert mine == [("F", 0), ("F", 1), ("F", 2), ("BW", 2), ("BW", 1), ("BW", 0)]


@pytest.mark.parametrize("slices, seq, match", [((4, 4, 3), 12, "add up to 11"),
                                                 ((6, 0, 6), 12, "slice 1 has 0 tokens"),
                                                 ((), 12, "no slices")])
def test_bad_slices_fail_before_any_rank_starts(slices, seq, match):
    from picolib.terapipe_slicer import check_slices
    with pytest.raises(ValueError, match=match):
        check_slices(slices, seq)
    with pytest.raises(ValueError, match=match):
        TeraPipePlan(slices, 2, 4, seq=seq)


def test_bad_plans_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="0 tokens"):
        TeraPipePlan((6, 0, 6), 2, 4)
    with pytest.raises(ValueError, match="8 stages for 4 layers"):
        TeraPipePlan((6, 6), 8, 4)
    with pytest.raises(ValueError, match="n_micro=0"):
        TeraPipePlan((6, 6), 2, 4, n_micro=0)
    plan = TeraPipePlan((20, 20), 2, 4)
    with pytest.raises(ValueError, match="max_seq ≥ 40"):
        terapipe_stage(TinyLlama(CFG), plan, 0)
    with pytest.raises(ValueError, match="recompute"):
        use_kv_cache(TinyLlama(CFG.replace(recompute="full")))


def test_the_cache_keeps_leaves_and_swaps_only_plain_cores():
    model = TinyLlama(CFG)
    cores = use_kv_cache(model)
    assert len(cores) == CFG.n_layers and not any(isinstance(c, AttentionCore) for c in cores)
    cache = SliceKVCache()
    k = torch.randn(1, 2, 3, 8, requires_grad=True) * 2
    cache.keep(cores[0], k, k + 1)
    keys, values = cache.past(cores[0])
    assert keys[0].is_leaf and keys[0].requires_grad and len(cache.take_produced()) == 2


def test_measure_costs_covers_the_grid():
    """One (l, c, seconds) row per pair that fits in max_seq, no gradient left on the model
    (the times themselves are for bench/ and the lesson)."""
    model = TinyLlama(LlamaConfig(hidden=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  ffn_hidden=64, max_seq=64))
    rows = measure_costs(model, [16, 48], [0, 32], repeats=1)
    assert [(l, c) for l, c, _ in rows] == [(16, 0), (48, 0), (16, 32)]
    assert all(s > 0 for _, _, s in rows)
    assert all(p.grad is None for p in model.parameters())
