"""Every planner formula against numbers worked out by hand in the test (from the spec
sheets' link counts and the model's shape, not by calling the formula), and the errors
for bad input (picolib/hardware.py, picolib/planner.py, picolib/plan_search.py)."""
import math

import pytest

from picolib.hardware import (GPUS, Hardware, all_reduce_bandwidth, critical_tokens_dp,
                              critical_tokens_moe, hardware, hierarchical_all_reduce_time,
                              max_tp_degree, pp_min_stage_params, ring_time,
                              sharp_all_reduce_time, tp_ffn_threshold, tree_all_reduce_time)
from picolib.model import LlamaConfig
from picolib.plan_search import active_params, describe, search, step_time, tp_comm_ratio
from picolib.planner import (LLAMA3_70B, LLAMA3_405B, MoEShape, Parallelism, in_flight, layer_numel,
                             memory, rank_units, stage_layers, traffic)

H100 = GPUS["H100-SXM"]


def test_presets_state_dense_peaks_and_the_superpod_links():
    assert (H100.bf16, H100.fp8, H100.memory) == (989e12, 1979e12, 80e9)
    assert GPUS["H200-SXM"].memory == 141e9 and GPUS["H200-SXM"].bf16 == 989e12
    gb = GPUS["GB200-NVL72"]
    assert (gb.bf16, gb.fp8, gb.node) == (180e15 / 72, 360e15 / 72, 72)   # rack totals / 72
    # node: 18 NVLink-4 links of 25 GB/s per GPU, 8 GPUs; leaf: 8 switches × 64 ports × 25 GB/s
    assert [lv.total for lv in H100.levels] == [8 * 18 * 25e9, 8 * 64 * 25e9, 16 * 64 * 25e9]
    # a group over whole nodes: each node's 8 NICs (8 × 50 GB/s), under NVLink's 450; a group
    # with one GPU per node: that GPU's one NIC
    assert H100.link(8) == 450e9 and H100.link(16) == 8 * 50e9 and H100.link(2, stride=8) == 50e9


def test_collective_times_by_hand():
    b, w, a = 1e9, 450e9, 5e-6
    assert ring_time("all_reduce", b, 8, w, alpha=0) == pytest.approx(2 * 7 / 8 * b / w)
    assert ring_time("all_gather", b, 8, w, alpha=a) == pytest.approx(7 * a + 7 / 8 * b / w)
    assert tree_all_reduce_time(b, 16, w, alpha=a) == pytest.approx(2 * 4 * a + 2 * b / w)
    assert sharp_all_reduce_time(b, 8, w, alpha=0) == pytest.approx(b / w)
    # the ring's bytes over SHARP's on 8 GPUs: 1.75 (lesson 00's measured ratio)
    assert ring_time("all_reduce", b, 8, w, 0) / sharp_all_reduce_time(b, 8, w, 0) == pytest.approx(1.75)
    assert ring_time("all_reduce", b, 1, w) == 0 and sharp_all_reduce_time(b, 1, w) == 0


def test_hierarchical_all_reduce_is_set_by_the_leaf():
    assert all_reduce_bandwidth(H100, 8) == pytest.approx(3.6e12 / 8)
    leaf = 8 * 64 * 25e9 / 32                     # 8 leaf switches shared by 32 nodes
    assert all_reduce_bandwidth(H100, 1024) == pytest.approx(leaf) == pytest.approx(400e9)
    assert hierarchical_all_reduce_time(4e9, H100, 1024) == pytest.approx(4e9 / 400e9)
    # 64-way model parallelism inside: the leaf carries 1/8 of the bytes per GPU pair
    assert all_reduce_bandwidth(H100, 32, inner=64) == pytest.approx(64 * 12.8e12 / 256)


def test_critical_batches_of_the_source_and_its_corrections():
    assert critical_tokens_dp(H100, 8) == pytest.approx(989e12 / (2 * 450e9))       # ≈ 1,099
    assert round(critical_tokens_dp(H100, 1024)) == round(989e12 / 800e9) == 1236
    assert critical_tokens_dp(H100, 1024, fsdp=True) == pytest.approx(989e12 / 400e9)  # ≈ 2,472
    # DeepSeek-like MoE: 256 experts, 8 active, 64-way EP across 8 nodes: 1236.25·256/8/8
    assert critical_tokens_moe(H100, 32, 256, 8, ep=64) == pytest.approx(989e12 / 800e9 * 256 / 8 / 8)
    assert tp_ffn_threshold(H100, 8) == pytest.approx(989e12 * 7 / (8 * 450e9))      # ≈ 1,923
    published = Hardware("898", 898e12, 898e12, 80e9, 1, H100.levels)
    assert round(tp_ffn_threshold(published, 8)) == 1746
    assert max_tp_degree(H100, 16384) == 8 and 16384 / 1923 < 9
    assert max_tp_degree(H100, 8192) == 4            # 8192/1923 = 4.3; 8192/1648 (Y=4 → 3/4) = 4.97
    # GB200: twice the bandwidth but 2.5× the FLOPs: the DP bound rises, it does not halve
    assert critical_tokens_dp("GB200-NVL72", 72) == pytest.approx(2.5e15 / (2 * 900e9))
    assert pp_min_stage_params(H100, 8192) == pytest.approx(4 * 8192 * 989e12 / (6 * 50e9))


def test_llama3_70b_shapes_and_lesson_05_activations():
    h, f, kv, d = 8192, 28672, 8, 128
    assert layer_numel(LLAMA3_70B, 8) == 2 * h * h // 8 + 2 * h * 1 * d + 3 * h * f // 8 + 2 * h
    block = 2 * h * h + 2 * h * kv * d + 3 * h * f + 2 * h
    assert sum(rank_units(LLAMA3_70B, Parallelism())) == 2 * 128256 * h + h + 80 * block
    # TP8+SP, 4k tokens, PP4 (20 layers a stage), 1F1B: stage 0 holds 4 micro-batches of
    # 20 × 34·s·h/8 bytes (lesson 05: 4 × 2.85 = 11.4 GB)
    par = Parallelism(tp=8, sp=True, pp=4, micro_batches=8, dp=20, zero=1)
    assert memory(LLAMA3_70B, par, pp_rank=0)["activations"] == 4 * 20 * 34 * 4096 * h // 8
    mem = memory(LLAMA3_70B, par, pp_rank=1)
    padded = -(-layer_numel(LLAMA3_70B, 8) // 20) * 20     # ZeRO pads each block for 20 ranks
    assert (mem["params"], mem["grads"]) == (2 * 20 * padded, 2 * 20 * padded)
    assert mem["optimizer"] == (4 + 8) * 20 * padded // 20  # fp32 master + Adam, 1/20 each


def test_zero2_accumulating_holds_whole_gradients():
    psi = sum(rank_units(LLAMA3_70B, Parallelism(tp=8)))
    padded = sum(-(-u // 16) * 16 for u in rank_units(LLAMA3_70B, Parallelism(tp=8)))
    one = memory(LLAMA3_70B, Parallelism(tp=8, dp=16, zero=2))
    four = memory(LLAMA3_70B, Parallelism(tp=8, dp=16, zero=2, micro_batches=4))
    assert one["grads"] == 2 * padded // 16 and four["grads"] == 2 * psi + 2 * padded // 16


def test_stage_layers_and_in_flight():
    assert stage_layers(80, 4) == [20] * 4
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]          # Llama 3 405B's split
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]                 # p − r on rank r
    assert in_flight("afab", 4, 3) == [3, 3, 3, 3]                 # all m
    assert in_flight("1f1b", 4, 2) == [2, 2, 2, 1]                 # never more than m


def test_traffic_by_hand():
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    par = Parallelism(pp=4, micro_batches=8, micro_batch_size=2, seq=16, precision="fp32")
    act = 2 * 16 * 32 * 4
    assert [traffic(cfg, par, r)["pp"] for r in range(4)] == [8 * act, 16 * act, 16 * act, 8 * act]
    psi = sum(rank_units(cfg, Parallelism()))
    dp = Parallelism(dp=4, precision="fp32")
    assert traffic(cfg, dp)["dp"] == 2 * 3 * psi * 4 // 4              # ring all-reduce, fp32
    assert traffic(cfg, dp.replace(zero=3))["dp"] == 3 * 3 * psi * 4 // 4   # psi divides by 4
    tp = Parallelism(tp=2, seq=16, micro_batch_size=2)                  # bf16 activations
    x = 2 * 16 * 32 * 2
    loss = 3 * 2 * (2 * 16 * 4) // 2
    assert traffic(cfg, tp)["tp"] == (4 * 4 + 2) * (2 * x // 2) + loss
    moe = MoEShape(n_experts=8, top_k=2, expert_ffn=16)
    ep = Parallelism(dp=4, ep=4, seq=16, micro_batch_size=2)
    # 4 layers × (dispatch, combine) × (forward, backward) of k·tokens·h·2 bytes, 3/4 leaving;
    # plus each forward's counts: 3 other ranks × 2 local experts × 8 bytes, 4 layers
    assert traffic(cfg, ep, moe=moe)["ep"] == 4 * 4 * 2 * (2 * 16) * 32 * 2 * 3 // 4 + 4 * 3 * 2 * 8


def test_tp_comm_ratio_agrees_with_the_planners_bytes_and_its_assumptions():
    """The one TP-cost function (lessons 05, 10, 11) sends what the planner's traffic counts for
    one layer (TP: 4 all-reduces; TP+SP: 10 units), and each assumption moves it as stated."""
    import dataclasses
    hw = GPUS["H100-SXM"]
    for sp, units in ((False, 8), (True, 10)):
        par = Parallelism(tp=8, sp=sp, seq=4096, precision="bf16")
        two, three = (dataclasses.replace(LLAMA3_70B, n_layers=n) for n in (2, 3))
        one_layer = traffic(three, par)["tp"] - traffic(two, par)["tp"]
        norms = 2 * 2 * (8 - 1) / 8 * LLAMA3_70B.hidden * 2 if sp else 0   # SP's two norm all-reduces
        r = tp_comm_ratio(LLAMA3_70B, 8, hw, collectives=units)
        assert r["comm_per_token"] * 4096 * hw.link(8) == pytest.approx(one_layer - norms, rel=1e-9)
        assert r["compute_per_token"] * 4096 == pytest.approx(
            6 * layer_numel(LLAMA3_70B) * 4096 / 8 / hw.bf16, rel=1e-12)
    base = tp_comm_ratio(LLAMA3_70B, 8, hw)["ratio"]
    assert tp_comm_ratio(LLAMA3_70B, 8, hw, flops=hw.bf16 / 2)["ratio"] == pytest.approx(base / 2)
    assert tp_comm_ratio(LLAMA3_70B, 8, hw, overlap=0.75)["ratio"] == pytest.approx(base / 4)
    # across two whole nodes: 16 ranks share 8 NICs a node (400 GB/s), each computes half as much
    tp16 = tp_comm_ratio(LLAMA3_70B, 16, hw)["ratio"]
    assert tp16 == pytest.approx(base * (15 / 16 / 400e9) / (7 / 8 / 450e9) * 2, rel=1e-12)
    with pytest.raises(ValueError, match="tp must be at least 2"):
        tp_comm_ratio(LLAMA3_70B, 1, hw)


def test_step_time_without_communication_is_the_flops_at_the_rates_given():
    """One GPU on a roofline of FLOPs alone (HBM without limit, no launch floor, no tiles),
    every matmul and the fused attention at 0.5 × peak: the compute is the FLOPs counted by hand
    from the shapes (no embedding FLOPs: it is a lookup; attention's backward 2.5× its forward)."""
    import dataclasses
    flops_only = dataclasses.replace(GPUS["H100-SXM"], hbm_bandwidth=math.inf, launch=0.0, sms=0,
                                     matmul_eff=0.5, attention_eff=0.5)
    cfg, s, m = LLAMA3_70B, 4096, 4
    t = step_time(cfg, Parallelism(seq=s, micro_batches=m), flops_only)
    h, L = cfg.hidden, cfg.n_layers
    matmul = L * (layer_numel(cfg) - 2 * h) + cfg.vocab_size * h           # weights a token meets
    attn = 2 * 2 * s * h / 2                                              # QKᵀ and ·V, causal half
    forward = (2 * matmul + L * attn) * m * s
    flops = forward + (4 * matmul + 2.5 * L * attn) * m * s               # + input and weight gradients
    assert t["compute"] == pytest.approx(flops / (989e12 * 0.5), rel=1e-12) and t["bubble"] == 0
    model = (6 * (active_params(cfg) - cfg.vocab_size * h) + 3 * L * attn) * m * s  # MFU's
    assert t["mfu"] == pytest.approx(model / (t["seconds"] * 989e12), rel=1e-12)
    assert t["mfu"] == pytest.approx(0.5 * model / flops, rel=1e-12)
    full = step_time(cfg, Parallelism(seq=s, micro_batches=m, recompute="full"), flops_only)
    # full recomputation runs each forward twice: F + (F + B) + W
    assert full["compute"] == pytest.approx(t["compute"] + forward / (989e12 * 0.5), rel=1e-12)
    # a pipeline of 4 equal stages (a tiny head), 1F1B: the bubble is (p−1)/m of the compute
    small = dataclasses.replace(cfg, vocab_size=8)
    piped = step_time(small, Parallelism(pp=4, micro_batches=8, seq=s), flops_only)
    assert piped["bubble"] == pytest.approx(piped["compute"] * 3 / 8, rel=1e-3)


def test_search_finds_plans_that_fit_fastest_first():
    found = search(LLAMA3_405B, 16384, 2048, 8192, top=3, usable=0.4)
    assert found and all(r["memory"]["total"] <= 0.4 * 80e9 for r in found)
    times = [r["time"]["seconds"] for r in found]
    assert times == sorted(times)
    whole = search(LLAMA3_405B, 16384, 2048, 8192, top=1)[0]   # the whole GPU, runtime overhead counted
    mem = whole["memory"]
    assert 0.4 * 80e9 < mem["total"] <= 80e9 and mem["overhead"] > 0.3e9
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert whole["time"]["seconds"] < times[0]
    best = whole["par"]
    assert f"TP{best.tp}+SP PP{best.pp}" in describe(LLAMA3_405B, best)
    # Llama 3's reported layout (TP8 PP16 DP128, 1F1B, ZeRO-1) does not fit 80 GB in this
    # count: its busiest rank is rank 1 (8 layers × 15 micro-batches in flight), not rank 0
    # (7 layers × 16), which the planner used to price
    llama = Parallelism(dp=128, tp=8, pp=16, sp=True, zero=1, micro_batches=16, seq=8192)
    ranks = [memory(LLAMA3_405B, llama, r)["total"] for r in range(16)]
    assert max(ranks) == ranks[1] > 80e9 > ranks[0]
    assert search(LLAMA3_405B, 8, 8, 8192) == []               # 405B on one node: nothing fits


@pytest.mark.parametrize("call, message", [
    (lambda: hardware("H300"), "unknown hardware 'H300'"),
    (lambda: memory(LLAMA3_70B, Parallelism(tp=3)), "tp=3 must divide n_heads=64"),
    (lambda: memory(LLAMA3_70B, Parallelism(tp=16, dp=4, ep=3), moe=MoEShape(8, 2, 64)),
     "n_experts=8 does not divide by the ep size 3"),
    (lambda: memory(LLAMA3_70B, Parallelism(dp=0)), "dp must be a positive integer, not 0"),
    (lambda: memory(LLAMA3_70B, Parallelism(seq=-4)), "seq must be a positive integer, not -4"),
    (lambda: memory(LLAMA3_70B, Parallelism(zero=4)), "zero must be 0"),
    (lambda: memory(LLAMA3_70B, Parallelism(zero=3, pp=2, micro_batches=2)), "ZeRO-3 × pipeline parallelism is not supported"),
    (lambda: memory(LLAMA3_70B, Parallelism(pp=100)), "fewer than the 100 pipeline stages"),
    (lambda: memory(LLAMA3_70B, Parallelism(tp=8, sp=True, seq=4100)), "seq=4100/cp=1 tokens must divide by tp=8"),
    (lambda: memory(LLAMA3_70B, Parallelism(ep=2, dp=2)), "ep=2 spreads experts"),
    (lambda: memory(LLAMA3_70B, Parallelism(precision="fp16")), "precision must be"),
    (lambda: memory(LLAMA3_70B, Parallelism(pp=4, schedule="interleaved", chunks=2, micro_batches=6)),
     "multiple of p"),
    (lambda: ring_time("all_reduce", -1, 8, 450e9), "nbytes=-1"),
    (lambda: ring_time("all_reduce", 1, 8, 0), "bandwidth=0"),
    (lambda: search(LLAMA3_70B, 0, 8, 4096), "must be positive"),
    (lambda: step_time(LLAMA3_70B, Parallelism(), ceiling=0), "ceiling must be in (0, 1]"),
])
def test_bad_input_names_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=re_escape(message)):
        call()


def re_escape(s):
    import re
    return re.escape(s)


def test_numbers_are_finite_for_every_preset():
    for name in GPUS:
        assert math.isfinite(critical_tokens_dp(name, 4096)) and tp_ffn_threshold(name, 8) > 0


def test_h800_preset_is_the_deepseek_v3_report_links():
    """DeepSeek-V3's H800s: NVLink 160 GB/s effective and IB 50 GB/s (its technical report),
    the H100's dense peaks. Its DP bound in a node rises with the slower NVLink; the MoE bound
    with EP spanning nodes is the NICs', the same as on an H100."""
    from picolib.hardware import GPUS, critical_tokens_dp, critical_tokens_moe
    h800, h100 = GPUS["H800"], GPUS["H100-SXM"]
    assert (h800.bf16, h800.levels[0].per_gpu, h800.levels[1].per_gpu) == (h100.bf16, 160e9, 50e9)
    assert critical_tokens_dp(h800, 8) == pytest.approx(critical_tokens_dp(h100, 8) * 450 / 160)
    assert critical_tokens_moe(h800, 2, 256, 8, ep=64) == critical_tokens_moe(h100, 2, 256, 8, ep=64)


def test_search_with_llamas_activations_starts_at_selective():
    """activations="picolib": every result counts Llama's block with the scores recomputed
    (never eager "none"), and each fits the budget it was given."""
    found = search(LLAMA3_70B, 640, global_batch=320, seq=4096, top=3, activations="picolib")
    assert found and all(r["par"].activations == "picolib" and r["par"].recompute != "none"
                         and r["memory"]["total"] <= 0.9 * 80e9 for r in found)
    default = search(LLAMA3_70B, 640, global_batch=320, seq=4096, top=1)
    assert default[0]["par"].activations == "korthikanti"
    assert found[0]["memory"]["activations"] > default[0]["memory"]["activations"]
