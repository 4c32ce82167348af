"""Lesson 00's try-it function against what picolib's own rings put on the wire."""
import matplotlib
import pytest
import torch
import torch.distributed as dist

matplotlib.use("Agg")

from picolib import comm  # noqa: E402
from picolib.comm import Ledger  # noqa: E402
from picolib.launch import run  # noqa: E402
from picolib.tryit.lesson00 import ring_cost  # noqa: E402


def _measured_ring_bytes(numel):
    x = torch.ones(numel)
    with Ledger() as ledger:
        comm.ring_all_reduce(x.clone())
        shard = comm.ring_reduce_scatter(x.clone())
        comm.ring_all_gather(shard)
    return {r.op: r.sent_bytes for r in ledger.records}, dist.get_rank()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_per_rank_equal_the_bytes_picolibs_rings_send(n):
    numel = 12 * 5                                    # divides by 2, 3 and 4
    cost = ring_cost(n, numel * 4, plot=False)
    for sent, rank in run(_measured_ring_bytes, n, numel):
        for op in ("reduce_scatter", "all_gather", "all_reduce"):
            assert cost[op]["sent_bytes"] == sent[op], (op, n, rank)


def test_alpha_beta_time_splits_into_steps_and_bytes():
    c = ring_cost(8, 1e9, alpha_us=5.0, bandwidth_gbs=450.0, plot=False)
    assert c["all_reduce"]["steps"] == 14 and c["all_gather"]["steps"] == 7
    assert c["all_reduce"]["time_s"] == pytest.approx(14 * 5e-6 + 1.75e9 / 450e9)
    small = ring_cost(64, 1e3, plot=False)["all_reduce"]          # a tiny message is latency-bound
    assert small["latency_s"] > 100 * small["bandwidth_s"]


def test_one_rank_sends_nothing_and_bad_knobs_are_errors():
    assert all(v["sent_bytes"] == 0 and v["time_s"] == 0 for v in ring_cost(1, 1e6, plot=False).values())
    with pytest.raises(ValueError):
        ring_cost(0, 1e6, plot=False)


def test_draws_without_a_display():
    import matplotlib.pyplot as plt
    ring_cost(4, 1e6)
    plt.close("all")
