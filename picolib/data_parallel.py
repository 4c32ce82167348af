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
  5. `no_sync()` (or `set_requires_gradient_sync(False)`, FSDP2's name; the switch is
     shared with ZeRO, picolib/flat.py): accumulation steps skip the communication;
     gradients add up in the buckets and the next synchronised backward averages the sum;
  6. a NaN or inf gradient makes every rank raise FloatingPointError at the end of that
     backward, naming the ranks whose own gradient it was (picolib/flat.py);
  7. `groups={param: group}`: parameters whose holders are another set of ranks than
     `group` — an expert's edp ranks (fewer, lesson 09), a DualPipe stage's pair × dp × cp
     (more, lesson 07) — are summed over their own group and still divided by the size of
     `group` (the data shards): one rule for both.

The data-parallel contract, shared with ZeRO (picolib/zero.py), so that a training loop,
the trainer and checkpoints never ask which one they hold: `step()`, `zero_grad()`,
`no_sync()`, `finish_gradient_sync()`, `memory()` → {"params", "grads", "optimizer"} bytes,
`state_dict()` / `load_state_dict()` with whole tensors under the model's own names. For
that, DDP may own its optimizer: `DDP(model, group, optimizer=torch.optim.AdamW, lr=1e-3)`;
without one, step your own torch optimizer as before. Mixed precision is ZeRO's recipe
(picolib/zero.py): `param_dtype=torch.bfloat16` makes the module's parameters bf16 compute
copies of fp32 masters, which the owned optimizer steps; the gradients are accumulated and
all-reduced in bf16 (as ZeRO reduce-scatters them), turned fp32 onto the masters once per
step, and the updated masters are copied back into the compute copies. Nothing is recast
per forward (autocast would recast every fp32 weight on every forward).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .flat import (STATE, GradientSyncSwitch, Held, Holdings, broadcast_from_first_rank,
                   check_finite, fresh_state, group_size, is_finite, own_range, unique_bytes, views)
from .sharded_optim import make_optimizer

__all__ = ["all_reduce_gradients", "assign_buckets", "DistributedDataParallel", "DDP",
           "DEFAULT_BUCKET_CAP_BYTES"]

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20  # torch's default bucket_cap_mb=25

# The core, read in lesson 02: naive DP, then DDP's hook, launch and wait. The machinery
# (constructing the buckets, no_sync, NaN checks, the timeline, the owned optimizer) follows.


# --------------------------------------------------------------------------- naive DP

def all_reduce_gradients(model: nn.Module, group=None) -> None:
    """Naive DP: after backward, replace every gradient by its mean over the group, one
    all-reduce per parameter, none of them overlapped with compute."""
    n = group_size(group)
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:       # take part with zeros: every rank calls the same collectives
            p.grad = torch.zeros_like(p)
        p.grad.div_(n)
        with comm.tagged(purpose="gradients"):
            comm.all_reduce(p.grad, group=group)


# --------------------------------------------------------------------------- DDP

class DistributedDataParallel(GradientSyncSwitch, nn.Module):
    """Wrap `module` so that backward averages its gradients over `group`, bucket by bucket,
    while backward runs (lesson 02; the arguments: `__init__`). Call the forward through the
    wrapper, `ddp(x)`, as PyTorch's DistributedDataParallel requires."""

    def _grad_ready(self, p: nn.Parameter):
        """The hook autograd runs on p once p.grad holds this backward's gradient."""
        bucket = self._bucket_of(p)
        if not self._sync:               # inside no_sync(): accumulate, send nothing
            self._unsynced = True
            return
        if not self._in_backward:        # this backward's first gradient: wait at its end
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)
        bucket.pending -= 1
        self._poll()                     # (timeline only: which all-reduces have completed)
        # launch every full bucket, in bucket order: each rank issues the same sequence
        while (self.overlap and self._next < len(self.buckets)
               and self.buckets[self._next].pending == 0):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: "_Bucket"):
        """Start the bucket's all-reduce without waiting for it: backward goes on meanwhile."""
        self._before_launch(bucket)      # zeros for absent gradients; notes for errors, timeline
        bucket.buffer.div_(self.world)   # every rank adds grad / N: the sum is the mean
        group = self.group if bucket.group is None else bucket.group   # (experts: their own)
        with comm.tagged(purpose="gradients"):
            bucket.work = comm.all_reduce(bucket.buffer, group=group, async_op=True)
        self._next += 1

    def finish_gradient_sync(self):
        """The wait before the step: runs by itself at the end of a synchronised backward
        (the callback `_grad_ready` queued); `step` calls it too."""
        if not self._sync_due():
            return
        for bucket in self.buckets[self._next:]:     # overlap=False: every bucket, now
            self._launch(bucket)
        if self.timeline is None:
            for bucket in self.buckets:              # in the order they were launched
                bucket.work.wait()
        else:
            self._wait_on_timeline()
        self._after_sync()

    # ------------------------------------------------------------------ the machinery

    def __init__(self, module: nn.Module, group=None,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, overlap: bool = True,
                 timeline=None, groups: dict | None = None, optimizer=None,
                 param_groups=None, param_dtype=torch.float32, **optimizer_kwargs):
        """DDP(module, group=None, bucket_cap_bytes=25 MiB, overlap=True, timeline=None,
            groups=None, optimizer=None, **optimizer_kwargs)

        - the first rank of `group` broadcasts its parameters and buffers at construction;
        - gradients go into flat buckets (≤ bucket_cap_bytes, reverse parameter order); with
          `overlap=True` a bucket's all-reduce starts as soon as its last gradient is ready,
          with `overlap=False` all buckets start after backward (the naive schedule);
        - when `loss.backward()` returns, the gradients are averaged (an autograd callback
          waits for the all-reduces); `finish_gradient_sync()` does the same by hand and is
          a no-op when there is nothing to wait for;
        - `with ddp.no_sync():` backward accumulates without communicating; so does every
          backward after `ddp.set_requires_gradient_sync(False)`, until it is set True again;
        - a synchronised backward whose averaged gradients hold a NaN or inf raises
          FloatingPointError on every rank (step = `ddp.syncs`, the synchronised backwards);
        - `timeline`: a picolib.timeline.Timeline; each bucket's all-reduce is a span
          "all_reduce" on lane "comm" (meta: bucket, issued) from the moment the last rank
          issued it (agreed by one small op-max all-reduce per synchronised backward) to the
          first moment this rank saw it complete; with a cost for "all_reduce" the timeline's
          emulated link carries them in turn instead (`_wait_on_timeline`). The ranks share
          one clock (`time.perf_counter`) on one machine only.
        - `groups`: {parameter: process group} for parameters replicated on only some of the
          ranks (experts: their edp group, `picolib.expert_parallel.expert_gradient_groups`).
          Their buckets all-reduce over that group, still divided by the size of `group`
          (each replica's gradient already sums the tokens of the ranks it served); they are
          broadcast from that group's first rank. With `groups`, a step's finite-check adds one
          one-element all-reduce over `group`, so every rank reaches the same verdict.
        - `optimizer`: a torch.optim class (`optimizer(params, **optimizer_kwargs)`), a factory
          taking the parameters, or None (the default: the caller steps its own optimizer);
          `param_groups` (torch's list of dicts) instead of all parameters in one group.
          With one, `ddp.step()` / `ddp.zero_grad()` step it and zero the buckets, and
          `ddp.optimizer` is the torch optimizer (schedulers attach to it).
        - `param_dtype` (bf16 or fp16; needs `optimizer`): the parameters become compute copies
          in that dtype; `ddp.masters[p]` is p's fp32 master, what the optimizer steps; after a
          synchronised backward `ddp.masters[p].grad` is the averaged gradient in fp32, which
          `step()` applies and then drops. `state_dict()` gives the masters.

        Call `ddp(x)`: the forward pass itself is not changed. (With picolib's DDP,
        `ddp.module(x)` would average the gradients as well; PyTorch's needs `ddp(x)`.)
        """
        super().__init__()
        named = _checked(module, bucket_cap_bytes, param_dtype, optimizer, optimizer_kwargs)
        self.world = group_size(group)  # raises before any collective
        self.module, self.group = module, group
        self.bucket_cap_bytes, self.overlap, self.timeline = bucket_cap_bytes, overlap, timeline
        groups = dict(groups or {})
        own = {id(p): g for p, g in groups.items()}
        broadcast_from_first_rank([*(p for p in module.parameters() if id(p) not in own),
                                   *module.buffers()], group)
        for g in dict.fromkeys(own.values()):   # same order on every rank: the module's order
            broadcast_from_first_rank([p for p in module.parameters() if own.get(id(p)) is g], g)
        self.masters = _masters(named, param_dtype)   # parameter → its fp32 master (or none)

        # backward produces gradients roughly from the last layer to the first
        named = named[::-1]
        self.buckets = _make_buckets(named, own, bucket_cap_bytes)
        self._partial = bool(own)
        self._slot = {}  # parameter → (bucket, view): each .grad becomes a view into its bucket
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._slot[p] = (b, view)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for b in self.buckets for p in b.params]
        self._sync = True
        self.syncs = 0                # synchronised backward passes so far (steps)
        self._in_backward = False     # a synchronised backward is under way
        self._unsynced = False        # gradients arrived without sync since the last one
        self._next = 0                # the next bucket to issue (same order on every rank)
        stepped = self.masters.get      # what the optimizer steps in p's place
        self.optimizer = (None if optimizer is None else make_optimizer(
            optimizer, [stepped(p, p) for _, p in named[::-1]] if param_groups is None else
            [{**g, "params": [stepped(p, p) for p in g["params"]]} for g in param_groups],
            optimizer_kwargs))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _bucket_of(self, p) -> "_Bucket":
        """p's bucket; p.grad made a view into it again if zero_grad(set_to_none=True)
        dropped it."""
        bucket, view = self._slot[p]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        return bucket

    def _before_launch(self, bucket: "_Bucket"):
        """A parameter that got no gradient this backward takes part with zeros; whether this
        rank's own gradient was finite (for the error message) and the issue time (for the
        timeline) are noted."""
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()
                p.grad = view
        bucket.local_bad = ~is_finite(bucket.buffer)
        bucket.issued = time.perf_counter()

    def _poll(self):
        if self.timeline is None:
            return
        now = None
        for b in self.buckets[:self._next]:
            if b.work is not None and b.done is None and b.work.is_completed():
                b.done = now = now or time.perf_counter()

    def _sync_due(self) -> bool:
        """Whether there is a sync to finish: a synchronised backward under way, or gradients
        accumulated without sync that a step must average now (a pipeline's split backward
        whose W op had no weight left to compute: under tensor parallelism every Linear's
        gradient came in B)."""
        if not self._in_backward:
            if not (self._sync and self._unsynced):
                return False
            self._in_backward = True
        return True

    def _wait_on_timeline(self):
        """Wait for every all-reduce, recorded on the timeline from the moment the last rank
        issued it (measured: to the first moment it was seen done; emulated: the link's slot)."""
        issued = torch.tensor([b.issued for b in self.buckets], dtype=torch.float64,
                              device=self.buckets[0].buffer.device)    # NCCL: on the GPU
        with comm.tagged(purpose="timeline"):
            comm.all_reduce(issued, op="max", group=self.group)
        for b, last in zip(self.buckets, issued.tolist()):
            self.timeline.wait("all_reduce", b.work, last, done=b.done, bucket=b.index,
                               issued=b.issued, label=f"AR{b.index}")

    def _after_sync(self):
        """Reset for the next backward; raise if a gradient is NaN or inf; hand fp32 gradients
        to the masters."""
        for b in self.buckets:
            b.work, b.done, b.pending = None, None, len(b.params)
        self._next, self._in_backward, self.syncs = 0, False, self.syncs + 1
        self._unsynced = False
        if self._partial:   # buckets reduced over sub-groups: agree on the verdict first
            bad = torch.stack([~is_finite(b.buffer) for b in self.buckets]).any().float().view(1)
            with comm.tagged(purpose="gradients"):
                comm.all_reduce(bad, op="max", group=self.group)
            if bad.item():
                raise FloatingPointError(f"step {self.syncs}: a gradient is NaN or inf after the "
                                         "all-reduce (on this rank or another). Nothing was "
                                         "updated; zero the gradients and go on, or lower the "
                                         "learning rate")
        check_finite([b.buffer for b in self.buckets],
                     torch.stack([b.local_bad for b in self.buckets]).any(), self.syncs,
                     self.group, "all-reduce")
        if self.masters:   # what the optimizer reads: fp32, one cast per bucket
            for b in self.buckets:
                for p, grad in views(b.buffer.float(), b.params):
                    self.masters[p].grad = grad

    # ------------------------------------------------------------------ the contract

    def _own_optimizer(self):
        if self.optimizer is None:
            raise RuntimeError("this DDP owns no optimizer: step your own, or build it as "
                               "DDP(model, group, optimizer=torch.optim.AdamW, lr=...)")
        return self.optimizer

    def step(self) -> None:
        """Wait for the gradient sync (a no-op after a synchronised backward), then step the
        owned optimizer: every replica takes the same step."""
        optimizer = self._own_optimizer()
        self.finish_gradient_sync()
        optimizer.step()
        if self.masters:   # the compute copies follow the masters; the fp32 gradients go
            with torch.no_grad():
                torch._foreach_copy_(list(self.masters), list(self.masters.values()))
            for m in self.masters.values():
                m.grad = None

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buckets (the .grads stay views into them, as torch's DDP keeps
        them); `set_to_none=True` drops the .grads instead (nn.Module's way)."""
        self._unsynced = False
        for m in self.masters.values():
            m.grad = None
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        for b in self.buckets:
            b.buffer.zero_()

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, measured on the storages (each once): the module's
        parameters, the gradient buckets, and the owned optimizer's tensors shaped like their
        parameter (its per-tensor `step` counters, 0-dim, are left out, as ZeRO leaves them)
        and, with `param_dtype`, the fp32 masters (ZeRO's convention: "optimizer")."""
        state = [] if self.optimizer is None else [
            t for p, s in self.optimizer.state.items() for t in s.values()
            if isinstance(t, torch.Tensor) and t.shape == p.shape]
        return {"params": unique_bytes(self.module.parameters()),
                "grads": unique_bytes(b.buffer for b in self.buckets),
                "optimizer": unique_bytes([*self.masters.values(), *state])}

    def holdings(self, create_state: bool = True) -> Holdings:
        """What this rank holds (`flat.Holdings`): every parameter whole, each replica
        answering for a 1/n slice of it (n: its bucket's group), with views of its value,
        gradient and the owned optimizer's state — created as the first step would with
        `create_state` (a checkpoint is loaded into it)."""
        groups = {id(p): b.group for b in self.buckets for p in b.params}
        if create_state:
            self._own_optimizer()
        masters = self.masters     # bf16 compute: the optimizer steps the fp32 masters
        items, params = [], []
        for name, q in self.module.named_parameters():
            if not q.requires_grad:
                continue
            g = groups.get(id(q)) or self.group
            p = masters.get(q, q)
            grad = p.grad if p.grad is not None else q.grad
            st = fresh_state(self.optimizer, p, create_state)
            own = own_range(dist.get_world_size(g), dist.get_rank(g), 0, p.numel())
            items.append(Held(name, 0, p.numel(), *own, p.detach().view(-1),
                              None if grad is None else grad.view(-1),
                              {k: st[k].view(-1) for k in STATE if k in st}))
            params.append(p)

        def get_step():
            first = self.optimizer.state.get(params[0], {}) if params and self.optimizer else {}
            return int(first.get("step", 0))

        def set_step(n):
            for p in params:
                self.optimizer.state[p]["step"] = torch.tensor(float(n))

        def after_load():
            with torch.no_grad():
                for q, m in masters.items():
                    q.copy_(m)
        return Holdings(items, get_step, set_step, after_load)

    def state_dict(self, *args, **kwargs) -> dict:
        """{"model": the module's state_dict (its own names, no "module." prefix),
        "optimizer": {"state": {name: {key: tensor}}, "param_groups": [{..., "params":
        [names]}]}} — the contract's shape, the same as ZeRO's (an empty optimizer part when
        DDP owns none). With `param_dtype`, the weights are the fp32 masters. Not nn.Module's
        state_dict: use `ddp.module.state_dict()` for that."""
        names = {id(self.masters.get(p, p)): n for n, p in self.module.named_parameters()}
        optim = {"state": {}, "param_groups": []}
        if self.optimizer is not None:
            optim["state"] = {names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                             for k, v in s.items()}
                              for p, s in self.optimizer.state.items()}
            optim["param_groups"] = [{**{k: v for k, v in g.items() if k != "params"},
                                      "params": [names[id(p)] for p in g["params"]]}
                                     for g in self.optimizer.param_groups]
        model = dict(self.module.state_dict())
        model.update({n: self.masters[p].detach().clone()
                      for n, p in self.module.named_parameters() if p in self.masters})
        return {"model": model, "optimizer": optim}

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Take `state_dict()`'s shape: "model" (optional) into the module, "optimizer"
        (optional) into the owned optimizer, by parameter name."""
        if state_dict.get("model") is not None:
            self.module.load_state_dict(state_dict["model"], strict=strict)
            with torch.no_grad():
                for n, p in self.module.named_parameters():
                    if p in self.masters and n in state_dict["model"]:
                        self.masters[p].copy_(state_dict["model"][n])
                        p.copy_(self.masters[p])
        optim = state_dict.get("optimizer")
        if not optim or not (optim.get("state") or optim.get("param_groups")):
            return
        optimizer = self._own_optimizer()
        own = optimizer.state_dict()
        names = {id(self.masters.get(p, p)): n for n, p in self.module.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        own["state"] = {i: optim["state"][n] for i, n in enumerate(order) if n in optim["state"]}
        for mine, theirs in zip(own["param_groups"], optim.get("param_groups") or []):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        optimizer.load_state_dict(own)

    def bucket_names(self) -> list[list[str]]:
        """Parameter names in each bucket, in the order the buckets are all-reduced."""
        return [list(b.names) for b in self.buckets]

    def bucket_bytes(self) -> list[int]:
        return [b.nbytes for b in self.buckets]


DDP = DistributedDataParallel


# --------------------------------------------------------------------------- buckets


def _checked(module, bucket_cap_bytes, param_dtype, optimizer, optimizer_kwargs) -> list:
    """DDP's arguments checked before any collective; the (name, parameter) pairs it syncs."""
    if optimizer is None and optimizer_kwargs:
        raise TypeError(f"{sorted(optimizer_kwargs)} are optimizer settings: pass optimizer=")
    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, not {param_dtype}")
    if param_dtype != torch.float32 and optimizer is None:
        raise ValueError(f"param_dtype={param_dtype} keeps fp32 masters that the owned "
                         "optimizer steps: pass optimizer= as well")
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
    return named


def _masters(named, param_dtype) -> dict:
    """With bf16 or fp16 parameters: each parameter's fp32 master, the parameter itself made a
    compute copy in that dtype; with fp32 ones, none."""
    masters = {}
    if param_dtype != torch.float32:
        with torch.no_grad():
            for _, p in named:
                masters[p] = nn.Parameter(p.detach().float().clone())
                p.data = p.data.to(param_dtype)
    return masters


def _make_buckets(named, own: dict, cap: int) -> list:
    """The flat buckets of `named` (in backward's order): one dtype and one group per buffer,
    each at most `cap` bytes (`assign_buckets`)."""
    buckets = []
    for dtype, g in dict.fromkeys((p.dtype, own.get(id(p))) for _, p in named):
        same = [(n, p) for n, p in named if p.dtype == dtype and own.get(id(p)) is g]
        sizes = [p.numel() * p.element_size() for _, p in same]
        for idx in assign_buckets(sizes, cap):
            buckets.append(_Bucket(len(buckets), [same[i][1] for i in idx], [same[i][0] for i in idx], g))
    return buckets

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
    """A flat gradient buffer for a few parameters; their `.grad`s are views into it.
    `group`: where its all-reduce runs (None: the wrapper's group)."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], group=None):
        self.index, self.params, self.names, self.group = index, params, names, group
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
        self.local_bad = None          # this rank's gradient was not finite (a bool tensor)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
