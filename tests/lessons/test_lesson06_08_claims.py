"""What lessons 06 and 08 now state about cost, checked against independent counts.

Lesson 06: `ring_step_cost` (the FLOPs of a zig-zag ring step and the bytes of its hop)
against PyTorch's FlopCounterMode and the ledger on real ranks, at shapes other than the
lesson's; the condition hop < step at its boundary; and the emulated figure's overlap as a
consequence of the costs it picks (a longer hop shows).
Lesson 08: `token_flops` (a token's matmul FLOPs, split into the part every token pays and
the context's) against FlopCounterMode on a K/V-cached block, and its GPT-3 175B figure
against the c/(6h) approximation.
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from picolib.comm import Ledger
from picolib.context_parallel import ring_attention, ring_step_cost, shard_sequence
from picolib.launch import run
from picolib.model import LlamaConfig
from picolib.terapipe_slicer import token_flops
from picolib.timeline import Timeline, merge


def _ring_counts(seq, heads, kv_heads, d):
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, d, generator=g) for h in (heads, kv_heads, kv_heads))
    local = [shard_sequence(t, "zigzag", r, n, dim=2).requires_grad_() for t in (q, k, v)]
    with Ledger() as led, FlopCounterMode(display=False) as fwd:
        out = ring_attention(*local, None, "zigzag")
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops(), [x.sent_bytes for x in led.select("send")]


@pytest.mark.parametrize("n, seq, heads, kv_heads, d", [(2, 64, 4, 2, 16), (4, 128, 4, 1, 8)])
def test_ring_step_cost_is_what_the_ranks_run(n, seq, heads, kv_heads, d):
    cost = ring_step_cost(seq, n, heads, kv_heads, d, flops=1.0, link=1.0, dtype_bytes=4)
    for fwd, bwd, hops in run(_ring_counts, n, seq, heads, kv_heads, d):
        # a zig-zag rank runs 2N+1 whole blocks: (2N+1)/2 steps of two blocks each
        assert fwd == cost["fwd_flops"] * (2 * n + 1) / 2
        assert bwd == cost["bwd_flops"] * (2 * n + 1) / 2
        assert hops == [cost["hop_bytes"]] * (n - 1)


def test_the_hop_hides_exactly_above_the_threshold():
    args = dict(n_heads=64, n_kv_heads=8, head_dim=128, flops=989e12, link=50e9)
    edge = ring_step_cost(131072, 16, **args)["min_tokens_per_rank"]
    assert edge == pytest.approx(4945)
    above = ring_step_cost(5120 * 16, 16, **args)      # 5,120 tokens per rank
    below = ring_step_cost(4608 * 16, 16, **args)      # 4,608
    assert above["fwd_hidden"] and not below["fwd_hidden"]
    ratio = lambda c: c["fwd_hop_s"] / c["fwd_compute_s"]
    assert ratio(ring_step_cost(131072, 16, tp=8, **args)) == pytest.approx(ratio(ring_step_cost(131072, 16, **args)))
    with pytest.raises(ValueError, match="must divide by 32"):
        ring_step_cost(1000, 16, **args)


def _timeline(kv_cost):
    n, r = dist.get_world_size(), dist.get_rank()
    q = torch.randn(1, 2, 64, 8)
    k = v = torch.randn(1, 1, 64, 8)
    tl = Timeline(emulate={"attn": 0.2, "kv": kv_cost})
    dist.barrier()
    ring_attention(*(shard_sequence(t, "zigzag", r, n, dim=2) for t in (q, k, v)), None, "zigzag",
                   timeline=tl)
    return tl.events


def test_the_emulated_overlap_follows_from_the_chosen_costs():
    """Lesson 06 §7: a hop of 0.08 s hides behind a 0.1 s zig-zag step; one of 0.15 s shows."""
    spans = {}
    for kv in (0.08, 0.15):
        ev = merge(run(_timeline, 4, kv))
        end = max(e["end"] for e in ev) - min(e["start"] for e in ev)
        compute = max(sum(e["end"] - e["start"] for e in ev if e["rank"] == r and e["name"] == "attn")
                      for r in range(4))
        spans[kv] = end - compute               # time not covered by this rank's compute
    assert spans[0.08] < 0.5 * 0.08 * 3        # three hops, mostly hidden
    assert spans[0.15] > 0.1                   # ≈ 3 × (0.15 − 0.1) = 0.15 s shows


def _counted(cfg, context):
    from picolib.tryit.lesson08 import counted_token_flops
    return counted_token_flops(cfg, context)


@pytest.mark.parametrize("cfg", [LlamaConfig(hidden=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq=256),
                                 LlamaConfig(hidden=48, n_layers=1, n_heads=6, n_kv_heads=6, ffn_hidden=80, max_seq=256)])
def test_token_flops_is_what_flop_counter_counts(cfg):
    for context in (0, 1, 100, 255):
        want = token_flops(cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, keys=context + 1)
        assert _counted(cfg, context) == want["total"]


def test_gpt3_context_share_is_about_c_over_6h():
    h = 12288
    x = token_flops(h, 96, 96, 4 * h, keys=2048, gated=False)
    assert x["linear"] == 24 * h * h                          # 12h² weights, 2 FLOPs each
    assert x["context_share"] == pytest.approx(2048 / (6 * h), rel=0.03)
    assert x["context_share"] < 2048 / (6 * h)
    with pytest.raises(ValueError):
        token_flops(100, 3, 3, 400, keys=1)


def test_slices_send_the_same_bytes_in_more_messages():
    """Lesson 08 §3 at other shapes: 2 and 3 stages, batch 2, ragged slices — a stage boundary
    carries b·s·h·4 bytes forward whatever the cut, one message per slice; the activations a
    stage saves change little with the cut (here slightly more: each slice's attention keeps its
    K/V context again, and its smaller score matrix saves less than at the lesson's shape) —
    nowhere near the "more than 2×" of the walk-through, and the same whatever the stages."""
    from picolib.tryit.lesson08 import boundary_traffic
    cfg = LlamaConfig(hidden=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=96)
    seq, b = 96, 2
    cuts = {"one": (seq,), "ragged": (40, 24, 16, 8, 8)}
    for n_stages in (2, 3):
        out = run(boundary_traffic, n_stages, cuts, cfg, n_stages, seq, b)
        for r, t in enumerate(out[:-1]):
            assert t["one"]["fwd_sent"] == t["ragged"]["fwd_sent"] == b * seq * cfg.hidden * 4
            assert t["ragged"]["sends"] == 5 * t["one"]["sends"]
            assert 0.5 < t["ragged"]["saved_peak"] / t["one"]["saved_peak"] < 1.25
        assert out[-1]["one"]["fwd_sent"] == 0                  # the last stage sends only gradients back
