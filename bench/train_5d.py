"""The 5-D trainer (lesson 10): step time, tokens/s, state and traffic of several 5-D
configurations on 8 ranks, and picolib's ZeRO-3 × TP against PyTorch's own composition
(FSDP2 `fully_shard` over DTensor tensor parallelism) on 4 ranks, side by side.

    .venv/bin/python bench/train_5d.py           # writes bench/results/train_5d.json

Part 1, one launch of 8 gloo ranks (picolib.launch.run) whose ranks call
picolib.train.train(cfg) for each configuration in turn, ROUNDS_5D rounds of them (so a
busy neighbour on the shared machine slows every configuration alike). Every configuration
trains the "base" preset (6.4 M parameters) on the same global batch (BASE: 16 sequences
× 128 tokens of the shipped text) from the same seed. A row reports the median step time
over the steps after the first WARMUP of each training run (a step's time is the busiest
rank's, as the trainer logs it), tokens/s = tokens per step / that time, the busiest
rank's state (parameters + gradients + optimizer state, bytes after the step) and the
bytes it sent in a step (all collectives, from picolib's ledger). 8 ranks on this
machine's 2 cores oversubscribe the CPU four times over: the figures are relative
(one configuration against another, on one machine, in one run), not what any
configuration would reach on 8 devices. The dense configurations compute the same thing,
so their losses are asserted equal step by step (LOSS_TOL_5D); the experts row is a
different model.

Part 2, 4 gloo ranks, the same 2-D layout on both sides — ZeRO-3 over dp=2 × tensor
parallelism over tp=2 — on the same model, batch, sequence length, micro-batches and steps:
- picolib: picolib.train.train(TrainConfig(dp=2, tp=2, zero=3, ...));
- native:  init_device_mesh("cpu", (2, 2), ("dp", "tp")); parallelize_module over "tp"
           (q, k, v, gate, up ColwiseParallel; o, down RowwiseParallel; the embedding
           RowwiseParallel and lm_head ColwiseParallel with loss_parallel: the vocabulary
           split, as picolib does); fully_shard over "dp" on every block and on the root;
           torch.optim.AdamW (picolib's ZeRO steps AdamW with torch's defaults);
           micro-batches accumulated with set_requires_gradient_sync(False) but the last;
           no gradient clipping on either side (the trainer's --clip-grad is set to 0).
Both time the same span (barrier, forward + backward of every micro-batch, optimizer step;
the busiest rank) and log the same loss (global mean over micro-batches and replicas).
Each round trains both sides from scratch, in alternating order; its losses must agree
step by step within LOSS_TOL_SIDE, or the bench stops before writing anything. The
ratio is picolib's median step time over the native one's (lesson 10 asks ≤ 1.1).
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picolib.compose import TrainConfig  # noqa: E402
from picolib.launch import run  # noqa: E402
from _report import write  # noqa: E402
from picolib.model import TextData, TinyLlama, param_count  # noqa: E402
from picolib.train import train  # noqa: E402

BASE = TrainConfig(preset="base", batch=16, seq=128, steps=4, data="text", progress=False)
WARMUP = 2                               # first steps of each training run, left out
ROUNDS_5D = 2                            # 2 × (4 − WARMUP) = 4 timed steps per configuration
CONFIGS = [                              # (row, the degrees and options on top of BASE)
    ("dp8 (DDP)", dict(dp=8)),
    ("dp2×tp2×pp2 ZeRO-1 +SP, 1F1B, 4 micro-batches", dict(dp=2, tp=2, pp=2, sp=True, zero=1,
                                                          micro_batches=4)),
    ("dp2×cp2×tp2 (ring, zigzag)", dict(dp=2, cp=2, tp=2)),
    ("pp2×dp2×cp2, 1F1B, 4 micro-batches", dict(pp=2, dp=2, cp=2, micro_batches=4)),
    ("dp4×tp2 ZeRO-3", dict(dp=4, tp=2, zero=3)),
    ("dp4×tp2, 4 experts top-1, ep2", dict(dp=4, tp=2, experts=4, ep=2)),
]
LOSS_TOL_5D = 1e-4                       # |loss − loss of the first row|, every step, dense rows

SIDE = TrainConfig(dp=2, tp=2, zero=3, preset="base", batch=8, seq=128, micro_batches=2,
                   steps=4, data="text", progress=False, clip_grad=0.0)   # the native loop does not clip
ROUNDS = 6                               # 6 × (4 − WARMUP) = 12 timed steps per side
LOSS_TOL_SIDE = 1e-5                     # |picolib − native| per step (fp32; seen ~1e-7)
MiB = 2 ** 20


# ----------------------------------------------------------------------- the native side

def native_train(cfg: TrainConfig) -> list[dict]:
    """cfg trained with PyTorch's composition (FSDP2 over dp × DTensor TP over tp), on this
    rank; one record per step: the loss (global mean) and seconds (busiest rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel, parallelize_module)
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = TinyLlama(cfg.model_config())          # the same weights as picolib's (seed)
    parallelize_module(model, mesh["tp"], {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    # GQA: ColwiseParallel cuts wq's rows into tp blocks of whole query heads and wk's, wv's
    # into blocks of whole KV heads (base: 8 heads, 4 KV heads, tp=2 → 4 and 2 per rank);
    # query heads [4r, 4r+4) read KV heads [2r, 2r+2), the ones rank r holds. Attention
    # reshapes its projections with view(b, s, -1, head_dim) and the core takes the GQA
    # ratio from the shapes, so the module runs on the local heads as it is: no head
    # counts to adjust (torchtitan divides them by tp because its reshape names them).
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data, replica = TextData(), mesh["dp"].get_local_rank()
    records = []
    for step in range(cfg.steps):                  # the trainer's batches: dp share, micro-batches
        tokens, targets = data.batch(cfg.batch, cfg.seq, step, cfg.seed)
        xs = tokens.chunk(cfg.dp)[replica].chunk(cfg.micro_batches)
        ys = targets.chunk(cfg.dp)[replica].chunk(cfg.micro_batches)
        dist.barrier()
        t0 = time.perf_counter()
        loss = 0.0
        for i, (x, y) in enumerate(zip(xs, ys)):
            model.set_requires_gradient_sync(i == len(xs) - 1)
            with loss_parallel():
                micro = model.loss(x, y) / len(xs)
                micro.backward()
            loss += micro.item()
        opt.step()
        seconds = time.perf_counter() - t0
        opt.zero_grad()
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total)
        busiest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        records.append({"loss": total.item() / dist.get_world_size(), "seconds": busiest.item()})
    return records


def side_by_side(cfg: TrainConfig) -> dict:
    """ROUNDS rounds of both sides on this rank; every round's losses must agree."""
    warnings.filterwarnings("ignore")
    times, losses, worst = {"picolib": [], "native": []}, {}, 0.0
    for r in range(ROUNDS):
        sides = [("picolib", train), ("native", native_train)]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            records = fn(cfg)
            times[name] += [rec["seconds"] for rec in records[WARMUP:]]
            losses[name] = [rec["loss"] for rec in records]
        gap = max(abs(a - b) for a, b in zip(losses["picolib"], losses["native"], strict=True))
        if gap > LOSS_TOL_SIDE:
            raise AssertionError(f"round {r}: picolib and native losses differ by {gap:.2e} "
                                 f"(> {LOSS_TOL_SIDE}): {losses}")
        worst = max(worst, gap)
    return {"times": times, "losses": losses, "max_loss_gap": worst}


# ----------------------------------------------------------------------- part 1

def five_d(configs: list[TrainConfig]) -> list:
    """ROUNDS_5D rounds of every configuration, one after the other, on this rank: the
    configurations share whatever else the machine is doing alike."""
    warnings.filterwarnings("ignore")
    records = [[] for _ in configs]
    for _ in range(ROUNDS_5D):
        for i, cfg in enumerate(configs):
            records[i].append(train(cfg))
    return records


def five_d_rows() -> list[dict]:
    configs = [replace(BASE, **changes) for _, changes in CONFIGS]
    runs = run(five_d, 8, configs, timeout=600)[0]
    rows = []
    for (name, changes), cfg, rounds in zip(CONFIGS, configs, runs):
        times = [r["seconds"] for records in rounds for r in records[WARMUP:]]
        seconds, last = statistics.median(times), rounds[-1][-1]
        rows.append({"name": name, "config": changes, "step_s": round(seconds, 4),
                     "tokens_per_s": round(cfg.batch * cfg.seq / seconds, 1),
                     "state_bytes": last["state_bytes"],
                     "sent_bytes": sum(last["sent_bytes"].values()),
                     "sent_bytes_by_op": last["sent_bytes"],
                     "activation_bytes": last["activation_bytes"],
                     "step_times_s": [round(t, 3) for t in times],
                     "losses": [round(r["loss"], 6) for r in rounds[0]]})
        print(f"{name}: {seconds:.3f} s/step", flush=True)
    dense = [r for r in rows if "experts" not in r["config"]]
    for r in dense[1:]:
        gap = max(abs(a - b) for a, b in zip(r["losses"], dense[0]["losses"], strict=True))
        assert gap <= LOSS_TOL_5D, f"{r['name']}: loss differs from {dense[0]['name']} by {gap:.2e}"
    return rows


def main():
    t_start = time.perf_counter()
    rows = five_d_rows()
    res = run(side_by_side, SIDE.world_size, SIDE, timeout=600)[0]
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    tokens = SIDE.batch * SIDE.seq
    side = {"picolib_s": round(med["picolib"], 4), "native_s": round(med["native"], 4),
            "ratio": round(med["picolib"] / med["native"], 3),
            "picolib_tokens_per_s": round(tokens / med["picolib"], 1),
            "native_tokens_per_s": round(tokens / med["native"], 1),
            "timed_steps": len(res["times"]["picolib"]),
            "max_loss_gap": res["max_loss_gap"], "loss_tolerance": LOSS_TOL_SIDE,
            "losses": res["losses"]["picolib"],
            "picolib_step_times_s": [round(t, 3) for t in res["times"]["picolib"]],
            "native_step_times_s": [round(t, 3) for t in res["times"]["native"]],
            "config": {k: v for k, v in asdict(SIDE).items() if v != getattr(TrainConfig(), k)}}
    write("train_5d", {
        "note": "8 ranks on this machine's 2 cores oversubscribe the CPU: part 1's figures are "
                "relative (configurations against each other, one run), not 8-device speeds",
        "sizes": {"preset": BASE.preset, "params": param_count(BASE.model_config()),
                  "batch": BASE.batch, "seq": BASE.seq, "steps": BASE.steps, "warmup": WARMUP,
                  "data": BASE.data},
        "configs": rows, "side_by_side": side, "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - t_start, 1)})
    print(f"\n8 gloo ranks on 2 cores (oversubscribed: relative figures), preset {BASE.preset} "
          f"({param_count(BASE.model_config()):,} parameters), {BASE.batch}×{BASE.seq} tokens "
          f"per step, median of {ROUNDS_5D * (BASE.steps - WARMUP)} steps\n")
    print("| configuration | step ms | tokens/s | state MiB/rank | sent MiB/rank |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {1e3 * r['step_s']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['state_bytes'] / MiB:.1f} | {r['sent_bytes'] / MiB:.1f} |")
    print(f"\n4 ranks, ZeRO-3 dp2 × TP tp2, {SIDE.batch}×{SIDE.seq} tokens, "
          f"{SIDE.micro_batches} micro-batches: picolib {1e3 * side['picolib_s']:.0f} ms/step, "
          f"FSDP2 + DTensor TP {1e3 * side['native_s']:.0f} ms/step, ratio {side['ratio']:.2f} "
          f"(losses equal within {side['max_loss_gap']:.1e})")


if __name__ == "__main__":
    main()
