"""ZeRO: data parallelism without the redundant copies (lesson 03).

Plain DP keeps parameters, gradients and optimizer state whole on every rank. ZeRO
(Rajbhandari et al. 2020) splits them over the N ranks of the data-parallel group:
- stage 1 shards the optimizer state: a reduce-scatter leaves each rank the mean
  gradient of its 1/N slice (started for each unit as soon as backward has produced its
  gradients), the rank updates that slice, and an all-gather hands every rank the whole
  updated model;
- stage 2 shards the gradients too: once a unit's gradient is reduce-scattered, its full
  gradient is freed; only the shard stays;
- stage 3 shards the parameters: a unit (a transformer block, or the root's leftover
  parameters) is all-gathered just before its forward and again before its backward and
  freed after each; the next unit's all-gather starts early (prefetch).

Layout. Each unit's parameters live in one flat buffer padded to a multiple of N; rank r
owns elements [r·S, (r+1)·S), S = ⌈numel/N⌉ (`shard_bounds`). The module's parameters
are views into that buffer, so one collective moves a whole unit. Stage 3 frees a
unit by resizing the buffer's storage to 0 bytes and gathers it back into the same
storage, so the views (and the tensors autograd saved) see the gathered values.

Optimizers. Each rank steps SGD, Adam or AdamW on its flat fp32 shard alone
(picolib/sharded_optim.py): they are elementwise, so the state is k bytes per owned
element. `param_dtype=torch.bfloat16` computes in bf16 and keeps an fp32 master shard
(k + 4). All communication goes through picolib.comm.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .sharded_optim import (OPTIMIZERS, init_state, optimizer_hyperparameters,
                            optimizer_state_factor, update_shard)

__all__ = ["ZeRO", "shard_bounds", "padded_numel", "unit_numels", "zero_memory_bytes",
           "zero_traffic_bytes", "optimizer_state_factor", "OPTIMIZERS"]


# --------------------------------------------------------------------------- formulas

def padded_numel(numel: int, n: int) -> int:
    """n·⌈numel/n⌉."""
    return -(-numel // n) * n


def shard_bounds(numel: int, n: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's shard of `numel` elements padded for n ranks."""
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"need n ≥ 1 and 0 ≤ rank < n; got n={n}, rank={rank}")
    size = padded_numel(numel, n) // n
    return rank * size, (rank + 1) * size


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


def unit_numels(model: nn.Module, units=None) -> list[int]:
    """Sizes of ZeRO's units of `model`: the root's own parameters, then each block's."""
    return [sum(p.numel() for _, p in named) for _, named in _split(model, units)]


def _split(model, units):
    """[(module, [(name, param)])] in forward order: root first (if it owns any), then units."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    taken, out = set(), []
    for m in list(getattr(model, "blocks", [])) if units is None else units:
        own = [(names[id(p)], p) for p in m.parameters() if id(p) in names and id(p) not in taken]
        taken.update(id(p) for _, p in own)
        out.append((m, own))
    root = [(n, p) for n, p in model.named_parameters() if id(p) in names and id(p) not in taken]
    return [(m, named) for m, named in [(model, root)] + out if named]


def _views(flat, params):
    off = 0
    for p in params:
        yield p, flat[off:off + p.numel()].view(p.shape)
        off += p.numel()


# --------------------------------------------------------------------------- a unit

class _Unit:
    """A unit's flat buffer `full` (compute dtype; the module's parameters are views into
    it), this rank's `shard` of it, the fp32 `master` shard, its gradient, its state."""

    def __init__(self, module, named, z: "ZeRO"):
        self.module, self.names, self.params = module, [n for n, _ in named], [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        lo, hi = shard_bounds(self.numel, z.n, z.rank)
        padded, dev, fp32 = padded_numel(self.numel, z.n), self.params[0].device, z.dtype == torch.float32
        flat = torch.zeros(padded, device=dev)
        torch.cat([p.detach().reshape(-1).float() for p in self.params], out=flat[:self.numel])
        comm.broadcast(flat, src=z.src, group=z.group)        # all start from rank 0's weights
        self.full = flat if fp32 else flat.to(z.dtype)
        for p, view in _views(self.full, self.params):
            p.data = view
        if z.stage < 3:   # the whole model stays; fp32 updates land in it directly
            self.shard = self.full[lo:hi]
            self.master = self.shard if fp32 else flat[lo:hi].clone()
        else:             # only the shard stays
            self.master = flat[lo:hi].clone()
            self.shard = self.master if fp32 else self.full[lo:hi].clone()
            self.free()
        if z.stage == 1:  # .grad of each parameter: a view into one persistent flat buffer
            self.grad_full = torch.zeros(padded, dtype=z.dtype, device=dev)
            for p, view in _views(self.grad_full, self.params):
                p.grad = view
            self.grad = self.grad_full[lo:hi]
        else:
            self.grad = torch.zeros(hi - lo, dtype=z.dtype, device=dev)
        self.state = init_state(z.opt, self.master, z.hp["momentum"])
        self.ready = 0          # gradients accumulated in this backward; -1 once reduced
        self.in_backward = False
        self.work = None        # (handle, issue time) of an all-gather in flight

    def free(self):
        self.full.untyped_storage().resize_(0)

    def is_free(self) -> bool:
        return self.full.untyped_storage().nbytes() == 0

    def pack_grads(self) -> torch.Tensor:
        """The gradients in one padded flat buffer (to reduce-scatter); the .grads are dropped."""
        flat = torch.zeros(self.full.numel(), dtype=self.grad.dtype, device=self.grad.device)
        for p, view in _views(flat, self.params):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = None
        return flat


# --------------------------------------------------------------------------- ZeRO

class ZeRO:
    """ZeRO(model, stage, group=None, optimizer="adam", lr=1e-3, *, param_dtype=torch.float32,
    units=None, prefetch=True, timeline=None, **hyperparameters)

    Wraps `model` — call it as usual — and is its optimizer: `loss.backward();
    zero.step(); zero.zero_grad()`; gradients are averaged over `group` (None: the default
    group). `units`: modules whose parameters make one flat buffer each — one gradient
    bucket, and in stage 3 what is gathered at once (default: `model.blocks`; the
    leftover parameters form the root unit).
    `timeline`: a picolib Timeline that gets F, B (stage 3), all_gather and reduce_scatter
    spans; a cost in `timeline.emulate` is slept, as in the timeline's cost emulation.
    One backward per step (no gradient accumulation).
    """

    def __init__(self, model: nn.Module, stage: int, group=None, optimizer: str = "adam",
                 lr: float = 1e-3, *, param_dtype=torch.float32, units=None,
                 prefetch: bool = True, timeline=None, **hyperparameters):
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
        hp = optimizer_hyperparameters(optimizer, lr, hyperparameters)
        if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be float32, bfloat16 or float16, not {param_dtype}")
        devices = sorted({str(p.device) for p in model.parameters() if p.requires_grad})
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device; found {devices}")
        if stage == 3 and getattr(getattr(model, "cfg", None), "recompute", "none") != "none":
            raise ValueError("ZeRO-3 frees parameters after forward: recompute is not supported")
        self.n = _group_size(group)   # before any collective
        self.stage, self.group, self.module, self.opt = stage, group, model, optimizer
        self.rank, self.dtype = dist.get_rank(group), param_dtype
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.prefetch, self.timeline, self.hp = prefetch, timeline, hp
        self.steps, self._pending, self._t = 0, [], 0.0
        with torch.no_grad():
            self.units = [_Unit(m, named, self) for m, named in _split(model, units)]
        self._unit_of = {p: i for i, u in enumerate(self.units) for p in u.params}
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        if stage == 3:
            for i, u in enumerate(self.units):
                u.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
                u.module.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ stage 3
    # Units in forward order: root, block 0, ..., block L-1. The root wraps the blocks: it
    # stays gathered through the whole forward and, again, the whole backward.
    def _gather(self, i: int, wait: bool):
        u = self.units[i]
        if u.work is None and u.is_free():
            u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
            u.work = (comm.all_gather(u.full, u.shard, group=self.group, async_op=True),
                      time.perf_counter())
        if wait and u.work is not None:
            (handle, t0), u.work = u.work, None
            self._wait(handle, "all_gather", t0, i)

    def _is_root(self, i: int) -> bool:
        return self.units[i].module is self.module

    def _pre_forward(self, i):
        self._gather(i, wait=True)
        if self.prefetch and i + 1 < len(self.units):
            self._gather(i + 1, wait=False)
        self._t = time.perf_counter()

    def _post_forward(self, i, out):
        if not self._is_root(i):
            self._record("F", self._t, None, unit=i)
        self.units[i].free()
        t = next((x for x in _tensors(out) if x.requires_grad), None)
        if torch.is_grad_enabled() and t is not None:   # runs when backward reaches the unit
            t.register_hook(lambda grad, i=i: self._pre_backward(i))

    def _pre_backward(self, i):
        u = self.units[i]
        if u.in_backward or u.ready < 0:
            return
        u.in_backward = True
        self._gather(i, wait=True)
        nxt = len(self.units) - 1 if self._is_root(i) else i - 1   # backward order
        if self.prefetch and nxt not in (i, -1) and not self._is_root(nxt):
            self._gather(nxt, wait=False)
        self._t = time.perf_counter()

    # ------------------------------------------------------------------ reduce-scatter
    # A unit's reduce-scatter starts as soon as backward has produced all its gradients
    # and runs while backward goes on. Stage 1 keeps the full gradient buffer (the result
    # lands in this rank's slice of it); stages 2-3 pack the gradients, free them, and keep
    # only the reduced shard.
    def _grad_ready(self, p):
        i = self._unit_of[p]
        u = self.units[i]
        if u.ready < 0:
            raise RuntimeError("ZeRO reduces each gradient once per step: call step() between "
                               "two backward passes (no gradient accumulation)")
        u.ready += 1
        if u.ready == len(u.params):
            if self.stage == 3:
                if not self._is_root(i):
                    self._record("B", self._t, None, unit=i)
                u.free()
            self._reduce(i)

    def _reduce(self, i):
        u = self.units[i]
        if self.stage == 1:
            for p, view in _views(u.grad_full, u.params):  # a .grad replaced? back in place
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
                    p.grad = view
            flat = u.grad_full
        else:
            flat = u.pack_grads()
        handle = comm.reduce_scatter(u.grad, flat, op="avg", group=self.group, async_op=True)
        self._pending.append((handle, time.perf_counter(), i, flat))
        u.ready = -1
        if self.stage > 1:
            self._drain(keep=1)   # at most two full gradient buckets alive at once

    def _drain(self, keep: int):
        while len(self._pending) > keep:
            handle, t0, i, _ = self._pending.pop(0)
            self._wait(handle, "reduce_scatter", t0, i)

    def _reduce_leftovers(self):
        for i, u in enumerate(self.units):   # units that got no gradient, in the same order
            if u.ready >= 0:
                if self.stage == 3:
                    u.free()
                self._reduce(i)

    def finish_gradient_sync(self):
        """Wait for every reduce-scatter: each rank then holds the mean gradient of its
        shard (`step()` does this itself, unit by unit)."""
        self._reduce_leftovers()
        self._drain(keep=0)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self):
        """Update this rank's shard of each unit as soon as its reduce-scatter is done,
        and (stages 1-2) start that unit's all-gather while the next unit updates."""
        self._reduce_leftovers()
        self.steps += 1
        waiting = {i for _, _, i, _ in self._pending}
        gathers = [self._update_unit(i) for i in range(len(self.units)) if i not in waiting]
        while self._pending:
            handle, t0, i, _ = self._pending.pop(0)
            self._wait(handle, "reduce_scatter", t0, i)
            gathers.append(self._update_unit(i))
        for handle, t0, i in filter(None, gathers):
            self._wait(handle, "all_gather", t0, i)

    def _update_unit(self, i):
        u = self.units[i]
        update_shard(self.opt, u.master, u.grad.float(), u.state, self.steps, **self.hp)
        if u.shard is not u.master:
            u.shard.copy_(u.master)
        u.ready, u.in_backward = 0, False
        if self.stage < 3:
            return (comm.all_gather(u.full, u.shard, group=self.group, async_op=True),
                    time.perf_counter(), i)

    def zero_grad(self):
        """Stage 1 zeroes its flat gradient buffers; stages 2-3 overwrite their shards."""
        if self.stage == 1:
            for u in self.units:
                u.grad_full.zero_()

    # ------------------------------------------------------------------ inspection
    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, measured on the tensors' storages (each once):
        parameters (the module's and the shards), gradients (the .grads and the shards),
        optimizer state (with an fp32 master when it is not the parameters themselves)."""
        params = [*self.module.parameters(), *(u.shard for u in self.units)]
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        keys = {_storage_key(t) for t in params}
        opt = [u.master for u in self.units if _storage_key(u.master) not in keys]
        return {"params": _unique_bytes(params),
                "grads": _unique_bytes(grads + [u.grad for u in self.units]),
                "optimizer": _unique_bytes(opt + [t for u in self.units for t in u.state.values()])}

    def unit_numels(self) -> list[int]:
        return [u.numel for u in self.units]

    @torch.no_grad()
    def gather_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor} of the whole model, from the masters. A collective: every
        rank of the group calls it."""
        out = {}
        for u in self.units:
            flat = torch.empty(u.full.numel(), device=u.master.device)
            comm.all_gather(flat, u.master, group=self.group)
            out.update({name: view.clone() for name, (_, view)
                        in zip(u.names, _views(flat, u.params))})
        return out

    # ------------------------------------------------------------------ timeline
    def _wait(self, handle, name, t0, i):
        entered = time.perf_counter()
        handle.wait()
        self._record(name, t0, entered, unit=i)

    def _record(self, name, t0, entered, **meta):
        """Span `name` from t0 to now (lanes: compute, gather, reduce). With an emulated
        cost it lasts max(cost, real time): sleep until t0 + cost — unless the wait began
        after t0 + cost: then the collective is drawn ending at t0 + cost."""
        tl = self.timeline
        if tl is None:
            return
        cost, end = tl.emulate.get(name), time.perf_counter()
        if cost is not None:
            if entered is not None and entered >= t0 + cost:
                end = t0 + cost
            else:
                while (left := t0 + cost - time.perf_counter()) > 0:
                    time.sleep(left)
                end = time.perf_counter()
        lane = {"all_gather": "gather", "reduce_scatter": "reduce"}.get(name, "compute")
        tl.add(name, t0, end, lane=lane, **meta)["emulated"] = cost is not None


def _group_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ZeRO needs an initialised process group "
                           "(start the ranks with picolib.launch.run or torchrun)")
    if group is dist.GroupMember.NON_GROUP_MEMBER or (group is not None and dist.get_rank(group) < 0):
        raise ValueError(f"rank {dist.get_rank()} is not in the group: it has size 0 here")
    n = dist.get_world_size(group)
    if n < 1:
        raise ValueError(f"the data-parallel group has {n} ranks; it needs at least 1")
    return n


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for x in items for t in _tensors(x)]


def _storage_key(t):
    return t.untyped_storage().data_ptr() or ("empty", id(t))


def _unique_bytes(tensors) -> int:
    return sum({_storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())
