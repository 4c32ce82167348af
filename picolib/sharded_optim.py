"""Sharded units and shard-wise optimizers: what one ZeRO rank holds and steps (lesson 03).

What:
- `ShardedUnit`: one unit's parameters (a block, or the root's leftovers) as one flat
  buffer padded to a multiple of N, this rank's shard of it, the fp32 master of the shard,
  the shard's gradient and its optimizer state — the pieces picolib/zero.py moves;
- `update_shard`: one step of SGD, Adam or AdamW on a flat fp32 shard with its state
  (momentum, or Adam's two moments), in torch.optim's order of operations;
- the formulas: bytes per rank of each ZeRO stage (`zero_memory_bytes`) and bytes sent
  per step (`zero_traffic_bytes`).
Why: these optimizers work element by element, so updating a slice equals slicing the
update: a rank can step on its shard alone, with no word from the other ranks, and the
state it keeps is exactly k bytes per owned element (`optimizer_state_factor`). That is
what lets ZeRO shard the optimizer state. An optimizer that mixes elements (a norm over
the whole tensor, as in LAMB) could not step on a shard alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .flat import padded_numel, shard_bounds, storage_key, unique_bytes, views

__all__ = ["OPTIMIZERS", "optimizer_state_factor", "optimizer_hyperparameters",
           "init_state", "update_shard", "split_units", "unit_numels", "ShardedUnit",
           "held_bytes", "zero_memory_bytes", "zero_traffic_bytes"]

OPTIMIZERS = {"sgd": {"momentum", "weight_decay"},
              "adam": {"betas", "eps", "weight_decay"}, "adamw": {"betas", "eps", "weight_decay"}}
_STATE = {"sgd": ["momentum"], "adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"]}


def optimizer_state_factor(optimizer: str, momentum: float = 0.0, master: bool = False) -> int:
    """k, optimizer bytes per parameter: Adam 8, SGD 0 (4 with momentum); +4 for an fp32 master."""
    return 4 * len(_state_names(optimizer, momentum)) + (4 if master else 0)


def optimizer_hyperparameters(optimizer: str, lr: float, given: dict) -> dict:
    """All of `optimizer`'s hyperparameters, torch.optim's defaults where not `given`
    (AdamW: weight_decay 0.01). Unknown optimizers and hyperparameters raise, and so do
    values out of range (lr, momentum, weight_decay ≥ 0; 0 ≤ beta < 1; eps > 0)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not supported; choose one of "
                         f"{sorted(OPTIMIZERS)} (elementwise, so a shard can step alone)")
    if set(given) - OPTIMIZERS[optimizer]:
        raise TypeError(f"{optimizer} takes lr and {sorted(OPTIMIZERS[optimizer])}, "
                        f"not {sorted(set(given) - OPTIMIZERS[optimizer])}")
    hp = {"lr": lr, "momentum": 0.0, "betas": (0.9, 0.999), "eps": 1e-8,
          "weight_decay": 0.01 if optimizer == "adamw" else 0.0, **given}
    betas = hp["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), not {betas!r}")
    for name, value, rule, ok in [("lr", hp["lr"], "≥ 0", lambda v: v >= 0),
                                  ("momentum", hp["momentum"], "≥ 0", lambda v: v >= 0),
                                  ("weight_decay", hp["weight_decay"], "≥ 0", lambda v: v >= 0),
                                  ("eps", hp["eps"], "> 0", lambda v: v > 0),
                                  ("beta1", betas[0], "in [0, 1)", lambda v: 0 <= v < 1),
                                  ("beta2", betas[1], "in [0, 1)", lambda v: 0 <= v < 1)]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"{name} must be a number {rule}, not {value!r}")
    return hp


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


# --------------------------------------------------------------------------- units

def unit_numels(model: nn.Module, units=None) -> list[int]:
    """Sizes of ZeRO's units of `model`: the root's own parameters, then each block's."""
    return [sum(p.numel() for _, p in named) for _, named in split_units(model, units)]


def split_units(model, units=None):
    """ZeRO's units: [(module, [(name, param)])] in forward order — the root first (its
    leftover trainable parameters, if any), then `units` (default: `model.blocks`)."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    taken, out = set(), []
    for m in list(getattr(model, "blocks", [])) if units is None else units:
        own = [(names[id(p)], p) for p in m.parameters() if id(p) in names and id(p) not in taken]
        taken.update(id(p) for _, p in own)
        out.append((m, own))
    root = [(n, p) for n, p in model.named_parameters() if id(p) in names and id(p) not in taken]
    return [(m, named) for m, named in [(model, root)] + out if named]


class ShardedUnit:
    """ShardedUnit(module, named, stage, group, dtype, optimizer, hp)

    `full`: the flat buffer in the compute dtype, padded for N; the module's parameters
    become views into it, starting from the group's first rank's values. `shard`: this
    rank's slice; `master`: its fp32 copy (the shard itself in fp32 stages 1-2); `grad`:
    the reduced gradient of the shard; `state`: the optimizer's. Stage 1 keeps the whole
    flat gradient `grad_full` (the .grads are views into it, `grad` its slice); stage 3
    keeps only the shard and frees `full` between uses."""

    def __init__(self, module, named, stage: int, group, dtype, optimizer: str, hp: dict):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.module, self.names = module, [name for name, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        lo, hi = shard_bounds(self.numel, n, rank)
        padded, dev, fp32 = padded_numel(self.numel, n), self.params[0].device, dtype == torch.float32
        flat = torch.zeros(padded, device=dev)
        torch.cat([p.detach().reshape(-1).float() for p in self.params], out=flat[:self.numel])
        comm.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0,
                       group=group)
        self.full = flat if fp32 else flat.to(dtype)
        for p, view in views(self.full, self.params):
            p.data = view
        if stage < 3:     # the whole model stays; fp32 updates land in it directly
            self.shard = self.full[lo:hi]
            self.master = self.shard if fp32 else flat[lo:hi].clone()
        else:             # only the shard stays
            self.master = flat[lo:hi].clone()
            self.shard = self.master if fp32 else self.full[lo:hi].clone()
            self.free()
        if stage == 1:    # .grad of each parameter: a view into one persistent flat buffer
            self.grad_full = torch.zeros(padded, dtype=dtype, device=dev)
            for p, view in views(self.grad_full, self.params):
                p.grad = view
            self.grad = self.grad_full[lo:hi]
        else:
            self.grad_full, self.grad = None, torch.zeros(hi - lo, dtype=dtype, device=dev)
        self.state = init_state(optimizer, self.master, hp["momentum"])
        self.starts = torch.arange(n, device=dev) * (hi - lo)   # first element of each shard
        self.ready = 0          # parameters whose gradient this backward has produced
        self.work = None        # (handle, issue time) of an all-gather in flight

    def complete(self) -> bool:
        return self.ready == len(self.params)

    def free(self):
        self.full.untyped_storage().resize_(0)

    def is_free(self) -> bool:
        return self.full.untyped_storage().nbytes() == 0

    def start_gather(self, group):
        """Stage 3: give `full` its storage back and start filling it from all shards."""
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        return comm.all_gather(self.full, self.shard, group=group, async_op=True)

    def flat_grads(self) -> torch.Tensor:
        """The gradients in one padded flat buffer, to reduce-scatter. Stage 1: its
        persistent buffer; stages 2-3: a new one, and the .grads are dropped."""
        if self.grad_full is not None:
            for p, view in views(self.grad_full, self.params):   # a .grad replaced? back in place
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
                    p.grad = view
            return self.grad_full
        flat = torch.zeros(self.full.numel(), dtype=self.grad.dtype, device=self.grad.device)
        for p, view in views(flat, self.params):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = None
        return flat

    def zero_grad(self):
        """Stage 1 zeroes its flat gradient; stages 2-3 drop the .grads not yet reduced."""
        if self.grad_full is not None:
            self.grad_full.zero_()
            return
        for p in self.params:
            p.grad = None

    def gather(self, shard: torch.Tensor, group) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor}: a flat shard of every rank (the master, or an optimizer
        state), gathered and cut back into the parameters' shapes (a collective)."""
        flat = torch.empty(self.full.numel(), device=shard.device)
        comm.all_gather(flat, shard.contiguous(), group=group)
        return {name: view.clone() for name, (_, view) in zip(self.names, views(flat, self.params))}

    def gather_master(self, group) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor}: the masters of all ranks, gathered (a collective)."""
        return self.gather(self.master, group)

    def update(self, optimizer: str, step: int, hp: dict):
        """The optimizer step on the master shard, copied into the compute-dtype shard."""
        update_shard(optimizer, self.master, self.grad.float(), self.state, step, **hp)
        if self.shard is not self.master:
            self.shard.copy_(self.master)


# --------------------------------------------------------------------------- bytes

def held_bytes(module, units) -> dict[str, int]:
    """Bytes a ZeRO rank holds now, measured on the tensors' storages (each once):
    parameters (the module's and the shards), gradients (the .grads and the shards),
    optimizer state (with an fp32 master when it is not the parameters themselves)."""
    params = [*module.parameters(), *(u.shard for u in units)]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    keys = {storage_key(t) for t in params}
    opt = [u.master for u in units if storage_key(u.master) not in keys]
    return {"params": unique_bytes(params), "grads": unique_bytes(grads + [u.grad for u in units]),
            "optimizer": unique_bytes(opt + [t for u in units for t in u.state.values()])}


def zero_memory_bytes(stage: int, numels, n: int, k: int, param_bytes: int = 4,
                      grad_bytes: int | None = None) -> dict[str, int]:
    """Bytes per rank by formula, p = param_bytes, g = grad_bytes (default p):
    stage 0 (plain DP) (p+g+k)Ψ; ZeRO-1 pΨ + gΨ + kΨ/N; ZeRO-2 pΨ + (g+k)Ψ/N;
    ZeRO-3 (p+g+k)Ψ/N. `numels`: the units' sizes (or one int); stages 1-3 pad each unit
    to a multiple of N, so their Ψ is Σ N·⌈numel/N⌉."""
    if n < 1:
        raise ValueError(f"the group needs at least 1 rank, not {n}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DP), 1, 2 or 3, not {stage}")
    g = param_bytes if grad_bytes is None else grad_bytes
    numels = [numels] if isinstance(numels, int) else list(numels)
    full = sum(numels) if stage == 0 else sum(padded_numel(u, n) for u in numels)
    shard = full if stage == 0 else full // n
    return {"params": param_bytes * (shard if stage == 3 else full),
            "grads": g * (full if stage <= 1 else shard), "optimizer": k * shard}


def zero_traffic_bytes(stage: int, numels, n: int, elem_bytes: int = 4) -> int:
    """Bytes one rank sends per step by the ring formulas (what the ledger records). One
    "Ψ" is a reduce-scatter or all-gather of the whole (padded) model, (N−1)/N·Ψ·bytes:
    DP all-reduce 2Ψ, ZeRO-1 and -2 2Ψ (reduce-scatter + all-gather), ZeRO-3 3Ψ (two
    all-gathers + a reduce-scatter). `numels`: one entry per call (bucket or unit)."""
    numels = [numels] if isinstance(numels, int) else list(numels)
    if stage == 0:
        return sum(2 * (n - 1) * u * elem_bytes // n for u in numels)
    return (3 if stage == 3 else 2) * sum((n - 1) * padded_numel(u, n) * elem_bytes // n
                                          for u in numels)
