"""Data parallelism: every rank holds the whole model and averages its gradients (lesson 02).

Each rank of the data-parallel group runs forward and backward on its own micro-batch;
an all-reduce then averages the gradients, so every rank takes the same optimizer step
and the replicas stay identical. With mbs samples per rank, grad_acc accumulated
micro-batches and dp ranks, one step sees gbs = mbs × grad_acc × dp samples.

Two versions, as in the lesson:
- `all_reduce_gradients(model, group)` — naive DP: after backward, one all-reduce per
  gradient; the ranks sit idle while it runs.
- `DistributedDataParallel` (`DDP`) — what torch's DDP does, in readable form:
  1. broadcast: the replicas start from the first rank's weights;
  2. buckets: the gradients live in a few flat buffers (`.grad` is a view into one),
     filled in reverse parameter order, about the order backward produces them, so a
     bucket is one all-reduce instead of one per parameter;
  3. overlap: a hook on each parameter counts the gradients that are ready; when a
     bucket is complete its all-reduce starts asynchronously while backward goes on;
  4. one wait at the end of backward (an autograd callback), so the gradients are
     averaged when `loss.backward()` returns and the optimizer can step;
  5. `no_sync()`: accumulation steps skip the communication; gradients add up in the
     buckets and the next synchronised backward averages the sum.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm

__all__ = ["all_reduce_gradients", "assign_buckets", "DistributedDataParallel", "DDP",
           "DEFAULT_BUCKET_CAP_BYTES"]

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20  # torch's default bucket_cap_mb=25


def _group_size(group) -> int:
    """Size of `group`, with a clear error when there is no group this rank belongs to."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("data parallelism needs an initialised process group "
                           "(start the ranks with picolib.launch.run or torchrun)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the data-parallel group")
    if group is not None and dist.get_rank(group) < 0:
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(f"rank {dist.get_rank()} is not in the data-parallel group {ranks}")
    n = dist.get_world_size(group)
    if n < 1:
        raise ValueError(f"the data-parallel group has {n} ranks; it needs at least 1")
    return n


# --------------------------------------------------------------------------- naive DP

def all_reduce_gradients(model: nn.Module, group=None) -> None:
    """Naive DP: after backward, replace every gradient by its mean over the group.

    One all-reduce per parameter, none of them overlapped with compute. Parameters
    without a gradient take part with zeros, so every rank calls the same collectives."""
    n = _group_size(group)
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(n)
        comm.all_reduce(p.grad, group=group)


# --------------------------------------------------------------------------- buckets

def assign_buckets(nbytes: list[int], cap: int) -> list[list[int]]:
    """Split tensors of `nbytes` (in the order given) into consecutive buckets of at most
    `cap` bytes. A bucket closes when the next tensor would push it past the cap; a tensor
    larger than the cap gets a bucket of its own. Returns lists of indices.

    >>> assign_buckets([4, 4, 4, 10, 2], cap=8)
    [[0, 1], [2], [3], [4]]
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
        raise ValueError(f"bucket cap must be a positive number of bytes, not {cap!r}")
    buckets: list[list[int]] = []
    size = 0
    for i, b in enumerate(nbytes):
        if buckets and buckets[-1] and size + b <= cap:
            buckets[-1].append(i)
            size += b
        else:
            buckets.append([i])
            size = b
    return buckets


class _Bucket:
    """A flat gradient buffer for a few parameters; their `.grad`s are views into it."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str]):
        self.index, self.params, self.names = index, params, names
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)    # gradients still to come in this backward
        self.work = None               # the async all-reduce in flight
        self.issued = 0.0              # perf_counter() when it was issued
        self.done = None               # first time it was seen complete

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


# --------------------------------------------------------------------------- DDP

class DistributedDataParallel(nn.Module):
    """Wrap `module` so that backward averages its gradients over `group` (lesson 02).

    DDP(module, group=None, bucket_cap_bytes=25 MiB, overlap=True, timeline=None)

    - the first rank of `group` broadcasts its parameters and buffers at construction;
    - gradients go into flat buckets (≤ bucket_cap_bytes, reverse parameter order); with
      `overlap=True` a bucket's all-reduce starts as soon as its last gradient is ready,
      with `overlap=False` all buckets start after backward (the naive schedule);
    - when `loss.backward()` returns, the gradients are averaged (an autograd callback
      waits for the all-reduces); `finish_gradient_sync()` does the same by hand and is
      a no-op when there is nothing to wait for;
    - `with ddp.no_sync():` backward accumulates without communicating;
    - `timeline`: a picolib.timeline.Timeline; each bucket's all-reduce is recorded as
      span "all_reduce" on lane "comm" (meta: bucket, issued), from issue to the first
      moment the rank saw it complete (polled at each gradient hook and at the wait: an
      upper bound). If the timeline has a cost for "all_reduce" (`emulate={"all_reduce":
      s}`), the link is emulated instead: each all-reduce occupies it for s seconds from
      its issue or the end of the previous one, whichever is later; the span shows that
      time, and the wait sleeps until the emulated link is idle (the real all-reduces
      are waited for too).

    Call `ddp(x)` or `ddp.module.<method>(...)`: the forward pass itself is not changed.
    """

    def __init__(self, module: nn.Module, group=None,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, overlap: bool = True,
                 timeline=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, not {type(module).__name__}")
        if isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int):
            raise TypeError(f"bucket_cap_bytes must be an int, not {bucket_cap_bytes!r}")
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be > 0, not {bucket_cap_bytes}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require a gradient")
        devices = sorted({str(p.device) for _, p in named})
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device; found {devices}")
        self.world = _group_size(group)  # raises before any collective
        self.module, self.group = module, group
        self.bucket_cap_bytes, self.overlap, self.timeline = bucket_cap_bytes, overlap, timeline
        self._broadcast_from_first_rank()

        # backward produces gradients roughly from the last layer to the first
        named = named[::-1]
        self.buckets: list[_Bucket] = []
        for dtype in dict.fromkeys(p.dtype for _, p in named):  # one dtype per buffer
            same = [(n, p) for n, p in named if p.dtype == dtype]
            sizes = [p.numel() * p.element_size() for _, p in same]
            for idx in assign_buckets(sizes, bucket_cap_bytes):
                self.buckets.append(_Bucket(len(self.buckets), [same[i][1] for i in idx],
                                            [same[i][0] for i in idx]))
        self._slot = {}  # parameter → (bucket, view)
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._slot[p] = (b, view)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for b in self.buckets for p in b.params]
        self._sync = True
        self._in_backward = False     # a synchronised backward is under way
        self._next = 0                # the next bucket to issue (same order on every rank)
        self._link_free = 0.0         # emulated link: when the previous all-reduce ends

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _broadcast_from_first_rank(self):
        tensors = [p for p in self.module.parameters()] + [b for b in self.module.buffers()]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            comm.broadcast(flat, src=src, group=self.group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ------------------------------------------------------------------ hooks

    def _grad_ready(self, p: torch.Tensor):
        """Runs after autograd has accumulated p.grad (once per parameter per backward)."""
        bucket, view = self._slot[p]
        if p.grad.data_ptr() != view.data_ptr():  # zero_grad(set_to_none=True) dropped it
            view.copy_(p.grad)
            p.grad = view
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)
        bucket.pending -= 1
        if self.timeline is not None:
            self._poll()
        if self.overlap:  # in bucket order, so that every rank issues the same sequence
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._issue(self.buckets[self._next])

    def _issue(self, bucket: _Bucket):
        bucket.buffer.div_(self.world)  # sum of (grad / N) = mean
        bucket.issued = time.perf_counter()
        bucket.work = comm.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._next += 1

    def _poll(self):
        now = None
        for b in self.buckets[:self._next]:
            if b.work is not None and b.done is None and b.work.is_completed():
                b.done = now = now or time.perf_counter()

    # ------------------------------------------------------------------ public

    def finish_gradient_sync(self):
        """Issue the buckets not yet issued, wait for every all-reduce, reset for the next
        backward. Runs by itself at the end of a synchronised backward."""
        if not self._in_backward:
            return
        for b in self.buckets[self._next:]:
            for p, view in zip(b.params, b.views):
                if p.grad is None:  # a parameter that got no gradient this step
                    view.zero_()
                    p.grad = view
            self._issue(b)
        emulate = self.timeline.emulate.get("all_reduce") if self.timeline is not None else None
        for b in self.buckets:
            b.work.wait()
            if b.done is None:
                b.done = time.perf_counter()
            if self.timeline is not None:
                start, end = b.issued, b.done
                if emulate is not None:  # the emulated link, one all-reduce after the other
                    start = max(b.issued, self._link_free)
                    end = self._link_free = start + emulate
                ev = self.timeline.add("all_reduce", start, end, lane="comm", bucket=b.index,
                                       issued=b.issued, label=f"AR{b.index}")
                ev["emulated"] = emulate is not None
            b.work, b.done, b.pending = None, None, len(b.params)
        if emulate is not None:
            while (left := self._link_free - time.perf_counter()) > 0:
                time.sleep(left)
        self._next, self._in_backward = 0, False

    @contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients without any all-reduce."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def bucket_names(self) -> list[list[str]]:
        """Parameter names in each bucket, in the order the buckets are all-reduced."""
        return [list(b.names) for b in self.buckets]

    def bucket_bytes(self) -> list[int]:
        return [b.nbytes for b in self.buckets]


DDP = DistributedDataParallel
