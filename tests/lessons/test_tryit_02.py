"""Lesson 02's try-it function predicts what a real DDP does: its buckets (bytes, names)
and the all-reduces of one backward, counted by the Ledger on two ranks."""
import matplotlib
import pytest
import torch.distributed as dist

from picolib.comm import Ledger
from picolib.data_parallel import DDP
from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.tryit import knobs
from picolib.tryit.lesson02 import bucket_plan, buckets

matplotlib.use("Agg")


def _real_ddp(cap_kib, n_layers):
    cfg = LlamaConfig().replace(n_layers=n_layers)
    model = TinyLlama(cfg)
    ddp = DDP(model, bucket_cap_bytes=cap_kib * 1024)
    x, y = random_tokens(2, 8, cfg.vocab_size, seed=dist.get_rank())
    with Ledger() as led:
        model.loss(x, y).backward()
    return ddp.bucket_bytes(), ddp.bucket_names(), led.count("all_reduce"), led.total("nbytes")


@pytest.mark.parametrize("cap_kib, n_layers", [(16, 1), (64, 4), (160, 2), (1024, 3)])
def test_bucket_plan_matches_a_real_ddp(cap_kib, n_layers):
    plan = bucket_plan(cap_kib, n_layers)
    for sizes, names, calls, nbytes in run(_real_ddp, 2, cap_kib, n_layers):
        assert plan["buckets"] == sizes and plan["names"] == names
        assert plan["calls"] == calls == len(sizes)
        assert sum(plan["buckets"]) == nbytes          # every gradient byte, once


def test_more_layers_more_calls_and_a_big_cap_is_one_call():
    assert bucket_plan(64, 8)["calls"] > bucket_plan(64, 2)["calls"]
    assert bucket_plan(2**20, 8)["calls"] == 1
    assert bucket_plan(1, 2)["calls"] == bucket_plan(1, 2)["tensors"]   # every tensor alone
    with pytest.raises(ValueError):
        bucket_plan(64, 0)


def test_the_knobs_cell_opens_on_the_lessons_setting():
    plan = knobs(buckets, cap_kib=[64, 16, 32, 128, 256, 1024], n_layers=[4, 1, 2, 8])
    assert plan == bucket_plan(64, 4) and plan["calls"] == 13


def test_every_bucket_is_visible_and_labelled_with_its_size():
    """Issue 36: the 256-byte buckets of one norm's gradient were drawn 0.2 KiB high on a
    linear axis next to 64 KiB ones and read as missing."""
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    fig, ax = plt.subplots(figsize=(9, 3.4), layout="constrained")
    plan = buckets(16, 1, ax=ax)
    assert 256 in plan["buckets"]                       # the case that was invisible
    assert ax.get_yscale() == "log"
    bottom, top = ax.get_ylim()
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) == plan["calls"]
    for bar, nbytes in zip(bars, plan["buckets"]):
        shown = bar.get_y() + bar.get_height()
        assert abs(shown - nbytes / 1024) < 1e-9 and shown > bottom * 2   # visibly above the floor
    labels = [t.get_text() for t in ax.texts]
    assert "256 B" in labels and "64 KiB" in labels and len(labels) == plan["calls"]
    assert problems(fig) == []
    plt.close(fig)


# --------------------------------------------------------------------------- the lesson's plumbing
# The helpers lesson 02's cells call (slicing, the reference run, the table, the figures, the
# overlap summary): each against a value worked out here by hand.

def _ev(rank, name, start, end, lane="compute", **meta):
    return {"rank": rank, "name": name, "lane": lane, "start": start, "end": end,
            "emulated": False, "cost": None, "meta": meta}


def test_rows_are_equal_slices_that_rebuild_the_batch():
    import torch
    from picolib.tryit.lesson02 import rows
    tokens, targets = torch.arange(24).view(8, 3), torch.arange(24).view(8, 3) + 100
    parts = [rows(tokens, targets, 4, i) for i in range(4)]
    assert all(x.shape == (2, 3) for x, _ in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), tokens)
    assert torch.equal(torch.cat([y for _, y in parts]), targets)
    assert torch.equal(rows(tokens, targets, 4, 2)[0], tokens[4:6])
    for pieces, i in [(3, 0), (4, 4), (0, 0)]:       # uneven, out of range, no slices
        with pytest.raises(ValueError):
            rows(tokens, targets, pieces, i)


def test_max_diff_is_the_largest_gap_over_all_tensors():
    import torch
    from picolib.tryit.lesson02 import max_diff
    a = [torch.zeros(3), torch.ones(2, 2)]
    b = [torch.tensor([0.0, -0.25, 0.0]), torch.full((2, 2), 1.5)]
    assert max_diff(a, a) == 0.0 and max_diff(a, b) == 0.5
    with pytest.raises(ValueError):
        max_diff(a, b[:1])


def test_single_process_takes_plain_sgd_steps_on_the_whole_batch():
    import torch
    from picolib.tryit.lesson02 import single_process
    cfg, lr = LlamaConfig().replace(n_layers=1), 0.1
    batch = lambda step: random_tokens(4, 8, cfg.vocab_size, seed=7 + step)
    model = TinyLlama(cfg)                            # the same seed: the same start
    for step in range(2):
        grads = torch.autograd.grad(model.loss(*batch(step)), list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= lr * g
    got = single_process(cfg, batch, 2, lr)
    assert max((w - p).abs().max().item() for w, p in zip(got, model.parameters())) < 1e-6
    start = [p.detach() for p in TinyLlama(cfg).parameters()]
    assert max((w - p).abs().max().item() for w, p in zip(got, start)) > 1e-4   # it did move


def test_print_calls_prints_the_planned_buckets_beside_the_counts(capsys):
    from picolib.data_parallel import assign_buckets
    from picolib.tryit.lesson02 import print_calls
    sizes = [400, 300, 200, 100]
    counts = {"naive": (4, 1000, 1000), 500: (7, 1000, 1000), 10_000: (9, 1000, 1000)}   # ≠ the plan: the columns differ
    print_calls(counts, sizes)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(counts) and "bucket cap" in lines[0]
    assert lines[1].split()[:3] == ["naive", "DP", "—"]
    for line, cap in zip(lines[2:], (500, 10_000)):
        cells = line.split()
        assert cells[0] == f"{cap:,}" and int(cells[1]) == len(assign_buckets(sizes, cap))
        assert int(cells[2]) == counts[cap][0]
    assert [int(line.split()[1]) for line in lines[2:]] == [3, 1]   # 400 | 300+200 | 100; all


def test_plot_calls_draws_the_counted_calls_against_the_cap():
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    from picolib.tryit.lesson02 import plot_calls
    counts = {"naive": (39, 1, 1), 1: (39, 1, 1), 2**16: (13, 1, 1), 2**20: (1, 1, 1)}
    ax = plot_calls(counts, [1, 2**16, 2**20])
    line, naive = ax.lines
    assert list(line.get_xdata()) == [1, 2**16, 2**20] and list(line.get_ydata()) == [39, 13, 1]
    assert list(naive.get_ydata()) == [39, 39] and ax.get_xscale() == "log"
    assert ax.get_ylim()[1] > 39                      # the naive line is not on the frame
    assert problems(ax.figure) == []
    plt.close(ax.figure)


def _step(rank, overlap):
    """One rank's step: a forward, two blocks' backward, two all-reduces of 20 ms (issued
    under backward with overlap, after it without)."""
    ev = [_ev(rank, "F", 0.00, 0.04), _ev(rank, "B", 0.04, 0.07, label="head"),
          _ev(rank, "B", 0.07, 0.10, label="B0")]
    starts = (0.07, 0.10) if overlap else (0.10, 0.12)
    ev += [_ev(rank, "all_reduce", s, s + 0.02, lane="comm", issued=s, bucket=b)
           for b, s in enumerate(starts)]
    return ev


NAMES = [["lm_head.weight", "norm.weight", "blocks.0.mlp.w_down.weight"],
         ["blocks.0.attn_norm.weight", "embed.weight"]]


def test_last_step_keeps_the_events_from_the_last_forward_on():
    from picolib.tryit.lesson02 import last_step
    warm = [_ev(0, "F", -1.0, -0.9), _ev(0, "B", -0.9, -0.8)]
    assert last_step(warm + _step(0, True)) == _step(0, True)
    with pytest.raises(ValueError):
        last_step(_step(0, True)[1:])


def test_overlap_summary_measures_issued_exposed_and_hidden_time():
    from picolib.tryit.lesson02 import overlap_summary
    events = _step(0, True) + _step(1, False)
    on, off = overlap_summary(events, 0), overlap_summary(events, 1)
    assert on["issued under backward"] == 1 and off["issued under backward"] == 0
    assert on["exposed comm (ms)"] == pytest.approx(20) and off["exposed comm (ms)"] == pytest.approx(40)
    assert on["comm hidden by backward (ms)"] == pytest.approx(20) and off["comm hidden by backward (ms)"] == 0
    assert on["step (ms)"] == pytest.approx(120) and off["step (ms)"] == pytest.approx(140)
    with pytest.raises(ValueError):
        overlap_summary([e for e in events if e["name"] != "all_reduce"], 0)


def test_plot_overlap_draws_one_panel_per_run_on_one_time_axis():
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    from picolib.tryit.lesson02 import plot_overlap
    fig = plot_overlap({True: _step(0, True) + _step(1, True), False: _step(0, False) + _step(1, False)},
                       {"B": 0.03, "all_reduce": 0.02}, NAMES)
    top, bottom = fig.axes[:2]
    assert "overlap=True" in top.get_title() and "overlap=False" in bottom.get_title()
    assert "B 30 ms/block" in top.get_title() and "all-reduce 20 ms/bucket" in top.get_title()
    assert top.get_xlim() == bottom.get_xlim()        # the longer run sets both axes
    assert problems(fig) == []
    plt.close(fig)
    texts = [t.get_text() for t in top.texts]
    assert texts.count("head\nB0") == 2 and texts.count("B0\nemb") == 2   # each rank's buckets, by blocks
    assert not any(t.startswith("AR") for t in texts)


def test_bucket_label_names_the_blocks_a_bucket_holds():
    from picolib.tryit.lesson02 import bucket_label
    assert [bucket_label(n) for n in NAMES] == ["head·B0", "B0·emb"]
    assert bucket_label(["blocks.3.mlp.w_gate.weight", "blocks.3.attn.wq.weight",
                         "blocks.2.mlp.w_up.weight"]) == "B3·B2"


def test_collective_order_flags_an_all_reduce_done_before_the_last_issue():
    """Issue 59: rank 0's all-reduce drawn as over before rank 1 had issued it."""
    from picolib.tryit.lesson02 import collective_order
    assert collective_order(_step(0, True) + _step(1, True)) == []
    def rank1_issues_later(dt):      # rank 1 issues (and runs) each all-reduce dt later
        return _step(0, True) + [dict(e, start=e["start"] + dt, end=e["end"] + dt,
                                      meta=dict(e["meta"], issued=e["meta"]["issued"] + dt))
                                 if e["name"] == "all_reduce" else e for e in _step(1, True)]
    assert collective_order(rank1_issues_later(0.05)) == [
        "bucket 0, rank 0: ends before the last rank issued it",
        "bucket 1, rank 0: ends before the last rank issued it"]
    assert collective_order(rank1_issues_later(0.01)) == [
        "bucket 0, rank 0: starts before the last rank issued it",
        "bucket 1, rank 0: starts before the last rank issued it"]


def test_exposed_comm_counts_from_the_last_ranks_backward():
    """A rank that ends backward first also waits for the other: its exposed time counts from
    the end of the slower rank's backward, the same on both ranks."""
    from picolib.tryit.lesson02 import overlap_summary
    slow = [dict(e, end=e["end"] + 0.01) if e["name"] == "B" and e["end"] == 0.10 else e
            for e in _step(1, True)]
    events = _step(0, True) + slow
    assert overlap_summary(events, 0)["exposed comm (ms)"] == pytest.approx(10)
    assert overlap_summary(events, 1)["exposed comm (ms)"] == pytest.approx(10)
