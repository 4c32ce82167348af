"""ZeRO: data parallelism without the redundant copies (lesson 03).

Plain DP keeps parameters, gradients and optimizer state whole on every rank. ZeRO
(Rajbhandari et al. 2020) splits them over the N ranks of the data-parallel group:
- stage 1 shards the optimizer state: a reduce-scatter leaves each rank the mean
  gradient of its 1/N slice, the rank updates that slice, and an all-gather hands every
  rank the whole updated model;
- stage 2 shards the gradients too: once a unit's gradient is reduce-scattered, its full
  gradient is freed; only the shard stays;
- stage 3 shards the parameters: a unit (a transformer block, or the root's leftover
  parameters) is all-gathered just before its forward and again before its backward and
  freed after each; the next unit's all-gather starts early (prefetch).

Layout (picolib/sharded_optim.py). A unit's parameters are views into one flat buffer
padded to a multiple of N; rank r owns elements [r·S, (r+1)·S), S = ⌈numel/N⌉. Stage 3
frees a unit by resizing the buffer's storage to 0 bytes and gathers it back into the
same storage, so the views (and the tensors autograd saved) see the gathered values.
The optimizer is the user's: a torch.optim class (or a factory) steps each rank's fp32
master shards — one nn.Parameter per unit — as ZeroRedundancyOptimizer and FSDP2 do. An
element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...) then equals one process,
with k bytes of state per owned element; one that needs a parameter's shape is refused by
a probe (`sharded_optim.check_elementwise`). A torch.optim.lr_scheduler works on
`zero.optimizer`. `param_dtype=torch.bfloat16` computes in bf16 with an fp32 master (k + 4).

The file opens with the core, the few methods lesson 03 §2 reads: `step`, `_reduce_scatter`,
`_backward_done`, `_pre_forward`, `_post_forward` (and `ShardedUnit.flat_grads`, `all_gather`,
`free`); the machinery they stand on (the fixed orders, prefetch, hooks, accumulation, the NaN
alarm, param groups, checkpoints, the timeline) follows, with its notes there.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .flat import (STATE, GradientSyncSwitch, Held, Holdings, broadcast_from_first_rank,
                   check_finite, fresh_state, group_size, is_finite, padded_numel, shard_bounds)
from .sharded_optim import (ShardedUnit, check_elementwise, held_bytes, make_optimizer,
                            optimizer_state_factor, split_units, state_bytes_per_element,
                            unit_numels, zero_memory_bytes, zero_traffic_bytes)

__all__ = ["ZeRO", "shard_bounds", "padded_numel", "unit_numels", "zero_memory_bytes",
           "zero_traffic_bytes", "optimizer_state_factor", "state_bytes_per_element"]


class ZeRO(GradientSyncSwitch):
    """ZeRO(model, stage, group=None, optimizer=torch.optim.AdamW, *, param_dtype=torch.float32,
    units=None, prefetch=True, timeline=None, groups=None, reduce_every_micro_batch=False,
    **optimizer_kwargs)

    Wraps `model` — call it as usual — and owns its optimizer: `loss.backward();
    zero.step(); zero.zero_grad()`; gradients are averaged over `group` (None: the default
    group). `optimizer`: a torch.optim class built as `optimizer(masters, **optimizer_kwargs)`
    (e.g. `lr=1e-3`), a factory taking the list of master shards, or "sgd", "adam", "adamw";
    `zero.optimizer` is the torch optimizer (schedulers attach to it), and a unit's state is
    `zero.optimizer.state[zero.units[i].master]`; after `finish_gradient_sync()` (or
    inside `step()`) `zero.units[i].master.grad` is the unit's reduced gradient shard, fp32.
    The data-parallel contract (shared with DDP): step, zero_grad, no_sync,
    finish_gradient_sync, memory, state_dict/load_state_dict. `units`: modules whose parameters make one flat buffer each — one gradient
    bucket, and in stage 3 what is gathered at once (default: `model.blocks`; the
    leftover parameters form the root unit). Frozen parameters and buffers are copied
    from the group's first rank. `timeline`: a picolib Timeline that gets F, B (stage 3),
    all_gather and reduce_scatter spans (lanes gather, reduce: one emulated link each, see
    picolib.timeline); a cost in `timeline.emulate` is slept.
    `groups`: {parameter: process group} for parameters replicated on only some of the
    ranks (module docstring; stages 1-2). `reduce_every_micro_batch` (stages 2-3): every
    backward reduce-scatters, even inside `no_sync()`, and accumulates into the shards.
    """

    # ================================================================ the core (lesson 03 §2)
    # ZeRO-1/2/3: when a unit's backward is over, its gradient is reduce-scattered; the step
    # updates this rank's shard alone; stages 1-2 then all-gather the whole parameters back.

    @torch.no_grad()
    def step(self):
        """Reduce-scatter what is left, step this rank's shards, all-gather them (stages 1-2)."""
        self.finish_gradient_sync()        # every unit's shard of the mean gradient, waited for
        self.steps += 1
        self.optimizer.step()              # element-wise: it steps this rank's fp32 shards alone
        for u in self.units:
            u.shard_from_master()          # bf16 compute: the fp32 update copied into the shard
        if self.stage < 3:                 # ZeRO-3 gathers a unit only when it runs
            gathers = [(i, self.units[i].all_gather(self._groups[i]), time.perf_counter())
                       for i in self._rs_order]
            for i, handle, t0 in gathers:
                self._wait(handle, "all_gather", t0, i)
        self._new_step()

    def _reduce_scatter(self, i):
        """Unit i's gradients as one flat buffer, padded to a multiple of N, reduce-scattered:
        this rank receives the mean over the group of its shard, [r·S, (r+1)·S)."""
        u = self.units[i]
        flat = self._prepared(i, u.flat_grads())   # NaN alarm, sub-group scale (below)
        out = u.grad if i not in self._reduced else torch.empty_like(u.grad)   # see _drain
        self._reduced.add(i)
        with comm.tagged(purpose="gradients"):
            handle = comm.reduce_scatter(out, flat, op="avg", group=self._groups[i], async_op=True)
        self._pending.append((handle, time.perf_counter(), i, flat, out))
        if self.stage > 1:
            self._drain(keep=1)            # ZeRO-2/3: older flat gradients waited for, dropped

    def _backward_done(self, i):
        """Autograd has accumulated every gradient of unit i: its backward is over."""
        if self.stage == 3:
            self._record_compute("B", i)
            self.units[i].free()           # ZeRO-3: the gathered parameters go again
        if self._sync or self.reduce_every_micro_batch:
            self._reduce_in_order()        # its reduce-scatter, in the one order every rank keeps

    # ZeRO-3: a unit is whole only while it computes.
    def _pre_forward(self, i):
        """Before unit i's forward, and again when backward reaches it."""
        self._gather(i)                    # its all-gather issued (with prefetch the next one's)
        self._t = time.perf_counter()      # and waited for; its compute starts

    def _post_forward(self, i, out):
        """After unit i's forward: free it; backward gathers it again before its own pass."""
        self._record_compute("F", i)
        self.units[i].free()
        t = next((x for x in _tensors(out) if x.requires_grad), None)
        if torch.is_grad_enabled() and t is not None:   # runs when backward reaches the unit
            t.register_hook(lambda grad, i=i: self._pre_backward(i))

    # ================================================================ the machinery
    # Param groups (`param_groups=[{"params": [...], "weight_decay": 0.1}, {"params": [...],
    # "weight_decay": 0.0}]`, torch's shape): a unit's flat buffer mixes 2-D weights and 1-D norm
    # weights, and a torch param group needs whole parameters of its own. So each unit's buffer
    # is laid out group by group (group 0's parameters first, then group 1's), and a rank's
    # master shard is cut where the groups meet into one nn.Parameter per (unit, group) —
    # views of the same fp32 shard, `unit.pieces`. The collectives, the padding and the bytes do
    # not change (one buffer per unit as before); the optimizer gets the pieces of group g in
    # its group g, with that group's options, so weight decay, learning rates and schedulers work
    # per group as in one process. Without `param_groups` a unit's one piece is its master.
    #
    # One order on every rank. Collectives are matched by their order, so every rank issues
    # them in a fixed unit order, whatever order its backward finishes the units in: a unit's
    # reduce-scatter starts once its gradients are complete *and* the units before it have
    # started; the rest start when backward ends. In stage 3 each forward and each backward
    # all-gathers every unit in a fixed order (one this rank does not use is gathered and freed
    # at the end of the pass), and a backward's reduce-scatters come after all its
    # all-gathers: any other interleaving could deadlock a rank that visits the units in
    # another order (the price: a unit finished before the last all-gather keeps its full
    # gradient until then).
    #
    # Parameters whose holders are another set of ranks than `group` — an expert's edp ranks
    # (fewer), a DualPipe stage's pair × dp × cp (more) — get `groups={param: group}` (stages 1-2):
    # they form units of their own, sharded and reduced over their group, and still divided by
    # `group`'s size (the data shards) like the rest.
    #
    # Accumulation: inside `no_sync()` (or after `set_requires_gradient_sync(False)`) backward
    # only accumulates, through autograd, into full gradients (stages 2-3 too, until the
    # reduce-scatter); the step's last backward (or `step()`) reduce-scatters the sum once.
    # So with m micro-batches (a pipeline's m ≥ p) a stage-2 rank
    # holds whole gradients between them, as stage 1 does. `reduce_every_micro_batch=True`
    # (stages 2-3) is the other choice (FSDP's gradient accumulation with communication, and
    # DeepSpeed ZeRO-2's): every backward reduce-scatters and adds the result into the shard, so
    # only 1/N of the gradients stays between micro-batches, at m reduce-scatters per step
    # (lesson 10). A NaN or inf gradient makes every rank raise FloatingPointError in `step()`,
    # before any update.

    def __init__(self, model: nn.Module, stage: int, group=None, optimizer=torch.optim.AdamW,
                 *, param_dtype=torch.float32, units=None,
                 prefetch: bool = True, timeline=None, groups: dict | None = None,
                 reduce_every_micro_batch: bool = False, param_groups=None,
                 **optimizer_kwargs):
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
        if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be float32, bfloat16 or float16, not {param_dtype}")
        devices = sorted({str(p.device) for p in model.parameters() if p.requires_grad})
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device; found {devices}")
        # before any collective: the optimizer's own checks and the element-wise probe
        check_elementwise(optimizer, optimizer_kwargs,   # on meta (the dry run) it has no values
                          "cpu" if devices[0] == "meta" else devices[0])
        group_of, options = _param_groups(model, param_groups)
        if groups and stage == 3:
            raise ValueError("ZeRO-3 gathers every unit over one group: parameters with "
                             "groups of their own (experts) need stage 1 or 2")
        if stage == 3 and getattr(getattr(model, "cfg", None), "recompute", "none") != "none":
            raise ValueError("ZeRO-3 frees parameters after forward: recompute is not supported")
        if reduce_every_micro_batch and stage == 1:
            raise ValueError("reduce_every_micro_batch needs stage 2 or 3: stage 1 keeps whole "
                             "gradients anyway, so reducing them every micro-batch saves nothing")
        self.n = group_size(group)   # before any collective
        self.reduce_every_micro_batch = bool(reduce_every_micro_batch)
        self._reduced = set()        # units reduce-scattered at least once this step
        self.stage, self.group, self.module = stage, group, model
        self.prefetch, self.timeline = prefetch, timeline
        self.steps, self._sync, self._pending, self._t = 0, True, [], 0.0
        with torch.no_grad():
            own = {id(p): g for p, g in (groups or {}).items()}
            self.units, self._groups, self._scales = [], [], []
            for m, named in split_units(model, units):
                for g, part in _by_group(named, own):
                    if group_of is not None:   # group 0's parameters first, then group 1's, ...
                        part = sorted(part, key=lambda np: group_of[id(np[1])])
                    index = None if group_of is None else [group_of[id(p)] for _, p in part]
                    self.units.append(ShardedUnit(m, part, stage, group if g is None else g,
                                                  param_dtype, index))
                    self._groups.append(group if g is None else g)
                    self._scales.append(1.0 if g is None else group_size(g) / self.n)
            owned = {id(p) for u in self.units for p in u.params}
            rest = [p for p in model.parameters() if id(p) not in owned] + list(model.buffers())
            if rest:
                broadcast_from_first_rank(rest, group)
        pieces = [[p for u in self.units for g, _, _, p in u.pieces if g == i]
                  for i in range(len(options))]
        self.optimizer = make_optimizer(
            optimizer, pieces[0] if group_of is None else
            [{**opts, "params": ps} for opts, ps in zip(options, pieces)], optimizer_kwargs)
        for u in self.units:
            u.optimizer = self.optimizer
        # The fixed orders. Reduce-scatters and updates: last unit first (backward finishes
        # the root last). Stage 3's all-gathers: the root, then the blocks (reversed in backward).
        k = len(self.units)
        root = [0] if self._is_root(0) else []
        self._rs_order = list(range(k - 1, -1, -1))
        self._orders = {"forward": list(range(k)), "backward": root + list(range(k - 1, len(root) - 1, -1))}
        self._order, self._issued = [], 0   # stage 3: this pass's all-gathers, how many issued
        self._rs_next, self._in_backward = 0, False   # reduce-scatters issued this step
        self._local_bad = torch.zeros((), dtype=torch.bool, device=self.units[0].grad.device)
        self._unit_of = {p: i for i, u in enumerate(self.units) for p in u.params}
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        if stage == 3:
            model.register_forward_pre_hook(lambda m, a: self._begin_pass("forward"))
            for i, u in enumerate(self.units):
                u.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
                u.module.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))
            model.register_forward_hook(lambda m, a, out: self._end_pass())

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ stage 3: gathers
    def _is_root(self, i: int) -> bool:
        return self.units[i].module is self.module

    def _begin_pass(self, kind: str):
        self._order, self._issued = self._orders[kind], 0

    def _issue_gathers(self, stop: int):
        """Start this pass's all-gathers, in its fixed order, up to position `stop`."""
        while self._issued < stop:
            u, self._issued = self.units[self._order[self._issued]], self._issued + 1
            u.work = u.all_gather(self.group), time.perf_counter()

    def _gather(self, i: int):
        """Start the all-gathers up to unit i (with prefetch, one more); wait for unit i's."""
        self._issue_gathers(min(self._order.index(i) + 1 + int(self.prefetch), len(self._order)))
        u = self.units[i]
        if u.work is not None:
            self._wait_gather(i)
        elif u.is_free():
            raise RuntimeError(f"ZeRO-3 gathers unit {i} once per forward and once per backward: "
                               "it ran twice in one pass, or outside the model's forward")

    def _end_pass(self):
        """End of a forward or backward: the all-gathers this rank did not need (another rank
        may), then every unit is freed."""
        self._issue_gathers(len(self._order))
        for i, u in enumerate(self.units):
            if u.work is not None:
                self._wait_gather(i)
            u.free()

    def _wait_gather(self, i: int):
        (handle, t0), self.units[i].work = self.units[i].work, None
        self._wait(handle, "all_gather", t0, i)

    def _pre_backward(self, i):
        self._enter_backward()
        self._pre_forward(i)    # the same: gather the unit, start its clock

    # ------------------------------------------------------------------ backward
    def _enter_backward(self):
        if self._in_backward:
            return
        if self._rs_next:
            raise RuntimeError("this step's gradients are already reduce-scattered: call step() "
                               "(or zero_grad()) before the next backward; accumulate with "
                               "no_sync() or set_requires_gradient_sync(False)")
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.stage == 3:
            self._begin_pass("backward")

    def _grad_ready(self, p):
        """After autograd has accumulated p.grad (once per parameter and backward)."""
        self._enter_backward()
        i = self._unit_of[p]
        self.units[i].ready += 1
        if self.units[i].complete():
            self._backward_done(i)

    def _end_backward(self):
        if self.stage == 3:
            self._end_pass()
        if self._sync or self.reduce_every_micro_batch:
            self._reduce_in_order(finish=True)
        if self.reduce_every_micro_batch:   # the sums are in the shards: the next backward
            self._drain(keep=0)             # reduce-scatters again
            self._rs_next = 0
        for u in self.units:
            u.ready = 0
        self._in_backward = False

    # ------------------------------------------------------------------ reduce-scatter
    def _reduce_in_order(self, finish: bool = False):
        """Start the next reduce-scatters of the fixed order whose units are complete
        (finish: all the rest, complete or not)."""
        if self.stage == 3 and not finish and self._issued < len(self._order):
            return   # a backward's all-gathers all come first
        while self._rs_next < len(self.units):
            i = self._rs_order[self._rs_next]
            if not (finish or self.units[i].complete()):
                return
            self._rs_next += 1
            self._reduce_scatter(i)

    def _prepared(self, i, flat):
        """Unit i's flat gradient before its reduce-scatter. An alarm in band: a rank whose own
        gradient is not finite writes NaN into the first element of every shard, so that every
        rank's reduced shard shows it and all ranks raise together (only finite gradients whose
        sum overflows the dtype — 3e38 in fp32, 6.5e4 in fp16 — would reach one rank alone).
        A sub-group's average is made an average over `group`."""
        bad = ~is_finite(flat)
        self._local_bad |= bad
        flat[self.units[i].starts] = torch.where(bad, torch.nan, flat[self.units[i].starts])
        if self._scales[i] != 1.0:
            flat.mul_(self._scales[i])
        return flat

    def in_flight(self) -> list[torch.Tensor]:
        """The buffers of the reduce-scatters started and not yet waited for (each unit's
        flat gradient and the shard it lands in): memory a rank holds between backward's
        hooks and the step (lesson 10 samples it)."""
        return [t for *_, flat, out in self._pending for t in (flat, out)]

    def _drain(self, keep: int):
        while len(self._pending) > keep:
            handle, t0, i, _, out = self._pending.pop(0)
            self._wait(handle, "reduce_scatter", t0, i)
            if out is not self.units[i].grad:
                self.units[i].grad.add_(out)

    def finish_gradient_sync(self):
        """Start the reduce-scatters not started yet, wait for all, check them: each rank
        then holds the mean gradient of its shards, or every rank raises FloatingPointError."""
        if not (self.reduce_every_micro_batch and self._reduced):   # else: every backward did
            self._reduce_in_order(finish=True)
        self._drain(keep=0)
        check_finite([u.grad for u in self.units], self._local_bad, self.steps + 1,
                     self.group, "reduce-scatter")
        for u in self.units:      # what the torch optimizer reads: fp32, the master's shape
            u.master.grad = u.grad if u.grad.dtype == torch.float32 else u.grad.float()
            u.set_piece_grads()

    def _new_step(self):
        self._rs_next = 0
        self._reduced.clear()
        self._local_bad.zero_()

    def zero_grad(self):
        """Drop this step's gradients: stage 1 zeroes its flat gradient buffers, stages 2-3
        drop the .grads not reduced yet (their shards are overwritten by the next step)."""
        self._drain(keep=0)
        for u in self.units:
            u.zero_grad()
            u.master.grad = None
            u.set_piece_grads()
        self._new_step()

    # ------------------------------------------------------------------ inspection
    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, measured (`held_bytes`, picolib/sharded_optim.py):
        {"params", "grads", "optimizer"}; "optimizer" is the fp32 master (when it is not the
        parameters) and the optimizer's tensors shaped like the shard; the per-tensor `step`
        counters (0-dim, one per unit, not per element) are left out, so the bytes equal the
        formulas (`zero_memory_bytes`) exactly. The state appears at the first step."""
        return held_bytes(self.module, self.units)

    def holdings(self, create_state: bool = True) -> Holdings:
        """What this rank holds (`flat.Holdings`): of each parameter, the elements inside
        this rank's shard of its unit (it answers for all of them), with views of the fp32
        master, the reduced gradient and the optimizer's state — created as the first step
        would with `create_state` (a checkpoint is loaded into it). `after_load` remakes the
        compute copies (and, stages 1-2, the gathered parameters) from the masters."""
        items, pieces = [], []
        for u, group in zip(self.units, self._groups):
            lo, hi = shard_bounds(u.numel, dist.get_world_size(group), dist.get_rank(group))
            grad = u.master.grad if u.master.grad is not None else u.grad   # what the optimizer reads
            states = []
            for _, pa, pb, piece in u.pieces:    # each a view of the master: what the optimizer steps
                states.append((pa, pb, fresh_state(self.optimizer, piece, create_state)))
                pieces.append(piece)
            at = 0
            for name, p in zip(u.names, u.params):
                a, b = max(lo, at), min(hi, at + p.numel())
                if a < b:                         # a parameter lies inside one piece (one group)
                    sa, sb = a - lo, b - lo
                    pa, _, st = next(x for x in states if x[0] <= sa and sb <= x[1])
                    items.append(Held(name, a - at, b - at, a - at, b - at, u.master.detach()[sa:sb],
                                      grad[sa:sb], {k: st[k][sa - pa:sb - pa] for k in STATE if k in st}))
                else:
                    items.append(Held(name, 0, 0, 0, 0, u.master.detach()[:0], grad[:0], {}))
                at += p.numel()

        def set_step(n):
            self.steps = n
            for piece in pieces:
                if piece in self.optimizer.state:
                    self.optimizer.state[piece]["step"] = torch.tensor(float(n))

        @torch.no_grad()
        def after_load():
            for u, group in zip(self.units, self._groups):
                if u.shard.data_ptr() != u.master.data_ptr():
                    u.shard.copy_(u.master)
                if self.stage < 3:
                    comm.all_gather(u.full, u.shard, group=group)
        return Holdings(items, lambda: self.steps, set_step, after_load)

    def state_factor(self) -> int:
        """k: optimizer bytes per parameter element, read from the torch optimizer's state
        (Adam 8, SGD with momentum 4, ...), + 4 when an fp32 master is kept beside bf16."""
        master = self.units[0].shard.data_ptr() != self.units[0].master.data_ptr()
        return state_bytes_per_element(self.optimizer) + (4 if master else 0)

    def unit_numels(self) -> list[int]:
        return [u.numel for u in self.units]

    @torch.no_grad()
    def gather_parameters(self) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor} of the whole model, from the masters. A collective: every
        rank of the group calls it."""
        return {name: t for u, g in zip(self.units, self._groups)
                for name, t in u.gather_master(g).items()}

    @torch.no_grad()
    def state_dict(self) -> dict:
        """{"model": {name: tensor}, "optimizer": {"state": {name: {key: tensor}},
        "param_groups": [{..., "params": [names]}]}}: whole tensors under the model's own
        parameter names — the shape torch.distributed.checkpoint.state_dict's
        get_state_dict(full_state_dict=True) gives, and DDP's `state_dict()` — gathered from
        the shards (a collective: every rank of the group calls it)."""
        model = {n: t.detach().clone() for n, t in self.module.state_dict().items()
                 if n not in {m for u in self.units for m in u.names}}   # frozen, buffers
        state = {}
        for u, g in zip(self.units, self._groups):
            model.update(u.gather_master(g))
            for key, v in u.state.items():     # the same keys, in order, on every rank
                whole = (u.gather(v, g) if isinstance(v, torch.Tensor) and v.shape == u.master.shape
                         else dict.fromkeys(u.names, v))
                for name, t in whole.items():
                    state.setdefault(name, {})[key] = t.clone() if isinstance(t, torch.Tensor) else t
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [n for u in self.units for n, j in zip(u.names, u.group_index) if j == i]}
                  for i, g in enumerate(self.optimizer.param_groups)]
        return {"model": model, "optimizer": {"state": state, "param_groups": groups}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Take `state_dict()`'s shape — whole tensors by name, written on any mesh — and
        keep this rank's shards. "model" (optional) replaces the weights; "optimizer"
        (optional) the optimizer's state and (if given) its param groups' hyperparameters."""
        model, optim = state_dict.get("model"), state_dict.get("optimizer")
        if model is not None:
            for u, g in zip(self.units, self._groups):
                u.load_shard([model[n] for n in u.names], u.master, g)
            rest = {n: t for n, t in model.items() if n not in {m for u in self.units for m in u.names}}
            if rest:
                self.module.load_state_dict(rest, strict=False)
        if optim is None:
            return
        own = self.optimizer.state_dict()      # torch's shape: parameters by index
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups
                                                 for p in g["params"])}
        for u, g in zip(self.units, self._groups):
            given = optim["state"].get(u.names[0])
            if not given:
                continue
            entry = {}
            for key, v in given.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:   # shaped like the parameter
                    entry[key] = torch.zeros_like(u.master.detach())
                    u.load_shard([optim["state"][n][key] for n in u.names], entry[key], g)
                else:
                    entry[key] = v
            for _, a, b, p in u.pieces:     # each piece its part of the shard
                own["state"][index[id(p)]] = {
                    k: (t[a:b].clone() if isinstance(t, torch.Tensor) and t.dim() > 0
                        else t.clone() if isinstance(t, torch.Tensor) else t)
                    for k, t in entry.items()}
        for mine, theirs in zip(own["param_groups"], optim.get("param_groups") or []):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        self.optimizer.load_state_dict(own)
        steps = [int(s["step"]) for s in own["state"].values() if "step" in s]
        if steps:
            self.steps = max(steps)

    # ------------------------------------------------------------------ timeline
    def _wait(self, handle, name, t0, i):
        """Wait for unit i's collective issued at t0. With a timeline: on the emulated link of
        its lane (gather, reduce), which carries a lane's collectives one after the other in
        the order they are waited for — here always the order they were issued."""
        if self.timeline is None:
            handle.wait()
        else:
            lane = {"all_gather": "gather", "reduce_scatter": "reduce"}[name]
            self.timeline.wait(name, handle, t0, lane=lane, unit=i)

    def _record_compute(self, name, i):
        """A block's forward (F) or backward (B) on the timeline, from its gather to now."""
        if not self._is_root(i):
            self._record(name, self._t, unit=i)

    def _record(self, name, t0, **meta):
        """Span `name` (a unit's forward or backward) from t0 to now, at least its cost."""
        if self.timeline is not None:
            self.timeline.end(self.timeline.begin(name, start=t0, **meta))


def _param_groups(model, param_groups):
    """(None, [{}]) without groups; else ({id(param): group index}, [each group's options]),
    after checking that every trainable parameter is in exactly one group."""
    if param_groups is None:
        return None, [{}]
    group_of, options = {}, []
    for i, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError("param_groups: a list of dicts with 'params', as torch.optim takes")
        for p in g["params"]:
            if id(p) in group_of:
                raise ValueError(f"a parameter is in param groups {group_of[id(p)]} and {i}")
            group_of[id(p)] = i
        options.append({k: v for k, v in g.items() if k != "params"})
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if left:
        raise ValueError(f"param_groups must hold every trainable parameter; missing {left[:3]}")
    return group_of, options


def _by_group(named, groups: dict):
    """Split one unit's (name, param) list by the parameters' own groups: [(None: `group`'s
    part, ...), (g, its part), ...] in order of first appearance, empty parts dropped."""
    parts: dict = {}
    for name, p in named:
        parts.setdefault(groups.get(id(p)), []).append((name, p))
    return sorted(parts.items(), key=lambda kv: kv[0] is not None)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for x in items for t in _tensors(x)]
