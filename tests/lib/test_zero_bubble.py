"""Zero-bubble schedules against their published bubbles (lesson 07).

Every idle time here is read off the simulator (picolib.pipeline_simulator, ideal devices)
and compared with a closed form written out in the test from the papers:
- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): (p−1)(F+B−W) per rank,
  B = the input-gradient half of the backward, W = the weight half; 1F1B: (p−1)(F+B+W).
- DualPipe (DeepSeek-V3 report, §3.2.1; DeepSeek's DualPipe README): (PP/2−1)(F&B+B−3W), their
  B = the whole backward = our B + W, F&B = an overlapped forward + backward chunk. The
  simulator times each F&B pair as one chunk that starts when both inputs are there and lasts
  cost["F&B"] (default F + B + W: no speed-up). At F = B = W the formula is the idle time of
  the worst rank; with no speed-up every rank idles that much. With B > W it is the idle time
  of the order with every pair overlapped; DeepSeek's reference (and picolib) runs the turn
  rank's first steady pair as two ops and idles less.
Parameter bytes are measured on the modules each rank runs (their tensors' storage)."""
import dataclasses

import pytest
import torch

from picolib.model import LlamaConfig, TinyLlama
from picolib.pipeline_parallel import schedule_stages
from picolib.pipeline_schedules import (dualpipe, dualpipev, idle_formula, make_schedule,
                                        one_f_one_b, zb_greedy, zb_h1)
from picolib.pipeline_simulator import simulate, validate
from picolib.timeline import bubble_ratio

COSTS = [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 1.2, "W": 0.8},
         {"F": 1.0, "B": 1.5, "W": 0.5}, {"F": 2.0, "B": 1.0, "W": 1.0}]


def idle_per_rank(sched, cost, **kw):
    """Makespan minus each rank's busy time, from simulated events."""
    ev = simulate(sched, cost, **kw)
    end = max(e["end"] for e in ev)
    return [end - sum(e["end"] - e["start"] for e in ev if e["rank"] == r)
            for r in range(sched.n_ranks)]


def in_flight(ops) -> int:
    """Most micro-batches alive at once on a rank: forward done, weight gradient not yet."""
    alive = peak = 0
    for op in ops:
        alive += (op.kind == "F") - (op.kind in ("W", "BW"))
        peak = max(peak, alive)
    return peak


# ----------------------------------------------------------------------------- ZB-H1

@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (4, 7), (8, 8), (8, 16)])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w(p, m, cost):
    F, B, W = cost["F"], cost["B"], cost["W"]
    sched = validate(zb_h1(p, m))
    for idle in idle_per_rank(sched, cost):
        assert idle == pytest.approx((p - 1) * (F + B - W), abs=1e-9)
    # 1F1B with the same costs (BW = B + W): (p−1)(F+B+W) on every rank
    for idle in idle_per_rank(one_f_one_b(p, m), cost):
        assert idle == pytest.approx((p - 1) * (F + B + W), abs=1e-9)


def test_zb_h1_with_w_longer_than_b_waits_for_the_first_forwards():
    """The formula needs W ≤ B: otherwise the last rank still waits (p−1)F for its first
    input, and that is every rank's idle time."""
    cost = {"F": 1.0, "B": 1.0, "W": 1.5}
    for p, m in ((4, 8), (8, 16)):
        idle = idle_per_rank(zb_h1(p, m), cost)
        assert idle == pytest.approx([(p - 1) * cost["F"]] * p)
        assert idle[0] > (p - 1) * (cost["F"] + cost["B"] - cost["W"])


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16), (6, 12)])
def test_zb_h1_is_a_third_of_1f1b_and_the_greedy_order_two_thirds(p, m):
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    one = idle_per_rank(one_f_one_b(p, m), unit)[0]
    assert idle_per_rank(zb_h1(p, m), unit)[0] == pytest.approx(one / 3)
    assert max(idle_per_rank(zb_greedy(p, m), unit)) == pytest.approx(2 * one / 3)
    assert bubble_ratio(simulate(zb_h1(p, m), unit)) == pytest.approx((p - 1) / (3 * m))


@pytest.mark.parametrize("p, m", [(2, 1), (3, 2), (4, 3), (4, 4), (4, 9), (8, 16)])
def test_zb_h1_keeps_1f1b_memory_limit(p, m):
    """At most p micro-batches alive on any rank; rank 0 holds exactly what 1F1B's holds."""
    zb, ref = zb_h1(p, m), one_f_one_b(p, m)
    validate(zb)
    peaks = [in_flight(ops) for ops in zb.ops]
    assert max(peaks) <= min(p, m)
    assert peaks[0] == in_flight(ref.ops[0]) == min(p, m)


def test_idle_formula_matches_the_simulator():
    for p, m in ((4, 8), (8, 16)):
        for cost in COSTS[:3]:
            for name in ("1f1b", "zb_h1"):
                assert max(idle_per_rank(make_schedule(name, p, m), cost)) == \
                    pytest.approx(idle_formula(name, p, cost))


# ----------------------------------------------------------------------------- DualPipe

EQUAL = [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 1.0, "W": 1.0, "F&B": 2.5},
         {"F": 1.0, "B": 1.0, "W": 1.0, "F&B": 2.0}, {"F": 0.5, "B": 0.5, "W": 0.5, "F&B": 1.2}]


def deepseek_idle(name, p, cost):
    """(PP/2−1)(F&B + B_full − 3W), B_full = B + W; PP = p for DualPipe, 2p for DualPipeV."""
    fb = cost.get("F&B", cost["F"] + cost["B"] + cost["W"])
    pp = p if name == "dualpipe" else 2 * p
    return (pp / 2 - 1) * (fb + cost["B"] + cost["W"] - 3 * cost["W"])


def all_pairs_overlapped(sched):
    """The same op lists with every F directly followed by a backward of another stage made
    an F&B pair: the turn rank's first steady pair too, which DeepSeek's reference runs as
    two ops ("to further reduce bubble size")."""
    overlap = []
    for seq, pairs in zip(sched.ops, sched.overlap):
        extra = {i for i in range(len(seq) - 1) if seq[i].kind == "F" and seq[i + 1].kind == "BW"
                 and seq[i].stage != seq[i + 1].stage and i not in pairs and i - 1 not in pairs}
        overlap.append(frozenset(pairs | extra))
    return dataclasses.replace(sched, overlap=overlap)


@pytest.mark.parametrize("cost", EQUAL)
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (6, 14), (8, 16)])
def test_dualpipe_bubble_is_deepseeks(p, m, cost):
    """At F = B = W (any F&B speed-up) the worst rank idles DeepSeek's formula exactly, in
    DualPipe and in DualPipeV (= DualPipe of 2p stages, with its half-size chunk costs)."""
    for name, build in (("dualpipe", dualpipe), ("dualpipev", dualpipev)):
        idle = idle_per_rank(validate(build(p, m)), cost)
        assert max(idle) == pytest.approx(deepseek_idle(name, p, cost), abs=1e-9), name
        if "F&B" not in cost:              # no speed-up: every rank idles the same
            assert max(idle) - min(idle) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("cost", COSTS[1:3] + [{"F": 1.0, "B": 1.2, "W": 0.8, "F&B": 2.4}])
@pytest.mark.parametrize("p, m", [(4, 8), (6, 14), (8, 16)])
def test_the_reference_turn_beats_the_formula_when_b_exceeds_w(p, m, cost):
    """B > W: with every pair overlapped the op lists idle DeepSeek's formula exactly; the
    reference's order, whose turn rank runs its first steady F and B as two ops, idles less."""
    for name, build in (("dualpipe", dualpipe), ("dualpipev", dualpipev)):
        formula = deepseek_idle(name, p, cost)
        ref, joint = build(p, m), all_pairs_overlapped(build(p, m))
        assert sum(map(len, joint.overlap)) == sum(map(len, ref.overlap)) + (2 if name == "dualpipe" else 1)
        assert max(idle_per_rank(joint, cost)) == pytest.approx(formula, abs=1e-9), name
        assert max(idle_per_rank(ref, cost)) < formula - 0.1 * (cost["B"] - cost["W"]), name


def test_the_joint_start_of_an_overlapped_chunk_is_what_the_formula_counts():
    """Timed as two separate ops (overlap=False) the same DualPipe order idles less than
    DeepSeek's formula: an F&B chunk waits for both of its inputs."""
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}
    loose = max(idle_per_rank(dualpipe(8, 16), cost, overlap=False))
    joint = max(idle_per_rank(dualpipe(8, 16), cost))
    assert loose < joint == pytest.approx((8 / 2 - 1) * (3 + 2 - 3))


def test_dualpipe_needs_even_p_and_m_and_m_at_least_2p():
    for p, m in ((3, 6), (4, 9), (4, 6)):
        with pytest.raises(ValueError, match="dualpipe"):
            make_schedule("dualpipe", p, m)
    assert make_schedule("dualpipe", 4, 8).pipes[1][1] == range(4, 8)   # half per direction


CFG = LlamaConfig(hidden=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=16)


def param_bytes(modules) -> int:
    """Bytes of parameter storage the modules hold (a tensor counted once per rank)."""
    seen = {}
    for mod in modules:
        for prm in mod.parameters():
            seen[prm.data_ptr()] = prm.untyped_storage().nbytes()
    return sum(seen.values())


def test_dualpipe_holds_twice_the_parameters_dualpipev_once():
    p = 4
    per_rank = {}
    for name in ("1f1b", "dualpipe", "dualpipev"):
        model = TinyLlama(CFG)
        sched = make_schedule(name, p, 2 * p)
        stages = schedule_stages(model, sched)
        per_rank[name] = [param_bytes(stages[s] for s in sched.stages_of(r)) for r in range(p)]
    model_bytes = param_bytes([TinyLlama(CFG)])
    assert sum(per_rank["1f1b"]) == model_bytes
    assert sum(per_rank["dualpipe"]) == 2 * model_bytes
    assert sum(per_rank["dualpipev"]) == model_bytes
    # rank r holds stages r and p−1−r of 1F1B's cut
    one = per_rank["1f1b"]
    assert per_rank["dualpipe"] == [one[r] + one[p - 1 - r] for r in range(p)]
    assert torch.tensor(per_rank["dualpipe"]).float().mean() == 2 * torch.tensor(one).float().mean()
