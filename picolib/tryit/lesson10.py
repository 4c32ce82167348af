"""Lesson 10's "try it": the memory one rank of a 5-D configuration holds, and whether it fits.

    memory_budget(dp=2, tp=2, pp=2, zero=1, micro_batches=4, preset="small", budget_mb=4.0)

takes a configuration of picolib's trainer (fp32, AdamW, 1F1B; the same checks as
`python -m picolib.train`) and draws each pipeline rank's bytes — parameters, gradients,
optimizer state and the activations its schedule keeps in flight — from the planner in its
exact mode (`picolib.planner.memory`, activations="picolib"), against a budget. The busiest
rank decides whether the configuration fits. tests/test_tryit_10.py checks the state bytes
against the trainer's measured `state_bytes` and the activations against a measured forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..compose import TrainConfig, check_config
from ..flat import unique_bytes
from ..model import LlamaConfig, TinyLlama, random_tokens
from ..planner import Parallelism, memory
from . import rank_bars

__all__ = ["memory_budget", "zero_under_micro_batches"]


def zero_under_micro_batches(variants, ms=(1, 2, 4), n_layers: int = 8, rows: int = 2, seq: int = 32):
    """On each rank of a data-parallel group (call it through `picolib.launch.run`): for each
    (name, stage, reduce_every_micro_batch) of `variants` and each m of `ms`, one ZeRO step of
    m micro-batches of `rows` sequences, as a pipeline stage runs them (the last backward
    syncs). Returns {(name, m): {"peak_grad_bytes", "sent", "weights"}}: the most gradient
    bytes this rank held — the .grads, the reduced shards, and the flat buffers of
    reduce-scatters in flight — sampled after every parameter's gradient lands and after
    every backward (*measured* on the tensors' storages); the bytes sent by collective, from
    the ledger (gloo's calls: counted by the ring formula, not measured); the updated weights.
    """
    from ..zero import ZeRO
    r, out = dist.get_rank(), {}
    for (name, stage, every), m in ((v, m) for v in variants for m in ms):
        model = TinyLlama(LlamaConfig(n_layers=n_layers))
        z = ZeRO(model, stage, optimizer="adam", lr=1e-3, reduce_every_micro_batch=every)
        peak = [0]

        def sample(*_):
            held = [p.grad for p in model.parameters() if p.grad is not None]
            held += [u.grad for u in z.units] + [u.grad_full for u in z.units if u.grad_full is not None]
            held += [t for *_, flat, buf in z._pending for t in (flat, buf)]   # in flight
            peak[0] = max(peak[0], unique_bytes(held))

        for p in model.parameters():           # after ZeRO's own hook on the same gradient
            p.register_post_accumulate_grad_hook(sample)
        x, y = random_tokens(rows * m, seq, 256, seed=10 + r)
        with Ledger() as led:
            for i in range(m):
                z.set_requires_gradient_sync(i == m - 1)
                (model.loss(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) / m).backward()
                sample()
            z.step()
        sent = {op: led.total("sent_bytes", op=op) for op in ("reduce_scatter", "all_gather")}
        out[name, m] = dict(peak_grad_bytes=peak[0], sent=sent,
                            weights=torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out



def memory_budget(dp: int = 2, tp: int = 2, pp: int = 2, zero: int = 1, micro_batches: int = 4,
                  preset: str = "small", budget_mb: float = 4.0, cp: int = 1, sp: bool = False,
                  micro_batch_size: int = 1, seq: int = 64, plot: bool = True, ax=None) -> dict:
    """Per pipeline rank {"params", "grads", "optimizer", "activations", "total"} bytes
    (`ranks`) of the trainer's configuration; `busiest`: the pipeline rank with the largest
    total; `state_bytes`: the most parameter + gradient + optimizer bytes on one rank (what
    the trainer logs as state_bytes); `fits`: the busiest total ≤ budget_mb·10⁶ bytes.
    ZeRO-2/3 with m > 1 micro-batches count the whole gradient they accumulate until the
    step's last backward (the trainer logs state_bytes after the step, when it is freed).
    A configuration the trainer refuses raises its ValueError, naming the numbers."""
    cfg = TrainConfig(dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, zero=zero, micro_batches=micro_batches,
                      batch=dp * micro_batches * micro_batch_size, seq=seq, preset=preset)
    check_config(cfg)
    if budget_mb <= 0:
        raise ValueError(f"budget_mb must be positive, not {budget_mb}")
    par = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, zero=zero, micro_batches=micro_batches,
                      micro_batch_size=micro_batch_size, seq=seq, precision="fp32",
                      activations="picolib", flash=False, schedule=cfg.schedule)
    mcfg = cfg.model_config()
    ranks = [memory(mcfg, par, pp_rank=r) for r in range(pp)]
    busiest = max(range(pp), key=lambda r: ranks[r]["total"])
    peak = ranks[busiest]["total"]
    out = {"config": cfg, "ranks": ranks, "busiest": busiest, "peak": peak,
           "state_bytes": max(r["params"] + r["grads"] + r["optimizer"] for r in ranks),
           "fits": peak <= budget_mb * 1e6}
    if plot:
        dims = "×".join(f"{d}{getattr(cfg, d)}" for d in ("dp", "cp", "tp", "pp")
                        if getattr(cfg, d) > 1) or "1 rank"
        rank_bars(ranks, 1e6, "MB", budget_mb, f"budget {budget_mb:g} MB",
                  f"{preset}: {dims}, {'ZeRO-' + str(zero) if zero else 'DDP'}, m={micro_batches}"
                  f"{', sp' if sp else ''} (computed by the planner)", ax)
    b = ranks[busiest]
    print(f"busiest rank: pipeline rank {busiest} of {pp} — parameters {b['params'] / 1e6:.3f} MB, "
          f"gradients {b['grads'] / 1e6:.3f} MB, optimizer {b['optimizer'] / 1e6:.3f} MB, "
          f"activations {b['activations'] / 1e6:.3f} MB; {peak / 1e6:.3f} MB of {budget_mb:g} MB: "
          f"{'fits' if out['fits'] else 'does NOT fit'}", flush=True)
    return out
