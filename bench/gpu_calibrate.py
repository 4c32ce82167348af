"""Measure the planner's efficiencies on this machine and write them as a preset (lesson 11b).

    python bench/gpu_calibrate.py --base H100-SXM     # on a GPU: bench/results/calibration_<GPU>.json
    python bench/gpu_calibrate.py --base CPU          # the same measurements on this CPU (small sizes)

The planner (`picolib.plan_search.step_time`) prices every op of a layer with the fractions a
`picolib.hardware.Hardware` preset carries — matmul_eff, hbm_eff, attention_eff, link_eff,
launch — each cited to a published measurement. This script measures them where it runs, the
way `layer_costs.op_seconds` uses them, each the best of several timed runs:
- matmul by shape: FLOP/s of each (m, k, n) over the preset's dense peak (bf16 on a GPU, fp32 on
  a CPU); the shapes are a Llama-3-70B layer's on 8 tensor-parallel ranks at several token
  counts, and squares. matmul_eff is the best of them (the MAMF convention); the whole table
  is kept, the data the shape-dependent matmul model of issue 57 is checked against;
- copy: bytes/s of a copy larger than any cache (read + write) over the HBM bandwidth (hbm_eff);
- attention: the fused causal kernel (`scaled_dot_product_attention`), forward and backward,
  at the FLOPs `layer_ops` counts for it (the causal half; backward 2.5× forward) over the peak;
- launch: seconds of one operation on a one-element tensor;
- all-reduce by size: bus bandwidth (2(N−1)/N × bytes / seconds, nccl-tests' convention) from
  1 KiB up, on every GPU of the machine over NCCL (none measured with one GPU: NCCL refuses two
  ranks on one device), on a CPU over gloo between two processes; link_eff is the largest
  size's over the preset's node link.
`picolib.hardware.calibrated(base, results)` turns the file into a preset; the planner then
runs on it like on any other (`step_time(cfg, par, hw=calibrated("H100-SXM", path))`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from picolib.hardware import hardware  # noqa: E402


def _best(fn, reps: int, device: torch.device) -> float:
    """The shortest of `reps` timed calls of `fn`, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_shapes(small: bool) -> list[tuple[int, int, int]]:
    """Llama-3-70B's matmuls on one of 8 tensor-parallel ranks (q/k/v, attention out, gate and
    up, down) at 1, 4 and 8 k tokens, and squares; tiny stand-ins with `small`."""
    if small:
        return [(64, 128, 128), (256, 256, 256), (128, 512, 64)]
    h, qkv, f = 8192, (64 + 2 * 8) * 128 // 8, 2 * 28672 // 8
    shapes = [(t, k, n) for t in (1024, 4096, 8192)
              for k, n in ((h, qkv), (h // 8, h), (h, f), (f // 2, h))]
    return shapes + [(s, s, s) for s in (1024, 4096, 8192)]


def measure_matmuls(device, dtype, peak: float, small: bool, reps: int) -> list[dict]:
    rows = []
    for m, k, n in matmul_shapes(small):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        inner = 1 if device.type == "cpu" else 10
        t = _best(lambda: [a @ b for _ in range(inner)], reps, device) / inner
        rows.append({"shape": [m, k, n], "flops_per_s": 2 * m * k * n / t, "eff": 2 * m * k * n / t / peak})
    return rows


def measure_copy(device, nbytes: int, reps: int) -> float:
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / _best(lambda: y.copy_(x), reps, device)


def measure_attention(device, dtype, small: bool, reps: int) -> float:
    """FLOP/s of causal SDPA forward and backward, at `layer_ops`'s count: forward
    2·s²·heads·head_dim (the causal half of two matmuls), backward 2.5× that."""
    b, heads, s, d = (1, 2, 128, 32) if small else (1, 64 // 8, 8192, 128)
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
    forward = 2 * b * heads * s * s * d
    return 3.5 * forward / _best(step, reps, device)


def measure_launch(device, reps: int) -> float:
    one = torch.ones(1, device=device)
    return _best(lambda: [one.add(one) for _ in range(100)], reps, device) / 100


def _all_reduce_sizes(sizes: list[int], reps: int) -> list[dict]:
    """On a rank: bus bandwidth of an all-reduce of each size (bytes), the best of `reps`."""
    import torch.distributed as dist
    from picolib.launch import device as rank_device
    dev, world = rank_device(), dist.get_world_size()
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), device=dev)
        t = _best(lambda: dist.all_reduce(x), reps, dev)
        rows.append({"bytes": nbytes, "seconds": t, "busbw": 2 * (world - 1) / world * nbytes / t})
    return rows


def measure_all_reduce(device, small: bool, reps: int) -> tuple[int, list[dict]]:
    """(ranks, rows): every GPU over NCCL, or two CPU processes over gloo; (1, []) on one GPU."""
    from picolib.launch import run
    world = torch.cuda.device_count() if device.type == "cuda" else 2
    if world < 2:
        return 1, []
    top = 2**20 if small else 2**30
    sizes = [2**p for p in range(10, top.bit_length(), 2)]
    return world, run(_all_reduce_sizes, world, sizes, reps, timeout=600)[0]


def calibrate(base: str, device: str = "cuda", small: bool = False, reps: int = 5) -> dict:
    """Every term, measured here, against the preset `base`'s datasheet figures."""
    dev = torch.device(device)
    hw = hardware(base)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    peak = hw.peak("bf16")
    if dev.type == "cpu":                  # one thread, as every rank of the lessons; small sizes
        torch.set_num_threads(1)
        small = True
    matmuls = measure_matmuls(dev, dtype, peak, small, reps)
    copy = measure_copy(dev, (64 if small else 1024) * 2**20, reps)   # 64 MiB: past a CPU's caches
    attention = measure_attention(dev, dtype, small, reps)
    world, reduce_rows = measure_all_reduce(dev, small, reps)
    terms = {"matmul_eff": max(r["eff"] for r in matmuls), "hbm_eff": copy / hw.hbm_bandwidth,
             "attention_eff": attention / peak, "launch": measure_launch(dev, reps)}
    if reduce_rows:
        terms["link_eff"] = reduce_rows[-1]["busbw"] / hw.levels[0].per_gpu
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return {"date": date.today().isoformat(), "device": name, "torch": torch.__version__,
            "base": base, "terms": terms, "matmuls": matmuls, "copy_bytes_per_s": copy,
            "attention_flops_per_s": attention, "all_reduce": {"ranks": world, "sizes": reduce_rows}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="gpu_calibrate.py", description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the preset whose datasheet figures the fractions divide "
                                    "(default: H100-SXM on a GPU, CPU on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small sizes (always on a CPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="the JSON file (default bench/results/calibration_<device>.json)")
    args = ap.parse_args(argv)
    args.base = args.base or ("H100-SXM" if args.device.startswith("cuda") else "CPU")
    try:
        hardware(args.base)
    except ValueError as e:
        ap.error(str(e))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no GPU")
    out = calibrate(args.base, args.device, args.small, args.reps)
    slug = out["device"].replace(" ", "_").replace("/", "_")
    path = Path(args.out) if args.out else ROOT / "results" / f"calibration_{slug}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["terms"], indent=1), f"\nwritten to {path}")
    return out


if __name__ == "__main__":
    main()
