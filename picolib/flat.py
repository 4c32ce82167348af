"""Flat buffers and the checks the data-parallel wrappers share (lessons 02-03).

What: the pieces DDP (picolib/data_parallel.py) and ZeRO (picolib/zero.py) both use —
- `group_size`: the size of the data-parallel group, with a clear error when this rank
  has no group (checked before any collective);
- `views`: many tensors as one flat buffer — the tensors become views into it, so one
  collective moves them all;
- `padded_numel`, `shard_bounds`: ZeRO's layout, a buffer padded to a multiple of N and
  cut into N equal shards;
- `broadcast_from_first_rank`: the replicas start from the group's first rank's values;
- `unique_bytes`: bytes of tensor storage, each storage once (views share one);
- `is_finite`, `check_finite`: after a gradient reduction, every rank raises together
  when a gradient is NaN or inf, naming the ranks whose own gradient was non-finite;
- `GradientSyncSwitch`: `no_sync()` and `set_requires_gradient_sync(flag)`, the one
  switch both wrappers give to a training loop or a pipeline executor, and
  `register_sync_hook`, which tells a caller each time it is set;
- `Held`, `Holdings`: what a wrapper's `holdings()` answers — per parameter, the elements
  this rank holds and answers for, with views of its values, gradient and optimizer state
  (checkpoints and gradient clipping read them; neither asks which wrapper it holds).
Why: one home for each, so the two wrappers cannot drift apart.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm
from .memory import storage_key

__all__ = ["group_size", "views", "padded_numel", "shard_bounds", "broadcast_from_first_rank",
           "unique_bytes", "is_finite", "check_finite", "GradientSyncSwitch",
           "STATE", "Held", "Holdings", "fresh_state", "own_range"]


def group_size(group) -> int:
    """Size of the data-parallel `group` (None: the default group); raises if there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("data parallelism needs an initialised process group "
                           "(start the ranks with picolib.launch.run or torchrun)")
    if group is dist.GroupMember.NON_GROUP_MEMBER or (group is not None and dist.get_rank(group) < 0):
        ranks = "" if group is dist.GroupMember.NON_GROUP_MEMBER else f" {dist.get_process_group_ranks(group)}"
        raise ValueError(f"rank {dist.get_rank()} is not a member of the data-parallel "
                         f"group{ranks}: it has size 0 here")
    n = dist.get_world_size(group)
    if n < 1:
        raise ValueError(f"the data-parallel group has {n} ranks; it needs at least 1")
    return n


def views(flat: torch.Tensor, tensors):
    """(tensor, view) pairs: consecutive slices of `flat`, shaped like each tensor."""
    offset = 0
    for t in tensors:
        yield t, flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()


def padded_numel(numel: int, n: int) -> int:
    """n·⌈numel/n⌉."""
    return -(-numel // n) * n


def shard_bounds(numel: int, n: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's shard of `numel` elements padded for n ranks."""
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"need n ≥ 1 and 0 ≤ rank < n; got n={n}, rank={rank}")
    size = padded_numel(numel, n) // n
    return rank * size, (rank + 1) * size


@torch.no_grad()
def broadcast_from_first_rank(tensors, group=None) -> None:
    """Overwrite `tensors` with the group's first rank's values: one broadcast per dtype."""
    tensors = list(tensors)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        comm.broadcast(flat, src=src, group=group)
        for t, view in views(flat, same):
            t.copy_(view)


def unique_bytes(tensors) -> int:
    """Bytes of the tensors' storages, each storage counted once."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def is_finite(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor: no NaN or inf in `t`. Its smallest and largest elements tell (a NaN
    becomes both), in one pass and without a mask the size of `t`. A meta tensor (the dry
    run) has no values: finite, on the CPU, so that every check that reads it goes on."""
    if t.is_meta:
        return torch.tensor(True)
    return torch.isfinite(torch.stack(torch.aminmax(t))).all()


def check_finite(reduced, local_bad: torch.Tensor, step: int, group=None,
                 collective: str = "reduction") -> None:
    """Raise FloatingPointError on every rank if a reduced gradient is NaN or inf.

    `reduced`: this rank's tensors after the reduction; the caller makes sure that every
    rank reaches the same verdict on them (an all-reduce leaves the same values
    everywhere; ZeRO marks every shard). `local_bad`: a bool tensor, True if this rank's
    own gradient was non-finite before the reduction. A healthy step costs no
    communication; only when the verdict is "not finite" does one small all-reduce tell
    every rank whose gradient it was."""
    if torch.stack([is_finite(t) for t in reduced]).all():
        return
    n, me = dist.get_world_size(group), dist.get_rank(group)
    mask = torch.zeros(n, device=local_bad.device)
    mask[me] = local_bad.float()
    comm.all_reduce(mask, group=group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r
             for r in mask.nonzero().flatten().tolist()]
    culprit = (f"the local gradient was non-finite on rank{'s' * (len(ranks) > 1)} "
               f"{', '.join(map(str, ranks))}" if ranks
               else "no rank's local gradient was non-finite: their sum overflowed")
    raise FloatingPointError(f"step {step}: a gradient is NaN or inf after the {collective}; "
                             f"{culprit}. Nothing was updated; zero the gradients and go on, "
                             "or lower the learning rate")


class GradientSyncSwitch:
    """For a data-parallel wrapper whose backward hooks read `self._sync`: True (the
    default) — this backward is the step's last and communicates; False — it only
    accumulates the gradients, through autograd."""

    _sync = True

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Say whether the next backward passes are the step's last (FSDP2's name; a
        pipeline executor calls it before a micro-batch's backward)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, not {requires_gradient_sync!r}")
        for hook in list(self.__dict__.get("_sync_hooks", {}).values()):
            hook(self, requires_gradient_sync)
        self._sync = requires_gradient_sync

    def register_sync_hook(self, hook):
        """Call `hook(wrapper, requires_gradient_sync)` each time the switch is set (before
        each backward of a pipeline's micro-batches, on entering and leaving `no_sync`): the
        dry run samples the gradients held there. Returns a handle; `.remove()` unhooks it."""
        from collections import OrderedDict

        from torch.utils.hooks import RemovableHandle
        hooks = self.__dict__.setdefault("_sync_hooks", OrderedDict())   # a handle refers to it weakly
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    @contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients without communicating."""
        before = self._sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)


# --------------------------------------------------------------------------- what a wrapper holds

STATE = ("exp_avg", "exp_avg_sq")     # AdamW's state shaped like its parameter


@dataclass
class Held:
    """One parameter on this rank: the elements [lo, hi) of its flattened local tensor that
    this rank holds (its optimizer updates them), [own_lo, own_hi) ⊆ [lo, hi) the ones it
    answers for (each element of the box on exactly one of the replicas), and flat views of
    the held range: fp32 master `value`, reduced `grad` (None before a backward) and the
    optimizer `state` {exp_avg, exp_avg_sq}."""
    name: str
    lo: int
    hi: int
    own_lo: int
    own_hi: int
    value: torch.Tensor
    grad: torch.Tensor | None
    state: dict = field(default_factory=dict)


class Holdings:
    """What one data-parallel wrapper (DDP with its torch.optim optimizer, or ZeRO) holds:
    `items` (one `Held` per parameter), the optimizer's `step`, and `after_load()`, which
    makes the wrapper's other copies agree with values written into the `Held` views."""

    def __init__(self, items, get_step, set_step, after_load):
        self.items, self._get, self._set, self.after_load = items, get_step, set_step, after_load

    @property
    def step(self) -> int:
        return self._get()

    @step.setter
    def step(self, n: int):
        self._set(n)


def own_range(n: int, r: int, lo: int, hi: int) -> tuple[int, int]:
    """The part of [lo, hi) replica r of n answers for (ZeRO's shard bounds over the range)."""
    a, b = shard_bounds(hi - lo, n, r)
    return lo + min(a, hi - lo), lo + min(b, hi - lo)


def fresh_state(optimizer, p, create: bool = True) -> dict:
    """`optimizer.state[p]`; with `create`, made as AdamW's first step would (zeros, step 0)
    where absent, so a checkpoint can be loaded into it; without, {} where absent."""
    if not create:
        return {} if optimizer is None else optimizer.state.get(p, {})
    st = optimizer.state[p]
    if "exp_avg" not in st:
        st.update(step=torch.tensor(0.0), **{k: torch.zeros_like(p) for k in STATE})
    return st
