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
    before = set(plt.get_fignums())
    ring_cost(4, 1e6)
    (fig,) = [plt.figure(n) for n in set(plt.get_fignums()) - before]
    traffic, time = fig.axes[:2]
    heights = [p.get_height() for p in traffic.patches]       # bytes per rank / B, per collective
    assert sorted(heights) == pytest.approx([3 / 4, 3 / 4, 2 * 3 / 4])  # (N−1)/N twice, 2(N−1)/N
    assert len(time.patches) == 2 * len(heights)             # latency and bandwidth, stacked
    plt.close("all")


@pytest.mark.parametrize("n", [3, 5])
def test_the_recorded_ring_sends_one_chunk_a_step_and_ends_with_every_sum(n):
    """The lesson's step-by-step figure rests on this record: a chunk index read from the
    sent view, the ranks its value holds, and bytes that add up to the Ledger's count."""
    from picolib.tryit.lesson00 import ranks_in, record_ring_steps
    for rec in run(record_ring_steps, n, 2):
        r, steps = rec["rank"], rec["steps"]
        assert [s["chunk"] for s in steps[:n - 1]] == [(r - k - 1) % n for k in range(n - 1)]
        assert [len(ranks_in(s["value"])) for s in steps] == list(range(1, n)) + [n] * (n - 1)
        assert sum(s["bytes"] for s in steps) == rec["ledger_bytes"] == 2 * (n - 1) * 2 * 4
        assert rec["final"].tolist() == [2 ** n - 1] * n


def test_drawing_helpers_fill_every_panel():
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    from picolib.tryit.lesson00 import draw_ring_steps, record_ring_steps
    fig, axes = plt.subplots(2, 4, figsize=(12, 5.6))
    draw_ring_steps(run(record_ring_steps, 4), axes.flat)
    fig.suptitle("ring")
    assert problems(fig) == []
    plt.close("all")


@pytest.mark.parametrize("n", [2, 4])
def test_the_fit_recovers_alpha_and_beta_from_exact_ring_times(n):
    from picolib.tryit.lesson00 import fit_alpha_beta
    alpha, beta = 40e-6, 2e9
    seconds = {numel: 2 * (n - 1) * alpha + comm.ring_sent_bytes("all_reduce", 4 * numel, n) / beta
               for numel in (4096, 65536, 1048576)}
    got_alpha, per_byte = fit_alpha_beta(seconds, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and 1 / per_byte == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta({4096: 1e-3}, n)                       # one size cannot separate α from β


def test_the_fit_weighs_small_buffers_and_never_returns_a_negative_latency():
    from picolib.tryit.lesson00 import fit_alpha_beta
    alpha, beta = 40e-6, 2e9
    exact = {numel: 2 * alpha + comm.ring_sent_bytes("all_reduce", 4 * numel, 2) / beta
             for numel in (4096, 65536, 1048576, 4194304)}
    noisy = {**exact, 4194304: exact[4194304] * 1.05}     # 5 % noise on the largest buffer only
    got_alpha, _ = fit_alpha_beta(noisy)
    assert got_alpha == pytest.approx(alpha, rel=0.3)     # an unweighted fit is off by far more
    no_latency = {numel: comm.ring_sent_bytes("all_reduce", 4 * numel, 2) / beta for numel in exact}
    got_alpha, per_byte = fit_alpha_beta({**no_latency, 4096: no_latency[4096] / 2})   # faster than β allows
    assert got_alpha == 0 and beta < 1 / per_byte < 2 * beta   # a free fit: α < 0
    got_alpha, per_byte = fit_alpha_beta(no_latency)
    assert got_alpha == 0 and 1 / per_byte == pytest.approx(beta, rel=0.2)


def test_three_failures_come_back_as_exceptions_naming_the_rank():
    from picolib.launch import WorkerError, WorkerTimeout
    from picolib.tryit.lesson00 import three_failures
    raised = three_failures(timeout=3)
    assert list(raised) == ["rank 2 raises", "rank 1 skips an all-reduce", "rank 3 is killed"]
    error, hang, death = raised.values()
    assert isinstance(error, WorkerError) and error.rank == 2 and "raises_on_rank_2" in error.remote_traceback
    assert isinstance(hang, WorkerTimeout) and "ranks [0] did not finish" in str(hang)
    assert "rank 0 was here" in str(hang) and "in all_reduce" in str(hang)     # the stuck rank's stack
    assert isinstance(death, WorkerError) and death.rank == 3 and "SIGKILL" in str(death)


def test_the_traffic_table_prints_rank_0s_counts_and_their_sum():
    from picolib.tryit.lesson00 import traffic_table
    nbytes = 8192 * 4
    traffic = {n: [(None, None, None, {"reduce_scatter": 10 * n + r, "all_gather": 100 * n + r,
                                       "all_reduce": 1000 * n + r, "native all_reduce (formula)": 7 * n})
                   for r in range(n)] for n in (2, 4)}
    head, columns, *rows = traffic_table(traffic, nbytes).splitlines()
    assert "32 KiB" in head and len(rows) == 2
    for n, row in zip((2, 4), rows):
        assert [int(c) for c in row.split("|")] == [n, 10 * n, 100 * n, 1000 * n, 110 * n, 7 * n]   # rank 0's


def _hierarchical(x, per_node):
    """The lesson's hierarchical all-reduce (00 §7), written again for the test."""
    me, n = dist.get_rank(), dist.get_world_size()
    nodes = [dist.new_group(list(range(k, k + per_node))) for k in range(0, n, per_node)]
    across = [dist.new_group(list(range(j, n, per_node))) for j in range(per_node)]
    shard = comm.ring_reduce_scatter(x, group=nodes[me // per_node])
    comm.ring_all_reduce(shard, group=across[me % per_node])
    return comm.ring_all_gather(shard, group=nodes[me // per_node])


def _inside_only(x, per_node):
    """Wrong on purpose: an all-reduce inside each node only (its rings never leave the node)."""
    me = dist.get_rank()
    nodes = [dist.new_group(list(range(k, k + per_node))) for k in range(0, dist.get_world_size(), per_node)]
    dist.new_group(list(range(0, dist.get_world_size(), per_node)))   # the same number of groups on every rank
    return comm.ring_all_reduce(x, group=nodes[me // per_node])


def test_nic_traffic_counts_what_crosses_nodes_on_each_rank():
    """2 nodes × 2 ranks, B = 4·numel: the hierarchical all-reduce puts B/2 on every NIC, a flat
    ring 2·3/4·B on the last rank of each node only, one GPU per node B on every NIC; a ring
    that stays in its node puts nothing on a NIC."""
    from picolib.tryit.lesson00 import nic_traffic
    numel, per_node = 16, 2
    b = 4 * numel
    res = run(nic_traffic, 4, _hierarchical, per_node, numel)
    xs = [x for x, _ in res]
    for r, (_, ways) in enumerate(res):
        assert torch.allclose(ways["hierarchical"][0], sum(xs), atol=1e-5)
        assert ways["hierarchical"][2] == b // 2 == ways["hierarchical"][1]["all_reduce"]
        assert ways["flat ring"][2] == (2 * 3 * b // 4 if r % per_node == per_node - 1 else 0)
        assert ways["one GPU per node"][2] == b
    inside = run(nic_traffic, 4, _inside_only, per_node, numel)
    assert all(ways["hierarchical"][2] == 0 for _, ways in inside)


def test_the_nic_figure_draws_one_bar_per_nic_and_way():
    import matplotlib.pyplot as plt
    from picolib.tryit.lesson00 import draw_nic_traffic
    fake = [(None, {w: (None, {}, nic) for w, nic in
                    (("hierarchical", 16), ("flat ring", 48 if g == 1 else 0), ("one GPU per node", 64))})[1]
            for g in range(2)]
    fig, ax = plt.subplots()
    draw_nic_traffic(ax, fake, 2, 64, {"hierarchical": 100e9, "flat ring": 50e9, "one GPU per node": 50e9})
    assert len(ax.patches) == 6 and sorted(p.get_height() for p in ax.patches) == [0, 0.25, 0.25, 0.75, 1, 1]
    assert "sees 100 GB/s" in " ".join(t.get_text() for t in ax.texts)
    plt.close(fig)
