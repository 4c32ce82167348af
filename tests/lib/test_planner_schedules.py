"""The planner's step time against the pipeline simulator, schedule by schedule; the slowest
rank of an uneven split; DualPipe's two copies and DualPipeV's head; the bandwidth of a group
by how many of its GPUs share a node; the expert all-to-all's overlap and node-limited
routing; the roofline of a matmul; the runtime overhead (picolib/planner.py,
picolib/plan_search.py, picolib/hardware.py)."""
import dataclasses

import pytest

from picolib.hardware import ALPHA, GPUS, all_reduce_bandwidth
from picolib.model import LlamaConfig
from picolib.pipeline_schedules import make_schedule
from picolib.pipeline_simulator import simulate
from picolib.plan_search import matmul_seconds, step_time
from picolib.planner import (MoEShape, Parallelism, layer_numel, memory, rank_units, runtime_overhead,
                             stage_layers, traffic)

H100 = GPUS["H100-SXM"]
CFG = LlamaConfig(vocab_size=8, hidden=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=128)
SEQ, EFF = 64, 0.5
# the roofline with FLOPs alone: HBM without limit, no launch floor, no tiles, every matmul and the
# fused attention at EFF × the peak, links at their line rate
FLOPS_ONLY = dataclasses.replace(H100, hbm_bandwidth=float("inf"), launch=0.0, sms=0, matmul_eff=EFF,
                                 attention_eff=EFF, link_eff=1.0)


def costs_by_hand(cfg, par):
    """(F, B, W) seconds of each model piece, counted here from the shapes: 2 FLOPs per
    weight and token in each of F, B (input gradient), W (weight gradient); the causal
    attention core 2·s·h forward, 2.5 times that backward (the fused kernel's five matmuls to
    two); all at EFF × the dense peak."""
    rate, tokens, h = 989e12 * EFF, par.micro_batch_size * par.seq, cfg.hidden
    weights, attn = layer_numel(cfg) - 2 * h, 2 * par.seq * h
    pieces = stage_layers(cfg.n_layers, len(make_schedule(par.schedule, par.pp, par.micro_batches,
                                                          par.v).pipes[0][0]))
    out = []
    for i, n in enumerate(pieces):
        head = 2 * cfg.vocab_size * h if i == len(pieces) - 1 else 0
        out.append((tokens * (n * (2 * weights + attn) + head) / rate,
                    tokens * (n * (2 * weights + 2.5 * attn) + head) / rate,
                    tokens * (n * 2 * weights + head) / rate))
    return out


@pytest.mark.parametrize("name, v", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1),
                                     ("zb_greedy", 1), ("dualpipev", 2), ("dualpipe", 2)])
def test_step_time_is_the_simulated_schedule_with_each_stages_costs(name, v):
    par = Parallelism(pp=4, micro_batches=8, schedule=name, chunks=v, seq=SEQ)
    sched = make_schedule(name, 4, 8, v)
    pieces = costs_by_hand(CFG, par)
    send = ALPHA + SEQ * CFG.hidden * 2 / 450e9              # one activation over NVLink
    n = len(pieces)

    def cost(op):
        f, b, w = pieces[op.stage % n]
        c = {"F": f, "B": b, "W": w, "BW": b + w}[op.kind]
        out = (op.kind == "F" and not sched.is_last(op.stage)) or \
            (op.kind in ("B", "BW") and not sched.is_first(op.stage))
        return c + (send if out else 0.0)

    events = simulate(sched, cost=cost)
    ends = [max(e["end"] for e in events if e["rank"] == r) for r in range(4)]
    busy = [sum(e["end"] - e["start"] for e in events if e["rank"] == r) for r in range(4)]
    t = step_time(CFG, par, FLOPS_ONLY)
    assert t["seconds"] == pytest.approx(max(ends), rel=1e-9)
    for r in range(4):
        assert t["ranks"][r]["bubble"] == pytest.approx(max(ends) - busy[r], rel=1e-6, abs=1e-15)
    assert t["bubble"] > 0


def test_the_slowest_rank_of_an_uneven_split_sets_the_step():
    """10 layers on 4 stages: 2, 3, 3, 2. Ranks 1 and 2 carry 3 layers each; rank 0 (the one
    the planner used to price) only 2: the step is the slowest rank's."""
    cfg = dataclasses.replace(CFG, n_layers=10)
    assert stage_layers(10, 4) == [2, 3, 3, 2]
    par = Parallelism(pp=4, micro_batches=8, seq=SEQ)
    t = step_time(cfg, par, FLOPS_ONLY)
    c = [r["compute"] for r in t["ranks"]]
    assert c[1] == pytest.approx(c[0] * 3 / 2, rel=1e-12) and c[2] == pytest.approx(c[1], rel=1e-12)
    f, b, w = costs_by_hand(cfg, par)[1]
    assert t["seconds"] >= 8 * (f + b + w) > 8 * sum(costs_by_hand(cfg, par)[0])
    assert t["compute"] == max(c) and t["slowest"] in (1, 2)


def test_dualpipe_holds_two_copies_and_dualpipev_keeps_the_head_on_rank_0():
    ones = Parallelism(pp=4, micro_batches=8, seq=SEQ)
    for v in (1, 2):      # v = 1 used to raise IndexError
        dual = ones.replace(schedule="dualpipe", chunks=v)
        for r in range(4):   # rank r: pieces r and 3 − r, each a 1F1B stage
            assert sum(rank_units(CFG, dual, r)) == sum(rank_units(CFG, ones, r)) + \
                sum(rank_units(CFG, ones, 3 - r))
            assert memory(CFG, dual, r)["params"] == memory(CFG, ones, r)["params"] \
                + memory(CFG, ones, 3 - r)["params"]
    vee = ones.replace(schedule="dualpipev")
    h, voc = CFG.hidden, CFG.vocab_size
    assert rank_units(CFG, vee, 0)[0] == voc * h + h + voc * h        # embedding, norm, head
    assert len(rank_units(CFG, vee, 3)) == 2                             # two blocks, no root
    assert traffic(CFG, vee, 0)["pp"] > 0


def test_a_schedule_the_planner_cannot_price_is_refused():
    for bad in (dict(schedule="gpipe"), dict(schedule="dualpipe", pp=3, micro_batches=6),
                dict(schedule="dualpipev", micro_batches=4)):
        par = Parallelism(**{"pp": 4, "micro_batches": 8, "seq": SEQ, **bad})
        with pytest.raises(ValueError):
            step_time(CFG, par)


def test_group_bandwidth_follows_the_gpus_per_node():
    """The scaling book's per-level AllReduce bandwidth for whole nodes (node 450, leaf 400,
    spine 400 GB/s — `all_reduce_bandwidth`, its formula), and one GPU per node: one NIC."""
    for n in (8, 16, 256, 1024):
        assert H100.link(n) == all_reduce_bandwidth(H100, n) == (450e9 if n == 8 else 400e9)
    for n in (2, 32, 128):
        assert H100.link(n, stride=8) == 50e9 == H100.levels[1].per_gpu
    assert H100.link(8, stride=2) == 4 * 50e9          # 4 GPUs of each node: 4 NICs
    assert H100.link(4, stride=2) == 450e9             # still inside one node


def test_expert_all_to_all_overlap_and_node_limited_routing():
    """DeepSeek-like routing: 8 of 64 experts, ep = 64 over 8 nodes. Without a limit 8·7/8 = 7
    copies of a token leave its node; with tokens sent to at most 4 nodes (once per node),
    4·7/8 = 3.5. DualPipeV's F&B pairs hide the all-to-all behind the other direction."""
    cfg = LlamaConfig(vocab_size=1024, hidden=1024, n_layers=8, n_heads=8, n_kv_heads=8,
                      ffn_hidden=512)
    moe = MoEShape(n_experts=64, top_k=8, expert_ffn=512)
    par = Parallelism(dp=64, ep=64, pp=2, micro_batches=8, seq=4096, schedule="dualpipev")
    free = step_time(cfg, par, moe=moe, ep_overlap=0.0)
    hidden = step_time(cfg, par, moe=moe)
    assert hidden["ep"] < free["ep"] and hidden["seconds"] < free["seconds"]
    limited = step_time(cfg, par, moe=moe, ep_overlap=0.0, ep_nodes=4)
    nic, nvlink = H100.levels[1].per_gpu, H100.levels[0].per_gpu
    leaving = 8 * 63 / 64
    ratio = (3.5 / nic + leaving / nvlink) / (7 / nic + (leaving - 7) / nvlink)
    assert limited["ep"] == pytest.approx(free["ep"] * ratio, rel=1e-9)
    one_f = step_time(cfg, par.replace(schedule="1f1b"), moe=moe)
    assert one_f["ep"] == pytest.approx(free["ep"], rel=1e-9)      # nothing paired in 1F1B


def test_matmul_roofline():
    mamf = 792.1 / 989                                  # the H100's measured ceiling (Bekman's table)
    ridge = 989e12 * mamf / 3.35e12                     # FLOPs per byte where the two meet
    big, skinny = (8192, 8192, 8192), (16, 8192, 8192)
    assert matmul_seconds(*big) == pytest.approx(2 * 8192 ** 3 / 792.1e12)
    m, k, n = skinny
    assert 2 * m * k * n / (2 * (m * k + k * n + m * n)) < ridge
    assert matmul_seconds(*skinny) == pytest.approx(2 * (m * k + k * n + m * n) / 3.35e12)
    assert matmul_seconds(*big, ceiling=0.5) == pytest.approx(matmul_seconds(*big) * mamf / 0.5)
    assert matmul_seconds(*big, "A100-SXM") == pytest.approx(2 * 8192 ** 3 / 267.9e12)


def test_runtime_overhead_is_off_unless_asked_and_counts_its_parts():
    par = Parallelism(dp=8, tp=2, pp=4, micro_batches=8, seq=SEQ)
    plain, more = memory(CFG, par, 0), memory(CFG, par, 0, overhead=True)
    assert "overhead" not in plain
    tensors = plain["total"]
    assert more["overhead"] == int(0.3e9 + 3 * 0.2e9 + 0.05 * tensors)   # dp, tp, pp groups
    assert more["total"] == tensors + more["overhead"]
    assert runtime_overhead(par, 0, context=0, per_communicator=0, reserve=0) == 0


def test_dualpipe_sums_its_two_copies_gradients_over_the_mirror_rank():
    """Rank r and rank p−1−r hold the same two pieces: one 2-rank all-reduce of the rank's
    gradients (bf16: 2 bytes each; a 2-rank ring sends each byte once) on top of 1F1B's DP."""
    one = Parallelism(pp=4, micro_batches=8, seq=SEQ, dp=2)
    dual = one.replace(schedule="dualpipe")
    for r in range(4):
        psi = sum(rank_units(CFG, dual, r))
        own = 2 * 2 * (2 - 1) * psi // 2                       # DDP over dp = 2, bf16
        assert traffic(CFG, dual, r)["dp"] == own + 2 * psi


def test_a_matmul_runs_in_whole_waves_of_tiles():
    """The matmul guide's tile and wave quantization, on the A100's 108 SMs: a 256 × 128 tile more
    than a whole wave costs a whole second wave; a partial tile at an edge costs a whole tile; the
    tiles of a batched kernel fill the waves together; without SMs the FLOPs alone."""
    from picolib.hardware import hardware
    from picolib.layer_costs import matmul_compute_seconds
    a100 = hardware("A100-SXM")
    peak, k = a100.bf16, 4096
    one_tile = 2 * 256 * 128 * k / (peak * a100.matmul_eff / a100.sms)       # one SM's tile
    wave = 108 * 256                                                            # 108 tiles of 256 rows
    assert matmul_compute_seconds(wave, k, 128, a100, peak) == pytest.approx(one_tile, rel=1e-12)
    assert matmul_compute_seconds(wave + 256, k, 128, a100, peak) == pytest.approx(2 * one_tile, rel=1e-12)
    assert matmul_compute_seconds(wave - 255, k, 128, a100, peak) == pytest.approx(one_tile, rel=1e-12)
    assert matmul_compute_seconds(256, k, 128, a100, peak, count=108) == pytest.approx(one_tile, rel=1e-12)
    # a planted wrong model, the FLOPs alone, misses the second wave
    flops_only = dataclasses.replace(a100, sms=0)
    assert matmul_compute_seconds(wave + 256, k, 128, flops_only, peak) < 1.01 * one_tile
    # the better tile shape: 128 × 256 fits a 128-row, 108·256-column output in one wave
    assert matmul_compute_seconds(128, k, wave, a100, peak) == pytest.approx(one_tile, rel=1e-12)
