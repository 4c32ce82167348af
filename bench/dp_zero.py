"""picolib DDP / ZeRO-1 / ZeRO-3 against their PyTorch peers, side by side (lesson 02, 03).

    .venv/bin/python bench/dp_zero.py            # writes bench/results/dp_zero.json

One run: 4 gloo ranks (picolib.launch.run) on this machine's CPU, each training the tiny
Llama below with torch.optim.AdamW (lr 1e-3) on its own micro-batch of MB × SEQ synthetic tokens.
Rows (picolib ↔ peer):
- DDP:    picolib.data_parallel.DDP (owning AdamW)    ↔ torch.nn.parallel.DistributedDataParallel
- ZeRO-1: picolib.zero.ZeRO(stage=1, optimizer=AdamW) ↔ torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW)
- ZeRO-3: picolib.zero.ZeRO(stage=3, optimizer=AdamW), blocks + root ↔ FSDP2 fully_shard on every
  block and the root, torch.optim.AdamW
Every side steps the same torch.optim.AdamW (picolib's ZeRO on its flat fp32 shards).
Both sides of a row run in the same processes, in alternating rounds of ROUND steps
(picolib, peer, picolib, ...), so a busy neighbour on the shared machine slows both.
A step is forward + backward + optimizer step; its time is the slowest rank's, and a
row reports the median over TIMED steps after WARMUP. Peak bytes: one extra step under
torch.distributed._tools.mem_tracker.MemTracker (every tensor storage created or resized
during the step plus the model, gradients and optimizer state; rank 0; the allocator's
caching is not included). It cannot see allocations made inside C++ components: torch
DDP's reducer buckets (a flat copy of all gradients, 4Ψ = 2.6 MB here, also under the
ZeRO-1 peer) are missing from the peer's bytes, while picolib's buckets are counted.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picolib.data_parallel import DDP  # noqa: E402
from picolib.launch import run  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, param_count, random_tokens  # noqa: E402
from picolib.zero import ZeRO  # noqa: E402

WORLD = 4
CFG = LlamaConfig(vocab_size=256, hidden=128, n_layers=4, n_heads=4, n_kv_heads=2,
                  ffn_hidden=256, max_seq=128, attn_impl="sdpa")   # 656,512 parameters
MB, SEQ = 4, 128
LR = 1e-3
BUCKET = 2**20                           # picolib DDP bucket cap (torch: 1 MiB first bucket, then 25 MiB)
WARMUP, ROUND, ROUNDS = 2, 2, 8          # 2 + 16 timed steps per side
OUT = ROOT / "bench" / "results" / "dp_zero.json"


# ----------------------------------------------------------------------- the contestants

def picolib_ddp():
    model = DDP(TinyLlama(CFG), bucket_cap_bytes=BUCKET, optimizer=torch.optim.AdamW, lr=LR)

    def step(x, y):
        model.module.loss(x, y).backward()
        model.step()
        model.zero_grad()
    return step, [model.module, model.optimizer, *(b.buffer for b in model.buckets)]


def torch_ddp():
    model = torch.nn.parallel.DistributedDataParallel(TinyLlama(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y):   # TinyLlama.loss, through the wrapper's forward (DDP's hooks need it)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step, [model.module, opt]


def picolib_zero(stage):
    def make():
        model = TinyLlama(CFG)
        zero = ZeRO(model, stage, optimizer=torch.optim.AdamW, lr=LR)

        def step(x, y):
            model.loss(x, y).backward()
            zero.step()
            zero.zero_grad()
        held = [model, zero.optimizer] + [t for u in zero.units for t in
                                          (u.full, u.master, u.shard, u.grad)]
        return step, held
    return make


def torch_zero1():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = torch.nn.parallel.DistributedDataParallel(TinyLlama(CFG))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

    def step(x, y):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step, [model.module, opt.optim]   # the shard's state lives in the inner AdamW


def torch_fsdp2():
    from torch.distributed.fsdp import fully_shard
    model = TinyLlama(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y):
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    return step, [model, opt]


ROWS = [("DDP", picolib_ddp, torch_ddp),
        ("ZeRO-1", picolib_zero(1), torch_zero1),
        ("ZeRO-3", picolib_zero(3), torch_fsdp2)]


# ----------------------------------------------------------------------- measuring

def _timed(step, x, y, n):
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        out.append(time.perf_counter() - t0)
    return out


def _peak_bytes(step, held, x, y) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*held)
    with tracker:
        step(x, y)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def worker(row: int):
    warnings.filterwarnings("ignore")
    name, make_ours, make_peer = ROWS[row]
    rank = dist.get_rank()
    x, y = random_tokens(MB, SEQ, CFG.vocab_size, seed=rank)
    sides = {"picolib": make_ours(), "peer": make_peer()}
    times = {k: [] for k in sides}
    for k, (step, _) in sides.items():
        _timed(step, x, y, WARMUP)
    for _ in range(ROUNDS):
        for k, (step, _) in sides.items():
            times[k] += _timed(step, x, y, ROUND)
    peaks = {k: _peak_bytes(step, held, x, y) for k, (step, held) in sides.items()}
    return times, peaks


def main():
    rows = []
    for i, (name, _, _) in enumerate(ROWS):
        per_rank = run(worker, WORLD, i, timeout=600)
        res = {}
        for side in ("picolib", "peer"):
            slowest = [max(r[0][side][s] for r in per_rank) for s in range(ROUND * ROUNDS)]
            res[side] = (statistics.median(slowest), per_rank[0][1][side])
        rows.append({"name": name, "picolib_s": round(res["picolib"][0], 5),
                     "peer_s": round(res["peer"][0], 5),
                     "ratio": round(res["picolib"][0] / res["peer"][0], 3),
                     "picolib_bytes": res["picolib"][1], "peer_bytes": res["peer"][1]})
        print(rows[-1], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.update(world_size=WORLD, params=param_count(CFG), tokens_per_rank=MB * SEQ,
                 timed_steps=ROUND * ROUNDS, torch=torch.__version__)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{WORLD} gloo ranks, tiny Llama {param_count(CFG):,} parameters, "
          f"{MB}×{SEQ} tokens per rank, torch.optim.AdamW\n")
    print("| row | picolib s | peer s | ratio | picolib peak bytes | peer peak bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['picolib_s']:.4f} | {r['peer_s']:.4f} | {r['ratio']:.2f} "
              f"| {r['picolib_bytes']:,} | {r['peer_bytes']:,} |")


if __name__ == "__main__":
    main()
