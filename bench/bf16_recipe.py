"""bf16 on DDP: autocast over fp32 weights against bf16 compute copies of fp32 masters (issue 49.2).

    .venv/bin/python bench/bf16_recipe.py     # bench/results/bf16_recipe.json

One one-rank process (`picolib.launch.run`, gloo on a CPU, NCCL on a GPU) holds two DDPs of
the same model, each owning an AdamW: "autocast" — fp32 weights, forward and loss under bf16
autocast, which recasts every weight on every forward (the trainer's bf16 path before issue
49); "compute copies" — `DDP(param_dtype=torch.bfloat16)`, bf16 weights stepped through fp32
masters (the trainer's bf16 path now, as ZeRO's). A step is forward, loss, backward and
`ddp.step()`. The two alternate step by step after a warm-up, so a busy neighbour slows both
alike; the result is the ratio of their median steps, from the same run.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from _report import write  # noqa: E402

from picolib.data_parallel import DDP  # noqa: E402
from picolib.launch import run  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, param_count, random_tokens  # noqa: E402

CUDA = torch.cuda.is_available()
CFG = dict(hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=768, vocab_size=512,
           attn_impl="sdpa")
BATCH, SEQ, WARMUP, STEPS = 4, 128, 3, 12


def worker():
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    cfg = LlamaConfig(**CFG)
    sides = {}
    for name, dtype in (("autocast", torch.float32), ("compute copies", torch.bfloat16)):
        model = TinyLlama(cfg).to(device)
        sides[name] = (model, DDP(model, optimizer=torch.optim.AdamW, lr=1e-4, param_dtype=dtype),
                       name == "autocast")
    x, y = (t.to(device) for t in random_tokens(BATCH, SEQ, cfg.vocab_size, seed=0))
    times = {name: [] for name in sides}
    for i in range(WARMUP + STEPS):
        for name, (model, ddp, autocast) in sides.items():
            if CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(x, y)
            loss.backward()
            ddp.step()
            ddp.zero_grad()
            if CUDA:
                torch.cuda.synchronize()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, param_count(cfg)


def main():
    steps, params = run(worker, 1, backend="nccl" if CUDA else "gloo", timeout=600)[0]
    data = {"device": torch.cuda.get_device_name(0) if CUDA else "CPU, one thread",
            "torch": torch.__version__, "cfg": CFG, "batch": BATCH, "seq": SEQ, "params": params,
            "warmup": WARMUP, "steps": STEPS, "step_s": steps,
            "ratio": steps["compute copies"] / steps["autocast"]}
    write("bf16_recipe", data)


if __name__ == "__main__":
    main()
