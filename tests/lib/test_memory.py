"""picolib.memory: measured bytes equal the formulas exactly on TinyLlama; saved activations
match hand counts; recomputation and flash attention remove what they should; the trace
has the shape of a training step. Byte counts are integers: every comparison is exact."""
import pytest
import torch
import torch.nn as nn

from picolib.memory import (Breakdown, MemoryTrace, SavedActivations, activation_bytes,
                            bytes_per_param, grad_bytes, gpt_param_count, hardware_flops,
                            measure, model_flops, model_state_bytes, optimizer_state_bytes,
                            param_bytes, plot_breakdown, plot_trace)
from picolib.model import LlamaConfig, TinyLlama, param_count, random_tokens

CFG = LlamaConfig()


def saved_bytes(cfg, b=2, s=32):
    model = TinyLlama(cfg)
    x, y = random_tokens(b, s, cfg.vocab_size)
    with SavedActivations(model) as act:
        loss = model.loss(x, y)
    loss.backward()
    return act


def test_param_grad_adam_bytes_equal_formula_fp32():
    model = TinyLlama(CFG)
    n = param_count(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert (param_bytes(model), grad_bytes(model), optimizer_state_bytes(opt)) == (4 * n, 0, 0)
    model.loss(*random_tokens(2, 16)).backward()
    assert grad_bytes(model) == 4 * n
    assert optimizer_state_bytes(opt) == 0          # Adam's moments appear at the first step
    opt.step()
    assert optimizer_state_bytes(opt) == 8 * n
    n_tensors = len(list(model.parameters()))
    assert optimizer_state_bytes(opt, scalars=True) == 8 * n + 4 * n_tensors   # step counters
    bd = measure(model, opt, activations=123)
    assert bd == Breakdown(4 * n, 4 * n, 8 * n, 123) and bd.total == 16 * n + 123
    assert bd.total == model_state_bytes(n, "fp32") + 123


def test_sgd_without_momentum_keeps_no_state():
    model = TinyLlama(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.loss(*random_tokens(2, 16)).backward()
    opt.step()
    assert optimizer_state_bytes(opt) == 0


def test_shared_storage_is_counted_once():
    a, b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    b.weight = a.weight                                  # tied weights
    assert param_bytes(nn.Sequential(a, b)) == 8 * 8 * 4


def test_linear_relu_saves_input_and_output_by_hand():
    # addmm(bias, x, Wᵀ) saves x (for dW) and Wᵀ (a view of a parameter: left out);
    # ReLU saves its output. x: 4×8 fp32 = 128 bytes, relu out: 4×16 fp32 = 256 bytes.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    x = torch.randn(4, 8)
    for model in (net, None):                          # by storage, and by the leaf rule
        with SavedActivations(model) as act:
            y = net(x).sum()
        assert (act.bytes, act.live, act.peak) == (128 + 256, 384, 384)
        y.backward()
        assert act.live == 0 and act.peak == 384        # backward freed both
    with SavedActivations(net) as act:
        net(x)
    assert act.by_module == {"0": 128, "1": 256}


def test_recompute_orders_memory_and_selective_removes_exactly_the_scores():
    b, s, L, a = 2, 32, CFG.n_layers, CFG.n_heads
    none, sel, full = (saved_bytes(CFG.replace(recompute=r)) for r in ("none", "selective", "full"))
    assert full.bytes < sel.bytes < none.bytes
    # per layer: softmax probabilities b·a·s² fp32 + the causal mask s² bool
    assert none.bytes - sel.bytes == L * (4 * b * a * s * s + s * s)
    # full: a checkpointed block keeps only its input x (b·s·h fp32), saved by the model
    assert full.by_module["(model)"] == L * b * s * CFG.hidden * 4
    assert not any(k.startswith("blocks.") for k in full.by_module)
    assert none.live == sel.live == full.live == 0


def test_activation_growth_linear_in_batch():
    f = {b: saved_bytes(CFG, b=b, s=16).bytes for b in (2, 4, 8)}
    # affine in b (the causal mask s² does not depend on b)
    assert f[8] - f[4] == 2 * (f[4] - f[2]) > 0


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_activation_growth_in_sequence(impl):
    b, L, a, d = 2, CFG.n_layers, CFG.n_heads, 16
    f = [saved_bytes(CFG.replace(attn_impl=impl), b=b, s=s).bytes for s in (d, 2 * d, 3 * d)]
    second_difference = f[2] - 2 * f[1] + f[0]
    # eager keeps s² terms: softmax 4·b·a·s² and mask s² per layer → Δ² = 2·d²·L·(4ab + 1)
    expected = 2 * d * d * L * (4 * b * a + 1) if impl == "eager" else 0
    assert second_difference == expected


def test_trace_rises_in_forward_falls_in_backward_and_optimizer_appears_after_step():
    model = TinyLlama(CFG)
    n = param_count(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with MemoryTrace(model, opt) as trace:
        for step in range(2):
            model.loss(*random_tokens(2, 16, seed=step)).backward()
            opt.step()
            opt.zero_grad()
    assert "zero_grad" not in opt.__dict__               # the instance patch is gone
    ev = [s.event for s in trace.samples]
    first_bwd, first_step = ev.index("backward"), ev.index("step")
    fwd = [s.activations for s in trace.samples[:first_bwd] if s.event == "forward"]
    bwd = [s.activations for s in trace.samples[first_bwd:first_step]]
    assert fwd == sorted(fwd) and fwd[-1] > fwd[0]      # rises in forward
    assert bwd == sorted(bwd, reverse=True) and bwd[-1] == 0    # falls to 0 in backward
    grads = [s.grads for s in trace.samples[first_bwd:first_step]]
    assert grads == sorted(grads) and grads[-1] == 4 * n
    assert all(s.optimizer == 0 for s in trace.samples[:first_step])
    assert all(s.optimizer == 8 * n for s in trace.samples[first_step:])
    assert trace.samples[ev.index("zero_grad")].grads == 0
    assert all(s.params == 4 * n for s in trace.samples)


def test_formulas_and_table():
    # GPT-2 small: formula + learned positions (1024·768) = its published 124,439,808
    assert gpt_param_count(768, 50257, 12) + 1024 * 768 == 124_439_808
    h = 64  # one GPT block built from torch modules: 12h² + 13h parameters
    layer = nn.TransformerEncoderLayer(h, 4, 4 * h)
    assert sum(p.numel() for p in layer.parameters()) == gpt_param_count(h, 0, 1) - 2 * h
    assert sum(bytes_per_param("fp32").values()) == 16
    assert sum(bytes_per_param("bf16").values()) == 16
    assert sum(bytes_per_param("bf16", fp32_grad_accum=True).values()) == 20
    table = {n: (model_state_bytes(n * 1e9, "bf16") / 1e9,
                 model_state_bytes(n * 1e9, "bf16", True) / 1e9) for n in (1, 7, 70, 405)}
    assert table == {1: (16, 20), 7: (112, 140), 70: (1120, 1400), 405: (6480, 8100)}
    assert activation_bytes(1, 10, 1, 8, 2) == 10 * 8 * 34 + 5 * 2 * 10 * 10
    assert activation_bytes(2, 20, 3, 8, 2, flash=True) == 2 * 20 * 3 * 8 * 34
    with pytest.raises(ValueError):
        activation_bytes(0, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        bytes_per_param("fp8")
    assert hardware_flops(10, 3, "full") / model_flops(10, 3) == 8 / 6
    assert hardware_flops(10, 3) == model_flops(10, 3)


def test_plots_draw():
    import matplotlib
    matplotlib.use("Agg")
    ax = plot_breakdown({"a": Breakdown(1, 2, 3, 4), "b": Breakdown(4, 3, 2, 1)})
    assert len(ax.patches) == 8
    model = TinyLlama(CFG.replace(n_layers=1))
    with MemoryTrace(model) as trace:
        model.loss(*random_tokens(1, 8)).backward()
    assert plot_trace(trace).get_title() == "memory over time"
