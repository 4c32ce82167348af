"""Lesson 03's try-it bars come from formulas; here they meet the bytes that real ZeRO
ranks hold after one Adam step (ZeRO(...).memory(), measured on the tensors' storages)."""
import matplotlib
import pytest
import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.memory import measure
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.data_parallel import DDP
from picolib.tryit import knobs
from picolib.tryit.lesson03 import MODELS, per_rank, zero_bars
from picolib.zero import ZeRO, unit_numels

matplotlib.use("Agg")
CFG = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                  ffn_hidden=23, max_seq=16)   # the lesson's model: its units need padding


def _measured(stage, bf16):
    model = TinyLlama(CFG)
    x, y = random_tokens(2, 8, CFG.vocab_size, seed=dist.get_rank())
    if stage == 0:
        DDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model.loss(x, y).backward()
        opt.step()
        b = measure(model, opt)
        return {"params": b.params, "grads": b.grads, "optimizer": b.optimizer}
    zero = ZeRO(model, stage, optimizer="adam", lr=1e-3,
                param_dtype=torch.bfloat16 if bf16 else torch.float32)
    model.loss(x, y).backward()
    zero.step()
    return zero.memory()


def test_the_models_units_are_the_lessons():
    assert MODELS["tiny Llama"] == unit_numels(TinyLlama(CFG))


@pytest.mark.parametrize("stage, n", [(1, 2), (2, 3), (3, 4)])
def test_bars_equal_what_zero_ranks_hold(stage, n):
    want = per_rank(stage, n, MODELS["tiny Llama"], "fp32")
    for got in run(_measured, n, stage, False):
        assert got == want[f"ZeRO-{stage}"]
    for got in run(_measured, n, 0, False):
        assert got == want["DP"]


def test_bf16_bars_equal_zero1_with_bf16_weights():
    want = per_rank(1, 2, MODELS["tiny Llama"], "bf16 + fp32 master")["ZeRO-1"]
    for got in run(_measured, 2, 1, True):
        assert got == want


def test_the_knobs_cell_draws_and_returns_the_bars():
    # the lesson's cell opens on a meaningful setting: ZeRO-3 on 8 ranks, not N = 1
    mem = knobs(zero_bars, stage=[3, 1, 2], ranks=[8, 1, 2, 4, 16, 64, 256, 1024], model=list(MODELS))
    assert mem == per_rank(3, 8, MODELS["7.5B (ZeRO paper)"])
    assert sum(mem["DP"].values()) == 8 * sum(mem["ZeRO-3"].values())
    one = per_rank(3, 1, MODELS["7.5B (ZeRO paper)"])
    assert one["DP"] == one["ZeRO-3"]                 # N = 1: nobody to share with
    assert sum(zero_bars(3, 64)["ZeRO-3"].values()) == 120_000_000_000 // 64
    with pytest.raises(ValueError):
        per_rank(0, 2, 100)


def test_the_lessons_bars_pass_the_figure_check():
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    from picolib.style import MEMORY
    from picolib.tryit.lesson03 import COLORS, plot_groups
    assert COLORS == {k: MEMORY[k] for k in ("params", "grads", "optimizer")}
    fig, ax = plt.subplots(figsize=(6, 3.8), layout="constrained")
    plot_groups({f"N = {n}": per_rank(3, n, MODELS["tiny Llama"], "fp32") for n in (1, 8)}, ax=ax)
    assert ax.get_ylabel() == "KiB per rank"          # binary units for memory
    assert problems(fig) == []
    plt.close(fig)
