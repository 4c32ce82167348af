"""picolib context parallelism (lesson 06): ring attention (contiguous and zig-zag), the
all-gather K/V variant and Ulysses, against one process on the same tokens.

    .venv/bin/python bench/context_parallel.py      # writes bench/results/context_parallel.json

PyTorch's own `context_parallel` only intercepts the GPU attention kernels, so there is no
CPU peer to run beside it: the reference is the single-process TinyLlama with PyTorch's
fused attention (`attn_impl="sdpa"`, which saves no s×s scores either). One run: N = 2
and 4 gloo ranks (picolib.launch.run) on this machine's CPU, sequence 1,024 and 4,096
tokens, batch 1; every rank holds the whole model and s/N tokens. A step is forward +
backward of the loss, gradients then averaged over the N ranks (the data-parallel
all-reduce CP needs). A step's time is the slowest rank's, median of the timed steps; the
reference runs in rank 0's process while the others wait. Saved bytes: the peak of what
autograd keeps during one forward (picolib.memory.SavedActivations), the largest rank.
Sizes: h=128, 4 heads / 2 KV heads, 2 layers, ffn 384, vocab 256, fp32.
On 2 cores, 4 ranks share the cores: CP cannot be faster here; read the ratios between
the algorithms, and the bytes. Baseline of the `ratios`: the all-gather K/V variant (zig-zag)
at the same cp and sequence; ring (zig-zag) / all-gather for step time, saved bytes and the
bytes a rank sends in one forward + backward (picolib's ledger with Ledger(rings=True): the
all-gather runs on picolib's ring and is counted; sends and all-to-alls record the tensors
handed to them, `sent_bytes_measured` False).
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
from picolib.context_parallel import apply_context_parallel, shard_sequence  # noqa: E402
from picolib.data_parallel import all_reduce_gradients  # noqa: E402
from picolib.launch import run  # noqa: E402
from picolib.memory import SavedActivations  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, random_tokens  # noqa: E402
from _report import write  # noqa: E402

CFG = LlamaConfig(vocab_size=256, hidden=128, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_hidden=384, max_seq=4096)
WORLDS, SEQS = (2, 4), (1024, 4096)
VARIANTS = (("ring", "contiguous"), ("ring", "zigzag"), ("allgather", "zigzag"),
            ("ulysses", "zigzag"))
WARMUP, STEPS = 1, 3


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(step) -> float:
    times = []
    for i in range(WARMUP + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dt = slowest(time.perf_counter() - t0)
        if i >= WARMUP:
            times.append(dt)
    return statistics.median(times)


def reference(seq):
    """One process, all the tokens, fused attention: rank 0 only (the others wait)."""
    model = TinyLlama(CFG.replace(attn_impl="sdpa"))
    x, y = random_tokens(1, seq, CFG.vocab_size)

    def step():
        if dist.get_rank() == 0:
            model.loss(x, y).backward()
            model.zero_grad(set_to_none=True)

    seconds = timed(step)
    with SavedActivations() as act:
        loss = model.loss(x, y)
    return seconds, act.peak, loss.item()


def worker(seq):
    n, r = dist.get_world_size(), dist.get_rank()
    x, y = random_tokens(1, seq, CFG.vocab_size)
    ref_s, ref_bytes, ref_loss = reference(seq)
    rows = []
    for algorithm, layout in VARIANTS:
        model = apply_context_parallel(TinyLlama(CFG), None, layout=layout, algorithm=algorithm)
        xs, ys = (shard_sequence(t, layout, r, n) for t in (x, y))

        def step():
            model.loss(xs, ys).backward()
            all_reduce_gradients(model)
            model.zero_grad(set_to_none=True)

        seconds = timed(step)
        with Ledger(rings=True) as led:                  # one untimed step, bytes counted
            model.loss(xs, ys).backward()
        model.zero_grad(set_to_none=True)
        sent = torch.tensor([float(led.total("sent_bytes"))])
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        with SavedActivations() as act:
            loss = model.loss(xs, ys)
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        peak = torch.tensor([act.peak])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        assert abs(total.item() / n - ref_loss) < 1e-4, (algorithm, total.item() / n, ref_loss)
        rows.append({"algorithm": algorithm, "layout": layout, "cp": n, "seq": seq,
                     "seconds": round(seconds, 4), "vs_one_process": round(seconds / ref_s, 3),
                     "saved_bytes_per_rank": int(peak.item()), "sent_bytes_per_rank": int(sent.item()),
                     "sent_bytes_measured": all(rec.measured for rec in led.records)})
    return {"reference_s": round(ref_s, 4), "reference_saved_bytes": ref_bytes, "rows": rows}


def main():
    out = []
    for seq in SEQS:
        for world in WORLDS:
            res = run(worker, world, seq, timeout=900)[0]
            for row in res["rows"]:
                row.update(reference_s=res["reference_s"],
                           reference_saved_bytes=res["reference_saved_bytes"])
                out.append(row)
                print(row, flush=True)
    by = {(r["seq"], r["cp"], r["algorithm"], r["layout"]): r for r in out}
    ratios = []
    for seq in SEQS:
        for world in WORLDS:
            ring, ag = by[seq, world, "ring", "zigzag"], by[seq, world, "allgather", "zigzag"]
            ratios.append({"seq": seq, "cp": world, "baseline": "allgather zigzag",
                           "time_ratio": round(ring["seconds"] / ag["seconds"], 3),
                           "saved_bytes_ratio": round(ring["saved_bytes_per_rank"]
                                                      / ag["saved_bytes_per_rank"], 3),
                           "sent_bytes_ratio": round(ring["sent_bytes_per_rank"]
                                                     / ag["sent_bytes_per_rank"], 3)})
    write("context_parallel", {"sizes": {"cfg": CFG.__dict__, "batch": 1, "seqs": SEQS},
                               "note": "one run on a shared, noisy 2-core machine: read the ratios",
                               "rows": out, "ratios": ratios})


if __name__ == "__main__":
    main()
