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

from ..compose import TrainConfig, check_config
from ..planner import Parallelism, memory
from . import rank_bars

__all__ = ["memory_budget"]



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
