"""This CPU's roofline parameters for the planner's "CPU" preset (picolib.hardware.PRESETS).

    .venv/bin/python bench/cpu_roofline.py       # writes bench/results/cpu_roofline.json

One thread, as every rank of the lessons. Each figure is the best of several runs (a shared
machine only ever slows a run down):
- peak: FLOP/s of an fp32 512×512×512 matmul (`picolib.roofline.measure_peak`);
- matmul_small_eff: a 64×512×512 matmul's FLOP/s over that peak (a skinny matmul's efficiency);
- bandwidth: bytes/s of copying 64 MiB (`measure_bandwidth`: read + write);
- launch: seconds of one operation on a one-element tensor (its dispatch, no work);
- gloo_busbw: bus bandwidth of a 64 MiB float32 all-reduce between 2 gloo processes
  (2(N−1)/N · bytes / seconds, nccl-tests' convention).
"""
from __future__ import annotations

import json
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.roofline import measure_bandwidth, measure_peak

NBYTES = 64 * 2**20


def _best(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _all_reduce():
    torch.set_num_threads(1)
    x, world = torch.ones(NBYTES // 4), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    t = _best(lambda: dist.all_reduce(x, group=group), 5)
    return 2 * (world - 1) / world * NBYTES / t


def main() -> dict:
    torch.set_num_threads(1)
    peak = measure_peak(torch.float32, n=512, reps=7)
    a, b = torch.randn(64, 512), torch.randn(512, 512)
    small = 2 * 64 * 512 * 512 * 20 / _best(lambda: [a @ b for _ in range(20)], 7)
    one = torch.ones(1)
    launch = _best(lambda: [one.add(one) for _ in range(1000)], 7) / 1000
    out = {"date": date.today().isoformat(), "torch": torch.__version__, "threads": 1,
           "peak": peak, "matmul_small_eff": small / peak,
           "bandwidth": measure_bandwidth(torch.float32, NBYTES, reps=7),
           "launch": launch, "gloo_busbw": run(_all_reduce, 2)[0]}
    path = Path(__file__).parent / "results" / "cpu_roofline.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
