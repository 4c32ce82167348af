"""Shard-wise optimizers: SGD, Adam and AdamW on a flat fp32 shard (lesson 03).

What: one optimizer step on a flat fp32 tensor — in ZeRO, a rank's shard of a unit —
with its state (momentum, or Adam's two moments) as tensors of the same shape, in
torch.optim's order of operations.
Why: these optimizers work element by element, so updating a slice equals slicing the
update: a rank can step on its shard alone, with no word from the other ranks, and the
state it keeps is exactly k bytes per owned element (`optimizer_state_factor`). That is
what lets ZeRO shard the optimizer state (picolib/zero.py). An optimizer that mixes
elements (a norm over the whole tensor, as in LAMB) could not step on a shard alone.
"""
from __future__ import annotations

import torch

__all__ = ["OPTIMIZERS", "optimizer_state_factor", "optimizer_hyperparameters",
           "init_state", "update_shard"]

OPTIMIZERS = {"sgd": {"momentum", "weight_decay"},
              "adam": {"betas", "eps", "weight_decay"}, "adamw": {"betas", "eps", "weight_decay"}}
_STATE = {"sgd": ["momentum"], "adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"]}


def optimizer_state_factor(optimizer: str, momentum: float = 0.0, master: bool = False) -> int:
    """k, optimizer bytes per parameter: Adam 8, SGD 0 (4 with momentum); +4 for an fp32 master."""
    return 4 * len(_state_names(optimizer, momentum)) + (4 if master else 0)


def optimizer_hyperparameters(optimizer: str, lr: float, given: dict) -> dict:
    """All of `optimizer`'s hyperparameters, torch.optim's defaults where not `given`
    (AdamW: weight_decay 0.01). Unknown optimizers and hyperparameters raise."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not supported; choose one of "
                         f"{sorted(OPTIMIZERS)} (elementwise, so a shard can step alone)")
    if set(given) - OPTIMIZERS[optimizer]:
        raise TypeError(f"{optimizer} takes lr and {sorted(OPTIMIZERS[optimizer])}, "
                        f"not {sorted(set(given) - OPTIMIZERS[optimizer])}")
    return {"lr": lr, "momentum": 0.0, "betas": (0.9, 0.999), "eps": 1e-8,
            "weight_decay": 0.01 if optimizer == "adamw" else 0.0, **given}


def init_state(optimizer: str, shard: torch.Tensor, momentum: float = 0.0) -> dict:
    """The optimizer state of `shard`: zeros shaped like it (SGD without momentum: none)."""
    return {k: torch.zeros_like(shard) for k in _state_names(optimizer, momentum)}


def update_shard(optimizer, p, g, state, step, lr, momentum, weight_decay, betas, eps):
    """One optimizer step (number `step`, from 1) on the flat fp32 shard `p` with gradient
    `g`, in place, in torch.optim's order of operations."""
    if optimizer == "sgd":
        if weight_decay:
            g = g.add(p, alpha=weight_decay)
        if momentum:
            g = state["momentum"].mul_(momentum).add_(g)   # starts at 0: first step = g
        p.add_(g, alpha=-lr)
        return
    if weight_decay and optimizer == "adamw":
        p.mul_(1 - lr * weight_decay)
    elif weight_decay:
        g = g.add(p, alpha=weight_decay)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(g, 1 - betas[0])
    v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    denom = v.sqrt().div_((1 - betas[1] ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - betas[0] ** step))


def _state_names(optimizer, momentum):
    return [k for k in _STATE[optimizer] if k != "momentum" or momentum]
