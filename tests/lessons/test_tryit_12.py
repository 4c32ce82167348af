"""Lesson 12's try-it and measurement helpers: `io_plot` against a counted run of the tiled
algorithm; the byte counter against a hand count; the Triton RMSNorm against PyTorch's; the
roofline profile against FlopCounterMode; FP8 quantization and the loss scaler."""
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from picolib.attention_io import (largest_block, naive_bytes, on_chip_bytes,  # noqa: E402
                                  tiled_attention, tiled_bytes)
from picolib.tryit.lesson12 import eager_traffic, io_plot, rmsnorm_eager  # noqa: E402


def test_io_plot_is_the_counted_run_of_the_tiled_algorithm():
    io = io_plot(head_dim=64, block=32, plot=False)
    q, k, v = (torch.randn(1024, 64, dtype=torch.bfloat16) for _ in range(3))
    out, moved = tiled_attention(q, k, v, 32)
    assert moved == io["tiled"][1024] == tiled_bytes(1024, 64, 32)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None].float(), k[None].float(), v[None].float())[0]
    assert torch.allclose(out.float(), ref, atol=2e-2)
    assert io["naive"][1024] == 2 * (4 * 1024 * 64 + 4 * 1024 ** 2)


def test_io_plot_picks_the_largest_block_that_fits_and_refuses_one_that_does_not():
    io = io_plot(head_dim=128, on_chip_kib=228, plot=False)
    assert io["block"] == 128 and on_chip_bytes(128, 256) > 228 * 1024
    assert math.isclose(io["naive"][2 ** 17] / io["tiled"][2 ** 17], 2 * 128 / 128, rel_tol=1e-3)
    halved = io_plot(head_dim=64, on_chip_kib=228, plot=False)        # the text's "halve d: ratio doubles"
    assert halved["naive"][2 ** 17] / halved["tiled"][2 ** 17] > 1.9 * io["naive"][2 ** 17] / io["tiled"][2 ** 17]
    with pytest.raises(ValueError, match="on chip"):
        io_plot(head_dim=128, block=256, on_chip_kib=228, plot=False)
    assert largest_block(64, 64 * 1024) < largest_block(64, 228 * 1024)


def test_io_plot_draws():
    import matplotlib.pyplot as plt
    before = set(plt.get_fignums())
    numbers = io_plot(head_dim=64, block=64)
    (fig,) = [plt.figure(n) for n in set(plt.get_fignums()) - before]
    naive, tiled = fig.axes[0].get_lines()[:2]
    assert list(naive.get_ydata()) == pytest.approx([numbers["naive"][s] / 2**30 for s in naive.get_xdata()])
    assert all(t < n for t, n in zip(tiled.get_ydata(), naive.get_ydata()))
    plt.close("all")


def test_eager_traffic_counts_rmsnorm_op_by_op():
    R, H = 16, 32
    t = eager_traffic(rmsnorm_eager, torch.randn(R, H), torch.randn(H))
    assert t["ops"] == ["pow", "mean", "add", "rsqrt", "mul", "mul"]
    assert t["bytes"] == 4 * (2 * R * H + (R * H + R) + 2 * R + 2 * R + (2 * R * H + R) + (2 * R * H + H))
    assert naive_bytes(1, 1) == 16


def test_triton_rmsnorm_equals_pytorch_values_and_gradients():
    pytest.importorskip("triton")
    from picolib.model import RMSNorm
    from picolib.tryit.lesson12 import check_fused_rmsnorm
    err = check_fused_rmsnorm(RMSNorm(72), rows=6)        # 72: not a power of two (masked lanes)
    assert err["y"] < 1e-5 and err["dx"] < 1e-5 and err["dw"] < 1e-4


def test_profile_step_counts_the_matmuls_flop_counter_counts():
    from torch.utils.flop_counter import FlopCounterMode

    from picolib.model import LlamaConfig, TinyLlama, random_tokens
    from picolib.roofline import GROUPS, profile_step
    cfg = LlamaConfig(hidden=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=64)
    model, (x, y) = TinyLlama(cfg), random_tokens(2, 16, 64)
    table = profile_step(model, x, y, torch.optim.AdamW(model.parameters()), steps=1)
    with FlopCounterMode(display=False) as fc:
        model.loss(x, y).backward()
    assert table["matmuls"]["flops"] == fc.get_total_flops()
    assert set(table) <= set(GROUPS) and {"norms", "optimizer", "softmax and mask"} <= set(table)
    assert table["optimizer"]["bytes"] > 0 and all(r["seconds"] > 0 for r in table.values())


def test_roofline_formula():
    from picolib.roofline import attainable, op_time, ridge
    assert op_time(2e12, 1e9, 1e12, 1e12) == 2.0 and op_time(1, 4e12, 1e12, 2e12) == 2.0
    assert attainable(1, 100, 10) == 10 and attainable(1000, 100, 10) == 100 and ridge(100, 10) == 10


def test_fp8_tiles_rows_and_the_scaler():
    from picolib.low_precision import DynamicLossScaler, fake_quantize, quantize
    x = torch.randn(4, 256) * torch.logspace(-3, 3, 256)
    codes, scale = quantize(x, "tile")
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    err = {g: (fake_quantize(x, g) - x).abs().div(x.abs()).mean().item() for g in ("tensor", "row", "tile")}
    assert err["tile"] < err["row"] <= err["tensor"]
    with pytest.raises(ValueError, match="tiles"):
        quantize(torch.randn(3, 100), "tile")
    p = torch.nn.Parameter(torch.ones(3))
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert not scaler.unscale_and_check([p]) and scaler.scale_value == 4.0
    for _ in range(2):
        p.grad = torch.tensor([4.0, 8.0, 0.0])
        assert scaler.unscale_and_check([p])
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 0.0])) and scaler.scale_value == 8.0
