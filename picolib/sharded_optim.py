"""Sharded units and the optimizer that steps them: what one ZeRO rank holds (lesson 03).

What:
- `ShardedUnit`: one unit's parameters (a block, or the root's leftovers) as one flat
  buffer padded to a multiple of N, this rank's shard of it, the fp32 master of the shard
  (an nn.Parameter: what the torch optimizer steps) and the shard's reduced gradient;
- `make_optimizer`, `check_elementwise`: the user's torch.optim optimizer over the masters,
  and the probe that refuses one that could not step on a flat shard;
- the formulas: bytes per rank of each ZeRO stage (`zero_memory_bytes`) and bytes sent
  per step (`zero_traffic_bytes`); `state_bytes_per_element` reads k from a live optimizer.
Why: SGD, Adam, AdamW, Adagrad, RMSprop... work element by element, so updating a slice
equals slicing the update: a rank can step on its shard alone, with no word from the other
ranks, and the state it keeps is k bytes per owned element. That is what lets ZeRO shard
the optimizer state. An optimizer that mixes elements (a norm over the whole tensor, as in
LAMB; Adafactor's row and column averages) could not step on a flat shard alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .flat import padded_numel, shard_bounds, unique_bytes, views
from .memory import storage_key

__all__ = ["NAMES", "optimizer_state_factor", "make_optimizer", "check_elementwise",
           "state_bytes_per_element", "split_units", "unit_numels", "ShardedUnit",
           "held_bytes", "zero_memory_bytes", "zero_traffic_bytes"]

# AdamW and Adam keep two fp32 tensors shaped like the parameter, SGD with momentum one
# (the planner's formula; a live optimizer's own count is `state_bytes_per_element`)
_STATE = {"sgd": ["momentum"], "adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"]}
NAMES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def optimizer_state_factor(optimizer: str, momentum: float = 0.0, master: bool = False) -> int:
    """k, optimizer bytes per parameter by formula: Adam 8, SGD 0 (4 with momentum); +4
    for an fp32 master."""
    return 4 * len([k for k in _STATE[optimizer] if k != "momentum" or momentum]) + (4 if master else 0)


def make_optimizer(optimizer, params, kwargs: dict) -> torch.optim.Optimizer:
    """`optimizer(params, **kwargs)`: a torch.optim class (or "sgd", "adam", "adamw"), or a
    factory taking the parameters; it must give a torch.optim.Optimizer."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in NAMES:
            raise ValueError(f"optimizer {optimizer!r} is not supported by name; pass a "
                             "torch.optim class (or a factory taking the parameters)")
        optimizer = NAMES[optimizer.lower()]
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim class or a factory, not {optimizer!r}")
    opt = optimizer(params, **kwargs)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(opt).__name__}, not a "
                        "torch.optim.Optimizer")
    return opt


def check_elementwise(optimizer, kwargs: dict, device="cpu") -> str:
    """Refuse an optimizer that could not step on a flat shard alone; return its name.

    A probe, not a list of names: three steps on a 4×6 tensor, once whole and once as two
    flat pieces of 10 and 14 elements (a shard boundary inside a row). An element-wise
    optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, ...) gives the same
    numbers both ways; one that needs a parameter's shape or a norm over it (Adafactor's
    factored moments, Muon's orthogonalisation, LAMB's trust ratio) gives other numbers or
    raises (LBFGS needs a closure, SparseAdam sparse gradients), and is refused. The user's
    hyperparameters are checked by the optimizer itself on the first construction."""
    with torch.device(device):    # also what the optimizer makes (its step counters), under
        return _probe(optimizer, kwargs, device)   # a caller's `with torch.device("meta")`


def _probe(optimizer, kwargs: dict, device) -> str:
    w = torch.linspace(-1.0, 1.0, 24, device=device).reshape(4, 6)
    whole = nn.Parameter(w.clone())
    parts = [nn.Parameter(w.reshape(-1)[:10].clone()), nn.Parameter(w.reshape(-1)[10:].clone())]
    first = make_optimizer(optimizer, [whole], kwargs)        # bad hyperparameters raise here
    name = type(first).__name__
    why = "it gives other values on the pieces than on the whole tensor"
    try:
        second = make_optimizer(optimizer, parts, kwargs)
        for t in range(3):
            g = torch.sin(torch.arange(24.0, device=device) * (t + 1.3)) * torch.arange(1.0, 25.0, device=device)
            whole.grad, (parts[0].grad, parts[1].grad) = g.reshape(4, 6).clone(), g.split([10, 14])
            first.step()
            second.step()
        same = torch.allclose(whole.detach().reshape(-1), torch.cat([p.detach() for p in parts]),
                              rtol=1e-5, atol=1e-7)
    except Exception as e:  # noqa: BLE001 - any failure on flat pieces means the same here
        same, why = False, f"on flat pieces it raised {type(e).__name__}: {e}"
    if not same:
        raise ValueError(f"ZeRO cannot step {name} on a flat shard: {why}. ZeRO needs an "
                         "element-wise optimizer (each element's update depends on that "
                         "element alone), e.g. torch.optim.SGD, Adam, AdamW, Adagrad or RMSprop")
    return name


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state per parameter element, read from the optimizer's state: the
    tensors shaped like their parameter (0 before the first step). The per-tensor `step`
    counters (0-dim) are not per element and are left out."""
    state = [(p, s) for g in optimizer.param_groups for p in g["params"]
             if (s := optimizer.state.get(p))]
    if not state:
        return 0
    total = {sum(t.numel() * t.element_size() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.shape == p.shape) / p.numel()
             for p, s in state}
    if len(total) != 1 or not float(next(iter(total))).is_integer():
        raise ValueError(f"the optimizer keeps uneven state per element: {sorted(total)} bytes")
    return int(total.pop())


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
    """ShardedUnit(module, named, stage, group, dtype, group_index=None)

    `full`: the flat buffer in the compute dtype, padded for N; the module's parameters
    become views into it, starting from the group's first rank's values. `shard`: this
    rank's slice; `master`: its fp32 copy as an nn.Parameter, which the torch optimizer
    steps (in fp32 stages 1-2 it shares the shard's storage); `grad`: the reduced gradient
    of the shard (ZeRO sets `master.grad` from it). `state`: the optimizer's state of the
    master (`optimizer.state[master]`). Stage 1 keeps the whole flat gradient `grad_full`
    (the .grads are views into it, `grad` its slice); stage 3 keeps only the shard and frees
    `full` between uses.

    `group_index` (one per parameter, ascending: ZeRO sorts them so): the torch param group
    each parameter belongs to. The flat buffer then holds group 0's parameters, then group
    1's, ..., and this rank's shard is cut where the groups meet: `pieces` is
    [(group, start, stop, parameter)], each parameter a view of the master over its part of
    the shard — what the optimizer steps. Without groups the one piece is the master."""

    # ---------------------------------------------------------------- the core (lesson 03 §2)
    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients as one flat buffer, padded to a multiple of N, to reduce-scatter."""
        if self.grad_full is not None:     # ZeRO-1: the .grads are views of one lasting buffer
            for p, view in views(self.grad_full, self.params):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():   # replaced by the user:
                    view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
                    p.grad = view                                             # put back in place
            return self.grad_full
        flat = torch.zeros(self.full.numel(), dtype=self.grad.dtype, device=self.grad.device)
        for p, view in views(flat, self.params):   # ZeRO-2/3: a new buffer; the .grads dropped,
            if p.grad is not None:                 # so once it is sent only the shard stays
                view.copy_(p.grad)
            p.grad = None
        return flat

    def all_gather(self, group):
        """Every rank's shard into the whole flat buffer (the parameters are views of it)."""
        if self.is_free():                 # ZeRO-3: its storage back first
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        with comm.tagged(purpose="gradients"):   # the weights' traffic: data parallelism's
            return comm.all_gather(self.full, self.shard, group=group, async_op=True)

    def free(self):
        """ZeRO-3: the whole buffer's storage released; the views (and autograd's) stay."""
        self.full.untyped_storage().resize_(0)

    # ---------------------------------------------------------------- the rest
    def __init__(self, module, named, stage: int, group, dtype, group_index=None):
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
            self.master = nn.Parameter(self.shard if fp32 else flat[lo:hi].clone())
        else:             # only the shard stays
            self.master = nn.Parameter(flat[lo:hi].clone())
            self.shard = self.master.detach() if fp32 else self.full[lo:hi].clone()
            self.free()
        if stage == 1:    # .grad of each parameter: a view into one persistent flat buffer
            self.grad_full = torch.zeros(padded, dtype=dtype, device=dev)
            for p, view in views(self.grad_full, self.params):
                p.grad = view
            self.grad = self.grad_full[lo:hi]
        else:
            self.grad_full, self.grad = None, torch.zeros(hi - lo, dtype=dtype, device=dev)
        self.optimizer = None   # set by ZeRO once the torch optimizer exists
        self.group_index = list(group_index or [0] * len(self.params))
        self.pieces, start = [], 0
        for g in sorted(set(self.group_index)) if group_index is not None else []:
            size = sum(p.numel() for p, i in zip(self.params, self.group_index) if i == g)
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                self.pieces.append((g, a - lo, b - lo, nn.Parameter(self.master.detach()[a - lo:b - lo])))
            start += size
        if group_index is None:
            self.pieces = [(0, 0, hi - lo, self.master)]
        self.starts = torch.arange(n, device=dev) * (hi - lo)   # first element of each shard
        self.ready = 0          # parameters whose gradient this backward has produced
        self.work = None        # (handle, issue time) of an all-gather in flight

    @property
    def state(self) -> dict:
        """The optimizer's state of this unit's master shard ({} before the first step).
        With param groups: the pieces' states put together, shaped like the master (a copy;
        the padding's elements are 0)."""
        if self.optimizer is None:
            return {}
        if self.pieces[0][3] is self.master:
            return self.optimizer.state.get(self.master, {})
        states = [(a, b, self.optimizer.state.get(p, {})) for _, a, b, p in self.pieces]
        out = {}
        for key, v in next((s for *_, s in states if s), {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[key] = torch.zeros(self.master.shape, dtype=v.dtype, device=v.device)
                for a, b, s in states:
                    out[key][a:b] = s[key]
            else:
                out[key] = v
        return out

    def set_piece_grads(self) -> None:
        """The pieces' .grads: views of the master's (None when it has none)."""
        for _, a, b, p in self.pieces:
            if p is not self.master:
                p.grad = None if self.master.grad is None else self.master.grad[a:b]

    def complete(self) -> bool:
        return self.ready == len(self.params)

    def is_free(self) -> bool:
        return self.full.untyped_storage().nbytes() == 0

    def shard_from_master(self) -> None:
        """After the optimizer's step, with a bf16 (or fp16) compute copy: the updated fp32
        master copied into the shard, and the master's fp32 gradient copy dropped. In fp32 the
        shard is the master: nothing to do."""
        if self.shard.data_ptr() != self.master.data_ptr():
            self.shard.copy_(self.master)
            self.master.grad = None
            self.set_piece_grads()

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
        comm.all_gather(flat, shard.detach().contiguous(), group=group)
        return {name: view.clone() for name, (_, view) in zip(self.names, views(flat, self.params))}

    def gather_master(self, group) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor}: the masters of all ranks, gathered (a collective)."""
        return self.gather(self.master, group)

    @torch.no_grad()
    def load_shard(self, tensors, target: torch.Tensor, group) -> None:
        """Copy this rank's shard of the whole `tensors` (one per parameter, in order) into
        `target` (the master, or an optimizer state shaped like it)."""
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        lo, hi = shard_bounds(self.numel, n, rank)
        flat = torch.zeros(padded_numel(self.numel, n), device=target.device)
        torch.cat([t.detach().reshape(-1).float().to(target.device) for t in tensors],
                  out=flat[:self.numel])
        target.copy_(flat[lo:hi])
        if target is self.master:      # the compute-dtype copies follow the master
            if not self.is_free():
                self.full.copy_(flat)
            if self.shard.data_ptr() != self.master.data_ptr():
                self.shard.copy_(self.master)


# --------------------------------------------------------------------------- bytes

def held_bytes(module, units) -> dict[str, int]:
    """Bytes a ZeRO rank holds now, measured on the tensors' storages (each once):
    parameters (the module's and the shards), gradients (the .grads and the shards),
    optimizer state: the fp32 master when it is not the parameters themselves, and the
    optimizer's tensors shaped like the shard (its per-tensor `step` counters, 0-dim, are
    not per element and not counted: a few bytes per unit, which the formulas leave out)."""
    params = [*module.parameters(), *(u.shard for u in units)]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    keys = {storage_key(t) for t in params}
    opt = [u.master for u in units if storage_key(u.master) not in keys]
    state = [t for u in units for t in u.state.values()
             if isinstance(t, torch.Tensor) and t.shape == u.master.shape]
    return {"params": unique_bytes(params), "grads": unique_bytes(grads + [u.grad for u in units]),
            "optimizer": unique_bytes(opt + state)}


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
