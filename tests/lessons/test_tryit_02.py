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
