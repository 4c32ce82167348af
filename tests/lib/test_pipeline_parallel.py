"""Pipeline parallel: every schedule gives one process's loss and gradients (also torch's
ScheduleInterleavedZeroBubble order, run by picolib's executor; DualPipe with DDP over its
pairs of ranks, which sums the two copies' gradients); the validator
rejects broken schedules; the simulator reproduces the bubble formulas; AFAB keeps m
micro-batches of activations alive, 1F1B at most p."""
import functools

import pytest
import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.data_parallel import DDP
from picolib.mesh import Mesh
from picolib.pipeline_parallel import (pair_gradient_groups, partition, run_schedule,
                                       schedule_stages, stage_grads)
from picolib.pipeline_schedules import (Op, Schedule, afab, bubble_formula, from_torch,
                                        interleaved_1f1b, make_schedule, one_f_one_b, zb_greedy)
from picolib.pipeline_simulator import ScheduleError, simulate, validate
from picolib.timeline import bubble_ratio

CFG = LlamaConfig(hidden=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=16)
MB, SEQ = 2, 8            # micro-batch size, sequence length
NAMES = (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zb_greedy", 1),
         ("dualpipev", 1), ("dualpipe", 1))


def _valid(p, m):
    return [(n, v) for n, v in NAMES
            if not (n == "interleaved" and m % p) and not (n.startswith("dualpipe") and m < 2 * p)
            and not (n == "dualpipe" and (p % 2 or m % 2))]


def _one_step(name, p, m, v, measure_peak=False):
    """This rank's part of one step: (loss or None, {param name: grad}, peak saved bytes)."""
    rank = dist.get_rank()
    model = TinyLlama(CFG)
    if name == "torch_zero_bubble":      # torch's own op lists, run by picolib's executor
        from torch.distributed import pipelining
        peers = [pipelining.PipelineStage(torch.nn.Identity(), s, p * v, torch.device("cpu"))
                 for s in (rank, rank + p)]
        order = pipelining.ScheduleInterleavedZeroBubble(peers, m).pipeline_order
        sched = validate(from_torch(order, m))
    else:
        sched = make_schedule(name, p, m, v)
    stages = schedule_stages(model, sched)
    mine = {s: st for s, st in stages.items() if s in sched.stages_of(rank)}   # stages' order
    tokens, targets = random_tokens(MB * m, SEQ, CFG.vocab_size, seed=1)
    act = SavedActivations(torch.nn.ModuleList(mine.values()), per_module=False) if measure_peak else None
    wrappers = {}
    if name == "dualpipe":               # ranks r and p−1−r hold copies of the same layers:
        mesh = Mesh(pp=p)                # the one gradient path (DDP) sums them over the pair
        groups = pair_gradient_groups(mine, mesh)
        wrappers = {s: DDP(st, mesh.group("dp"), groups=groups) for s, st in mine.items()}
    out = run_schedule(sched, mine, list(tokens.chunk(m)), list(targets.chunk(m)), measure=act,
                       data_parallel=wrappers)
    grads = {}
    for st in mine.values():
        grads.update(stage_grads(st, model))
    return out["loss"], grads, act.peak if act else None


def _all_cases(p):
    out = {(n, p, m, v): _one_step(n, p, m, v) for m in range(1, 9) for n, v in _valid(p, m)}
    out[("torch_zero_bubble", p, 8, 2)] = _one_step("torch_zero_bubble", p, 8, 2)
    return out


@functools.cache      # one per m, shared by every schedule and both p
def _reference(m):
    model = TinyLlama(CFG)
    tokens, targets = random_tokens(MB * m, SEQ, CFG.vocab_size, seed=1)
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_one_process(p):
    """All schedules valid for m = 1..8 in one launch. fp32, atol 1e-5: the pipeline sums
    the micro-batch gradients in a different order than one big batch."""
    results = run(_all_cases, p, p, timeout=300)
    cases = results[0].keys()
    assert {c[0] for c in cases} == {n for n, _ in NAMES} | {"torch_zero_bubble"}
    for case in cases:
        losses = [r[case][0] for r in results if r[case][0] is not None]
        grads = {k: g for r in results for k, g in r[case][1].items()}
        ref_loss, ref_grads = _reference(case[2])
        # the loss lives on one rank; DualPipe: on the two ends, half the micro-batches each
        assert len(losses) == (2 if case[0] == "dualpipe" else 1), case
        torch.testing.assert_close(sum(losses), ref_loss, atol=1e-5, rtol=1e-5)
        assert grads.keys() == ref_grads.keys(), case    # every parameter
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-4,
                                       msg=lambda s: f"{case} {k}: {s}")


def _peaks(p):
    return {(n, m): _one_step(n, p, m, 1, measure_peak=True)[2]
            for n in ("afab", "1f1b") for m in (1, 2, 4, 8)}


def test_afab_activations_grow_with_m_and_1f1b_stay_under_p():
    p = 4
    peaks = run(_peaks, p, p, timeout=300)
    first = peaks[0]                       # rank 0 (first stage) keeps the most
    one = first[("afab", 1)]               # measured bytes of one micro-batch on this stage
    assert one > 0 and first[("1f1b", 1)] == one
    for m in (2, 4, 8):
        assert first[("afab", m)] == pytest.approx(m * one, rel=0.02)
        assert first[("1f1b", m)] <= p * one * 1.02
        assert first[("1f1b", m)] == pytest.approx(min(m, p) * one, rel=0.02)


# ----------------------------------------------------------------------------- validator

def _ops(*rows):
    return [[Op(k, s, mb) for k, s, mb in row] for row in rows]


GOOD = [("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)], \
       [("F", 1, 0), ("BW", 1, 0), ("F", 1, 1), ("BW", 1, 1)]


def test_validator_accepts_every_generator():
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 17):
            for n, v in _valid(p, m) + ([("interleaved", 4)] if m % p == 0 else []):
                validate(make_schedule(n, p, m, v))
    validate(Schedule("ok", 2, (0, 1), _ops(*GOOD)))


@pytest.mark.parametrize("rows, message", [
    ((GOOD[0][:-1], GOOD[1]), "missing BW"),                                          # a missing op
    ((GOOD[0] + [("BW", 0, 1)], GOOD[1]), "twice"),                                   # a doubled op
    (([("F", 0, 1), ("BW", 0, 0), ("F", 0, 0), ("BW", 0, 1)], GOOD[1]), "before its F"),
    ((GOOD[0], [("F", 1, 0), ("W", 1, 0), ("B", 1, 0), ("F", 1, 1), ("BW", 1, 1)]), "W(s1,mb0) comes before its B"),
    ((GOOD[0], [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("BW", 1, 1)]), "missing W"),
    ((GOOD[0] + [("F", 1, 0)], GOOD[1]), "belongs to rank 1"),
    # each rank's own order is fine, but rank 0 waits for BW(s1,mb0) that rank 1 runs only
    # after F(s1,mb1), which waits for rank 0's F(s0,mb1): a deadlock
    (([("F", 0, 0), ("BW", 0, 0), ("F", 0, 1), ("BW", 0, 1)],
      [("F", 1, 0), ("F", 1, 1), ("BW", 1, 1), ("BW", 1, 0)]), "deadlock"),
])
def test_validator_rejects(rows, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(Schedule("broken", 2, (0, 1), _ops(*rows)))


# ----------------------------------------------------------------------------- simulator

@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_simulator_reproduces_the_bubble_formulas(p):
    tf, tb = 1.0, 2.0                       # equal costs on every stage, no comm
    for m in range(1, 17):
        for gen in (afab, one_f_one_b):
            assert bubble_ratio(simulate(gen(p, m), {"F": tf, "B": tb, "W": 0.0})) \
                == pytest.approx(bubble_formula(p, m), abs=1e-12)
        if m % p == 0:
            for v in (2, 4):                # a chunk holds 1/v of the layers: costs / v
                ev = simulate(interleaved_1f1b(p, m, v), {"F": tf / v, "B": tb / v, "W": 0.0})
                assert bubble_ratio(ev) == pytest.approx(bubble_formula(p, m, v), abs=1e-12)
        # the greedy zero-bubble order with F = B = W: the W's fill the cool-down only, each
        # rank idles (p−1)(F+B) instead of 1F1B's (p−1)(F+B+W)
        # (ZB-H1: tests/lib/test_zero_bubble.py)
        ev = simulate(zb_greedy(p, m), {"F": 1.0, "B": 1.0, "W": 1.0})
        assert bubble_ratio(ev) == pytest.approx(2 * (p - 1) / (3 * m), abs=1e-12)


def test_the_published_pp8_table_holds_only_where_interleaving_runs():
    """The table 7.0, 3.5, 1.75, 0.22, 0.03 at (m, v) = (1,1), (1,2), (1,4), (8,4), (32,8) is
    (p−1)/(v·m); the simulator agrees where the interleaved schedule exists (m a multiple of
    p) and shows 7.0 for every v at m = 1 (one micro-batch crosses all p·v chunks in turn)."""
    table = {(1, 1): 7.0, (1, 2): 3.5, (1, 4): 1.75, (8, 4): 0.22, (32, 8): 0.03}
    for (m, v), size in table.items():
        cost = {"F": 1 / v, "B": 2 / v, "W": 0.0}
        if m % 8 == 0:
            sim = bubble_ratio(simulate(make_schedule("interleaved", 8, m, v), cost))
            assert round(sim, 2) == size
        else:
            ops = [[Op("F", c * 8 + r, 0) for c in range(v)] +
                   [Op("BW", c * 8 + r, 0) for c in reversed(range(v))] for r in range(8)]
            chain = Schedule("m=1", 1, tuple(s % 8 for s in range(8 * v)), ops)
            assert bubble_ratio(simulate(chain, cost)) == pytest.approx(7.0)
            assert (v == 1) == (round(bubble_formula(8, m, v), 2) == 7.0)   # v > 1: wrong


def test_simulator_counts_comm_between_ranks_only():
    ev = simulate(one_f_one_b(2, 1), {"F": 1.0, "B": 1.0, "W": 0.0, "comm": 0.5})
    assert max(e["end"] for e in ev) == pytest.approx(1 + 0.5 + 1 + 1 + 0.5 + 1)


# ----------------------------------------------------------------------------- bad input

def test_bad_input_is_rejected_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("gpipe2", 2, 4)
    with pytest.raises(ValueError, match="v ≥ 2"):
        make_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ValueError, match="multiple of p"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="m ≥ 2p"):
        make_schedule("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="positive int"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="9 stages for 8 layers"):
        partition(8, 9)


def test_partition_balances_costs():
    assert partition(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(r) for r in partition(8, 2 * 3)] == [1, 1, 2, 2, 1, 1]   # uneven: the ends lighter
    # a heavy first layer gets a stage to itself: max stage cost 4, not 5 of the even split
    assert partition(6, 2, [4, 1, 1, 1, 1, 1]) == [range(0, 1), range(1, 6)]


def _torch_orders(p):
    """torch.distributed.pipelining's op lists, as picolib Schedules."""
    from torch.distributed import pipelining as tpp
    rank, out = dist.get_rank(), {}
    for m in (4, 8, 12):
        cpu = torch.device("cpu")
        looped = [tpp.PipelineStage(torch.nn.Identity(), s, 2 * p, cpu) for s in (rank, rank + p)]
        v_shape = [tpp.PipelineStage(torch.nn.Identity(), s, 2 * p, cpu) for s in (rank, 2 * p - 1 - rank)]
        if m % p == 0:
            out[("interleaved", m)] = from_torch(tpp.ScheduleInterleaved1F1B(looped, m).pipeline_order, m)
        if m >= 2 * p:
            out[("dualpipev", m)] = from_torch(tpp.ScheduleDualPipeV(v_shape, m).pipeline_order, m)
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_and_dualpipev_are_torchs_orders(p):
    """picolib's generators give exactly the op lists of ScheduleInterleaved1F1B and
    ScheduleDualPipeV (compute ops; torch's comm actions dropped)."""
    orders = run(_torch_orders, p, p, timeout=120)[0]
    assert len(orders) >= 4
    for (name, m), theirs in orders.items():
        validate(theirs)
        assert make_schedule(name, p, m, 2 if name == "interleaved" else 1).ops == theirs.ops, (name, m)
