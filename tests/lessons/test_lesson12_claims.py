"""Lesson 12's claims, settled again outside the notebook (smaller and faster): the H100's
ridge from the preset against the published figure, flash attention's I/O ratio 2B/d against
counted runs, eager attention's s² tensors against sdpa's, fp16's vanishing gradients
against bf16 and loss scaling, FP8's outlier errors by scale granularity, and a short FP8
training run against bf16."""
import torch

from picolib.attention_io import largest_block, naive_bytes, tiled_attention, tiled_bytes
from picolib.hardware import GPUS
from picolib.roofline import op_time, ridge


def test_h100_ridge_is_the_published_295_and_small_matmuls_fall_below_it():
    h100 = GPUS["H100-SXM"]
    assert round(ridge(h100.bf16, h100.hbm_bandwidth)) == int(990e12 / 3.35e12) == 295   # scaling book: "295"

    def intensity(m, k, n, elem=2):
        return 2 * m * k * n / (elem * (m * k + k * n + m * n))
    assert intensity(512, 64, 176) < 295 < intensity(4096, 4096, 14336)
    # a memory-bound op's bound is its bytes over W, a compute-bound one's its FLOPs over C
    assert op_time(1e9, 1e9, h100.bf16, h100.hbm_bandwidth) == 1e9 / h100.hbm_bandwidth
    assert op_time(1e15, 1e9, h100.bf16, h100.hbm_bandwidth) == 1e15 / h100.bf16


def test_tiled_attention_moves_2B_over_d_times_fewer_bytes_for_long_sequences():
    for d, kib in ((64, 228), (128, 228), (128, 64)):
        block = largest_block(d, kib * 1024)
        ratio = naive_bytes(2 ** 20, d) / tiled_bytes(2 ** 20, d, block)
        assert abs(ratio - 2 * block / d) < 0.01 * ratio, (d, kib, block, ratio)
    q, k, v = (torch.randn(300, 32) for _ in range(3))        # a partial last block
    out, moved = tiled_attention(q, k, v, 64)
    assert moved == tiled_bytes(300, 32, 64, elem=4)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    assert torch.allclose(out, ref, atol=1e-5)


def test_eager_attention_creates_s_squared_bytes_and_sdpa_linear():
    from picolib.tryit.lesson12 import attention_cost
    cost = attention_cost(seqs=(128, 256), heads=1, d=32)
    eager = cost["eager"][256][3] / cost["eager"][128][3]
    sdpa = cost["sdpa"][256][3] / cost["sdpa"][128][3]
    assert 3.3 < eager < 4.0 and 1.9 < sdpa <= 2.05             # peak memory: s² against s
    assert cost["eager"][256][2] == 256 * 256 * 4 and cost["eager"][256][3] >= 2 * 256 * 256 * 4
    assert cost["sdpa"][256][3] == 256 * 32 * 4 + 256 * 4       # output + log-sum-exp


def test_fp16_gradients_vanish_bf16_and_loss_scaling_keep_them():
    from picolib.tryit.lesson12 import fp16_gradients, scaler_steps
    g = fp16_gradients(divisors=(4096,), batch=2, seq=32)[4096]
    assert g["fp16"][0] > 0.05 and g["bf16"][0] == 0 and g["fp16 + loss scaling"][0] < 1e-4
    assert g["fp16 + loss scaling"][1] < g["bf16"][1] < 0.02 < g["fp16"][1]
    steps = scaler_steps(init_scale=2.0 ** 24, steps=5)
    assert not steps[0][1] and any(ok for _, ok in steps)


def test_fine_grained_fp8_scales_survive_an_outlier():
    from picolib.tryit.lesson12 import outlier_errors
    err = outlier_errors(outliers=(1, 1000))
    assert abs(err["tensor"][0] / err["tile"][0] - 1) < 0.1                 # no outlier: alike
    assert err["tensor"][1] > 3 * err["tile"][1] and err["row"][1] > err["tile"][1]


def test_a_short_fp8_run_tracks_bf16():
    from picolib.tryit.lesson12 import fp8_runs
    runs = fp8_runs(steps=20, runs={"bf16": None, "fp8, 1×128 tiles": ("tile", "e4m3")})
    late = {m: sum(l[-5:]) / 5 for m, l in runs.items()}
    assert runs["bf16"][0] - late["bf16"] > 1.5
    assert abs(late["fp8, 1×128 tiles"] - late["bf16"]) < 0.02


def test_the_planner_prices_a_matmul_with_the_same_roofline():
    """The planner's per-matmul time (issue 25) and lesson 12's bound agree in method: the
    larger of FLOPs over (a fraction of) the peak and bytes over the HBM bandwidth."""
    from picolib.plan_search import matmul_seconds
    h100 = GPUS["H100-SXM"]
    for m, k, n in ((512, 64, 176), (4096, 4096, 14336), (128, 8192, 8192)):
        ours = op_time(2 * m * k * n, 2 * (m * k + k * n + m * n), 0.75 * h100.bf16, h100.hbm_bandwidth)
        assert abs(matmul_seconds(m, k, n, "H100-SXM", "bf16", ceiling=0.75) - ours) <= 1e-12 * ours


def test_chip_peaks_from_the_architecture_match_the_datasheets_and_presets():
    from picolib.roofline import CHIPS, tensor_peak
    for name, chip in CHIPS.items():
        derived = tensor_peak(name)
        assert derived is None or abs(derived / chip["peak16"] - 1) < 0.005, name
    assert tensor_peak("B200") is None                     # reported only: no published SMs or clock
    for chip, preset in (("H100", "H100-SXM"), ("H200", "H200-SXM")):
        hw = GPUS[preset]
        assert abs(tensor_peak(chip) / hw.bf16 - 1) < 0.001 and CHIPS[chip]["hbm"] == hw.hbm_bandwidth
    # NVIDIA quotes NVLink both ways; the presets are per direction
    assert CHIPS["H100"]["nvlink_both_ways"] / 2 == GPUS["H100-SXM"].levels[0].per_gpu
    assert CHIPS["B200"]["nvlink_both_ways"] / 2 == GPUS["GB200-NVL72"].levels[0].per_gpu
    # the lecture notes' clock: 989e12 / 132 / 1.76e9 / 4 is not a whole 1,024 FLOPs per Tensor Core cycle
    assert round(GPUS["H100-SXM"].bf16 / 132 / 1.76e9 / 4) == 1064
    # the fp32 lanes, an FMA as 2 FLOPs, at 1.98 GHz: the datasheet's 67 TFLOP/s; Tensor Cores 15x
    fp32 = 132 * 4 * 32 * 2 * 1.98e9
    assert abs(fp32 / 67e12 - 1) < 0.005 and 14 < tensor_peak("H100") / fp32 < 16
