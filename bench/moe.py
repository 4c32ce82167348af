"""picolib expert parallelism: the all-to-all and the all-gather dispatcher, top-1 and
top-2, on 2 and 4 ranks, against one process running the same MoE layer on the same tokens
(lesson 09). Baseline of the `ratios`: the all-gather dispatcher at the same ep, top-k and
tokens (all-to-all / all-gather: step time and bytes sent per rank).

    .venv/bin/python bench/moe.py              # writes bench/results/moe.json

One run: 2 and then 4 gloo ranks (picolib.launch.run) on this machine's CPU. Every rank
holds T tokens of its own; the single-process reference holds all E experts and runs the
ep·T tokens of the group as `ep` token groups (the same routing, asserted equal outputs).
A step is forward + backward of the layer (a fixed random projection of the output as the
loss). Each configuration runs WARMUP + STEPS steps; a step's time is the slowest rank's; a
row reports the median. The reference runs on rank 0 of the same launch while the other
ranks wait, so `vs_one_process` is a ratio of two timings from one run. Bytes: what rank 0
sends per step (forward and backward), counted by picolib.comm's Ledger; `per_rank_mean`
averages the ranks (the all-to-all's bytes depend on the routing).
Sizes: h=256, 8 experts of inner size 512, softmax router, dropless, T=1024 tokens per rank.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picolib.comm import Ledger  # noqa: E402
from picolib.expert_parallel import ExpertParallelMoE  # noqa: E402
from picolib.launch import run  # noqa: E402
from picolib.moe import MoE  # noqa: E402
from _report import write  # noqa: E402

H, E, F, T = 256, 8, 512, 1024
WARMUP, STEPS = 1, 5
WORLDS, KS, DISPATCHERS = (2, 4), (1, 2), ("alltoall", "allgather")


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(layer, x, w, sync=True):
    times, sent, y = [], 0, None
    for i in range(WARMUP + STEPS):
        if sync:
            dist.barrier()
        with Ledger() as led:
            t0 = time.perf_counter()
            y = layer(x)
            (y * w).sum().backward()
            dt = time.perf_counter() - t0
        layer.zero_grad(set_to_none=True)
        dt = slowest(dt) if sync else dt
        if i >= WARMUP:
            times.append(dt)
            sent = led.total("sent_bytes")
    return statistics.median(times), sent, y.detach()


def worker(k):
    ep, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x_all, w_all = torch.randn(ep * T, H, generator=g), torch.randn(ep * T, H, generator=g)
    x, w = x_all.chunk(ep)[r], w_all.chunk(ep)[r]
    out = {}
    for d in DISPATCHERS:
        layer = ExpertParallelMoE(MoE(H, E, k, F, seed=1), None, d)
        seconds, sent, y = timed(layer, x, w)
        total = torch.tensor([float(sent)])
        dist.all_reduce(total)
        out[d] = {"s": seconds, "sent": sent, "mean_sent": total.item() / ep, "y": y}
    dist.barrier()
    if r == 0:
        ref = MoE(H, E, k, F, token_groups=ep, seed=1)
        out["one_process"], _, y_ref = timed(ref, x_all, w_all, sync=False)
        for d in DISPATCHERS:
            assert torch.allclose(out[d]["y"], y_ref[:T], atol=1e-5), d
    dist.barrier()
    for d in DISPATCHERS:
        del out[d]["y"]
    return out


def main():
    torch.set_num_threads(1)
    rows = []
    for world in WORLDS:
        for k in KS:
            res = run(worker, world, k, timeout=600)[0]
            for d in DISPATCHERS:
                rows.append({"name": f"ep={world} top-{k} {d}", "ep": world, "top_k": k,
                             "dispatcher": d, "step_s": round(res[d]["s"], 5),
                             "one_process_s": round(res["one_process"], 5),
                             "vs_one_process": round(res[d]["s"] / res["one_process"], 3),
                             "sent_bytes_rank0": res[d]["sent"],
                             "sent_bytes_per_rank_mean": round(res[d]["mean_sent"])})
                print(rows[-1], flush=True)
    by = {(r["ep"], r["top_k"], r["dispatcher"]): r for r in rows}
    ratios = [{"ep": ep, "top_k": k, "baseline": "allgather",
               "time_ratio": round(by[ep, k, "alltoall"]["step_s"] / by[ep, k, "allgather"]["step_s"], 3),
               "bytes_ratio": round(by[ep, k, "alltoall"]["sent_bytes_per_rank_mean"]
                                    / by[ep, k, "allgather"]["sent_bytes_per_rank_mean"], 3)}
              for ep in WORLDS for k in KS]
    write("moe", {"sizes": {"hidden": H, "n_experts": E, "expert_hidden": F, "tokens_per_rank": T,
                            "steps": STEPS},
                  "note": "one run on a shared, noisy 2-core machine: read the ratios",
                  "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
