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


def test_the_knobs_cell_draws_and_returns_the_plan():
    plan = knobs(buckets, cap_kib=(16, 512, 16), n_layers=(1, 8, 1))
    assert plan == bucket_plan(16, 1)
