"""Claims of lessons 00 and 02 that rest on library functions: the SuperPod's levels from its
links (the book's switch figure and InfiniBand's), a hierarchical all-reduce of rings level
by level (against bytes counted on picolib's rings), and how picolib's bucket rule differs
from the function PyTorch's DDP calls."""
import random

import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.comm import Ledger
from picolib.data_parallel import assign_buckets
from picolib.hardware import (GPUS, Hardware, Level, all_reduce_bandwidth, ring_all_reduce_levels,
                              ring_time, superpod_levels)
from picolib.launch import run


def test_the_books_switch_figure_gives_the_preset_and_infiniband_switches_a_non_blocking_spine():
    # the preset is the scaling book's pod: 450 GB/s per GPU in a node (NVLink 4's 900 GB/s
    # counts both directions, H100 datasheet), a 50 GB/s NIC (ConnectX-7, 400 Gb/s) to the
    # leaf, and a spine of 16 switches at NVSwitch's 1.6 TB/s for 1,024 GPUs: 25 GB/s each
    assert [lv.per_gpu for lv in GPUS["H100-SXM"].levels] == [450e9, 50e9, 16 * 1.6e12 / 1024]
    assert superpod_levels(ib_switch=64 * 25e9) == GPUS["H100-SXM"].levels
    node, leaf, spine = superpod_levels()
    assert (node.per_gpu, leaf.per_gpu, spine.per_gpu) == (450e9, 50e9, 50e9)
    assert spine.total == 2 * GPUS["H100-SXM"].levels[2].total
    # the leaf sets the book's one-pass figure either way
    h = Hardware("ib", 1, 1, 1, 1, superpod_levels())
    assert all_reduce_bandwidth(h, 256) == all_reduce_bandwidth("H100-SXM", 256) == 400e9


def test_ring_levels_pay_the_ring_factor_at_every_level():
    b = 2**30
    lv = ring_all_reduce_levels(b, "H100-SXM", 256)
    assert list(lv) == ["node", "leaf"] and lv["leaf"]["members"] == 32
    assert lv["node"]["seconds"] == pytest.approx(ring_time("all_reduce", b, 8, 450e9, alpha=0))
    assert lv["leaf"]["seconds"] == pytest.approx(2 * 31 / 32 * (b / 8) / 50e9)
    assert ring_all_reduce_levels(b, "H100-SXM", 1) == {}
    assert ring_all_reduce_levels(b, "H100-SXM", 4)["node"]["members"] == 4
    with pytest.raises(ValueError):
        ring_all_reduce_levels(b, "H100-SXM", 12)        # 12 GPUs: not whole nodes


def _two_level(per_node, numel):
    me, n = dist.get_rank(), dist.get_world_size()
    node = [dist.new_group(list(range(k, k + per_node))) for k in range(0, n, per_node)][me // per_node]
    across = [dist.new_group(list(range(j, n, per_node))) for j in range(per_node)][me % per_node]
    with Ledger() as led:
        shard = comm.ring_reduce_scatter(torch.ones(numel), group=node)
        comm.ring_all_reduce(shard, group=across)
        comm.ring_all_gather(shard, group=node)
    s = {r.op: r.sent_bytes for r in led.records}
    return {"node": s["reduce_scatter"] + s["all_gather"], "leaf": s["all_reduce"]}


@pytest.mark.parametrize("n, per_node", [(4, 2), (6, 3)])
def test_ring_levels_bytes_equal_a_real_hierarchical_all_reduce(n, per_node):
    numel = 12 * 4
    hw = Hardware("toy", 1, 1, 1, 1, (Level("node", per_node, 1.0, per_node), Level("leaf", n, 1.0, n)))
    want = {k: v["sent_bytes"] for k, v in ring_all_reduce_levels(numel * 4, hw, n).items()}
    assert all(got == want for got in run(_two_level, n, per_node, numel))


def test_pytorch_closes_a_bucket_after_the_cap_picolib_before():
    rng = random.Random(0)
    for _ in range(20):
        sizes = [4 * rng.randint(1, 300) for _ in range(rng.randint(2, 30))]
        cap = 4 * rng.randint(50, 600)
        theirs, _ = dist._compute_bucket_assignment_by_size(
            [torch.empty(s // 4) for s in sizes], [cap], [False] * len(sizes))
        ours = assign_buckets(sizes, cap)
        tot = lambda g: sum(sizes[i] for i in g)
        assert all(tot(g) <= cap or len(g) == 1 for g in ours)
        assert all(tot(g) >= cap for g in theirs[:-1])
        assert all(tot(g) - sizes[g[-1]] < cap for g in theirs)
        assert len(theirs) <= len(ours)


def test_averaging_through_a_root_sends_n_over_2_times_a_ring_ranks_bytes():
    """Lesson 02's nn.DataParallel aside: rank 0 sends (N-1)·bytes through a root; a ring
    rank sends 2(N-1)/N·bytes (counted on picolib's ring) — N/2 times less, on every rank."""
    from picolib.tryit.lesson02 import through_root_vs_ring
    numel = 1000
    for n in (2, 4):
        out = run(through_root_vs_ring, n, numel)
        assert all(o["root"]["result"] == o["ring"]["result"] == n * (n + 1) / 2 for o in out)
        root, ring = out[0]["root"]["sent"], out[0]["ring"]["sent"]
        assert root == out[0]["root"]["received"] == (n - 1) * 4 * numel
        assert ring * n == root * 2                      # N/2 times less than the root
