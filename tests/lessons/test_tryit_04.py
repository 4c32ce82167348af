"""Lesson 04's try-it: `layer_bytes` against a real tensor-parallel block (weights stored,
bytes sent, counted on picolib's rings via Ledger(rings=True)) and against Llama 3 70B's published parameter count;
every knob combination of the notebook cell runs."""
import itertools

import matplotlib
import pytest
import torch

from picolib import comm
from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama
from picolib.tensor_parallel import apply_tensor_parallel
from picolib.tryit.lesson04 import (LLAMA3, block_layout, layer_bytes, norm_inputs, plot_shards,
                                    plot_tp_block, tp_layer_bytes)

matplotlib.use("Agg")


def _measure(cfg, b, s):
    model = apply_tensor_parallel(TinyLlama(cfg))
    block = model.blocks[0]
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    x = torch.randn(b, s, cfg.hidden, requires_grad=True)
    cos, sin = model.rope(range(s))
    with comm.Ledger(rings=True) as led:          # bytes counted as sent, not the ring formula
        block(x, cos, sin).sum().backward()
    return weights, led.count("all_reduce"), led.measured_total(op="all_reduce")


@pytest.mark.parametrize("tp, kv", [(1, 4), (2, 4), (4, 4), (4, 2)])
def test_layer_bytes_equal_a_measured_tensor_parallel_block(tp, kv):
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=1, n_heads=4, n_kv_heads=kv, ffn_hidden=64)
    b, s = 2, 8
    got = layer_bytes(tp, cfg.hidden, cfg.n_heads, kv, cfg.ffn_hidden, b * s, bytes_per_value=4)
    for weights, calls, sent in run(_measure, tp, cfg, b, s):
        assert weights == got["weights"]
        if kv >= tp:                   # no KV replicas: every all-reduce is an activation's
            assert (calls if tp > 1 else 0) == got["all_reduce_calls"]
            assert sent == got["all_reduce_sent"]
        else:                          # plus the replicas' gradient sums, which it leaves out
            assert calls > got["all_reduce_calls"] and sent > got["all_reduce_sent"]


def test_seventy_b_adds_up_to_its_published_parameter_count():
    hidden, heads, kv, ffn, layers = LLAMA3["Llama-3-70B"]
    per_layer = layer_bytes(1, hidden, heads, kv, ffn, tokens=1)["weights"] / 2   # bf16 → params
    total = layers * per_layer + 2 * 128_256 * hidden + hidden    # + embedding, head, final norm
    assert abs(total / 70.6e9 - 1) < 0.005                       # Meta's model card: 70.6B


def test_weights_shrink_and_bytes_sent_do_not():
    hidden, heads, kv, ffn, _ = LLAMA3["Llama-3-70B"]
    rows = [layer_bytes(t, hidden, heads, kv, ffn, 4096) for t in (2, 4, 8)]
    assert rows[0]["weights"] > rows[1]["weights"] > rows[2]["weights"]
    assert rows[0]["all_reduce_sent"] < rows[1]["all_reduce_sent"] < rows[2]["all_reduce_sent"]
    assert rows[2]["all_reduce_sent"] < 4 * 2 * 4096 * hidden * 2     # the limit 2·(t−1)/t → 2


def test_a_tp_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="tp=3"):
        layer_bytes(3, 8192, 64, 8, 28672, 4096)


def test_every_knob_combination_runs(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)
    for tp, model, seq in itertools.product([1, 2, 4, 8, 16], list(LLAMA3), (1024, 8192)):
        out = tp_layer_bytes(tp, model, seq)
        assert out["weights"] > 0
        plt.close("all")
    with pytest.raises(ValueError, match="model must be one of"):
        tp_layer_bytes(2, "GPT-5", 1024)


def test_the_lessons_drawings_pass_the_figure_check():
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    layouts = run(block_layout, 2, cfg)
    assert [k for _, k, _ in layouts[0]["mlp"]] == ["ColumnParallelLinear", "ColumnParallelLinear",
                                                   "RowParallelLinear"]
    fig = plot_tp_block(layouts, cfg.hidden // cfg.n_heads)
    assert problems(fig) == []
    plt.close(fig)
    W = torch.randn(6, 8)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
    plot_shards(axes[0], W, W.chunk(2, 0), 0, "column")
    plot_shards(axes[1], W, W.chunk(2, 1), 1, "row")
    assert problems(fig) == []
    plt.close(fig)


@pytest.mark.parametrize("sp", [False, True])
def test_norms_see_whole_hidden_vectors(sp):
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    tokens = torch.randint(0, 64, (2, 8))
    seen = run(norm_inputs, 2, cfg, tokens, sp)
    assert len(seen[0]) == 3                       # two per block and the final norm
    for x0, x1 in zip(seen[0].values(), seen[1].values()):
        assert x0.shape == ((2, 4, 32) if sp else (2, 8, 32))
        assert torch.equal(x0, x1) != sp           # TP: identical on both ranks; SP: each its tokens
