"""Lesson 06's try-it: the work per rank it draws is the work a real ring computes."""
import pytest
import torch
import torch.distributed as dist

from picolib.context_parallel import ring_attention, shard_sequence
from picolib.launch import run
from picolib.tryit.lesson06 import score_grid, work_per_rank


def _ring_work(layout, seq):
    n, r = dist.get_world_size(), dist.get_rank()
    q = torch.randn(1, 2, seq, 4)
    k = v = torch.randn(1, 1, seq, 4)
    work = {}
    ring_attention(*(shard_sequence(t, layout, r, n, dim=2) for t in (q, k, v)), None, layout, work)
    return work["scores"]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_work_per_rank_is_what_the_ring_computes(layout):
    assert run(_ring_work, 4, layout, 32) == work_per_rank(4, layout, 32)


def test_score_grid_reports_the_imbalance():
    import matplotlib
    matplotlib.use("Agg")
    contiguous, zigzag = (score_grid(4, layout, 64) for layout in ("contiguous", "zigzag"))
    assert contiguous["ratio"] > 5 and zigzag["ratio"] == 1.0
    assert sum(contiguous["work"]) == sum(zigzag["work"]) == 64 * 65 // 2
    with pytest.raises(ValueError, match="layout must be one of"):
        score_grid(4, "striped")
    with pytest.raises(ValueError, match="must divide by 8"):
        work_per_rank(4, "zigzag", 36)


def test_the_hint_every_n_runs_and_the_ratios_are_as_it_says():
    """The try-it hint: with the knob's default length every N from 1 to 8 runs in both
    layouts; the contiguous busiest/idlest ratio grows like 2N−1 (14.9 at N = 8), zig-zag's
    stays 1."""
    import matplotlib
    import matplotlib.pyplot as plt
    matplotlib.use("Agg")
    contiguous = []
    for n in range(1, 9):
        zz = score_grid(n, "zigzag")
        co = score_grid(n, "contiguous")
        plt.close("all")
        assert zz["ratio"] == 1.0
        assert 0.97 * (2 * n - 1) <= co["ratio"] <= 2 * n - 1
        contiguous.append(co["ratio"])
    assert contiguous == sorted(contiguous) and round(contiguous[-1], 1) == 14.9
