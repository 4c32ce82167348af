"""picolib tensor parallel (TP) and TP + sequence parallel (SP) against PyTorch's DTensor
`parallelize_module` (ColwiseParallel, RowwiseParallel, SequenceParallel), side by side
(lessons 04, 05).

    .venv/bin/python bench/tp_sp.py              # writes bench/results/tp_sp.json

One run: 2 and then 4 gloo ranks (picolib.launch.run) on this machine's CPU, each rank
holding its shard of the same TinyLlama below (same seed: the two sides start from the same
weights and their first losses are asserted equal). The batch, MB × SEQ synthetic tokens,
is the same on every rank (TP splits the model, not the batch). Rows (picolib ↔ peer):
- TP:    picolib.tensor_parallel.apply_tensor_parallel   ↔ parallelize_module: q, k, v, gate, up
         ColwiseParallel; o, down RowwiseParallel; embedding RowwiseParallel; lm_head
         ColwiseParallel with loss_parallel (vocab-parallel cross-entropy);
- TP+SP: the same with sequence_parallel=True   ↔ the same plus SequenceParallel on the
         norms, PrepareModuleInput (Shard(1) → Replicate) at attention / MLP, row outputs
         Shard(1) (the torchtitan plan).
A step is forward + backward (SP's norm-gradient sums run inside it); no optimizer, since TP
does not change it. Both sides run in the same processes in alternating rounds of ROUND
steps; a step's time is the slowest rank's; a row reports the median over the timed steps.
Saved-activation bytes: one forward under a saved-tensor hook (each storage once,
parameters excluded; a DTensor counts its local shard), rank 0.
Sizes: h=256, 8 heads / 4 KV heads (tp ≤ 4 splits KV heads, which DTensor needs),
ffn 768, 4 layers, vocab 1024, batch 4 × 256 tokens, eager attention.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picolib.launch import run  # noqa: E402
from _report import write  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, random_tokens  # noqa: E402
from picolib.tensor_parallel import apply_tensor_parallel  # noqa: E402

CFG = LlamaConfig(vocab_size=1024, hidden=256, n_layers=4, n_heads=8, n_kv_heads=4,
                  ffn_hidden=768, max_seq=256)
MB, SEQ = 4, 256
WARMUP, ROUND, ROUNDS = 1, 2, 3          # 1 + 6 timed steps per side
WORLDS = (2, 4)


# ----------------------------------------------------------------------- the contestants

def picolib_model(sp: bool):
    model = apply_tensor_parallel(TinyLlama(CFG), sequence_parallel=sp)

    def step(x, y):
        loss = model.loss(x, y)
        loss.backward()
        return loss

    return model, step, model.loss


def peer_model(sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = TinyLlama(CFG)
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        **({"norm": SequenceParallel()} if sp else {}),
    })
    for block in model.blocks:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=seq),
                "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
                "mlp.w_down": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                    desired_input_layouts=(Replicate(), None, None, None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)

    def loss_fn(x, y):
        with loss_parallel():
            return model.loss(x, y)

    def step(x, y):
        with loss_parallel():
            loss = model.loss(x, y)
            loss.backward()
        return loss

    return model, step, loss_fn


# ----------------------------------------------------------------------- measuring

def saved_bytes(model, loss_fn, x, y) -> int:
    """Bytes autograd saves during one forward (each storage once, parameters excluded)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        if isinstance(t, DTensor):
            t = t._local_tensor
        while hasattr(t, "elem") and isinstance(t.elem, torch.Tensor):   # AsyncCollectiveTensor
            t = t.elem
        return t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    params |= {local(b).untyped_storage().data_ptr() for b in model.buffers()}
    seen = {}

    def pack(t):
        t0 = local(t)
        key = t0.untyped_storage().data_ptr()
        if key not in params:
            seen.setdefault(key, t0.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(x, y)
    del loss
    return sum(seen.values())


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(sp: bool):
    warnings.filterwarnings("ignore")
    x, y = random_tokens(MB, SEQ, CFG.vocab_size, seed=0)
    sides = {"picolib": picolib_model(sp), "peer": peer_model(sp)}
    first = {}
    for name, (model, step, loss_fn) in sides.items():
        first[name] = step(x, y).item()
        model.zero_grad(set_to_none=True)
    assert abs(first["picolib"] - first["peer"]) < 1e-4, first
    times = {name: [] for name in sides}
    for r in range(WARMUP + ROUNDS):
        for name, (model, step, _) in sides.items():
            for _ in range(ROUND if r >= WARMUP else 1):
                dist.barrier()
                t0 = time.perf_counter()
                step(x, y)
                dt = slowest(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
                if r >= WARMUP:
                    times[name].append(dt)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for name, (model, _, loss_fn) in sides.items():
        out[name + "_act_bytes"] = saved_bytes(model, loss_fn, x, y)
    out["loss"] = first["picolib"]
    return out


def main():
    rows = []
    for world in WORLDS:
        for sp in (False, True):
            res = run(worker, world, sp, timeout=600)[0]
            rows.append({"name": f"{'TP+SP' if sp else 'TP'} tp={world}",
                         "picolib_s": round(res["picolib"], 5), "peer_s": round(res["peer"], 5),
                         "ratio": round(res["picolib"] / res["peer"], 3),
                         "picolib_act_bytes": res["picolib_act_bytes"],
                         "peer_act_bytes": res["peer_act_bytes"]})
            print(rows[-1], flush=True)
    write("tp_sp", {"sizes": {"cfg": CFG.__dict__, "batch": MB, "seq": SEQ}, "rows": rows})

if __name__ == "__main__":
    main()
