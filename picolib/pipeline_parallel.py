"""Pipeline parallelism: cut the tiny Llama into stages and run any schedule on real ranks
(lessons 07 and 07b).

    sched = make_schedule("1f1b", p, m)                       # pipeline_schedules.py: plain data
    stages = schedule_stages(model, sched)                    # split_stages(model, p·v) mostly
    out = run_schedule(sched, my_stages, tokens_mb, targets_mb, timeline=tl)   # on every rank

The file opens with its core, `Executor`: one rank walks its op list and runs each op. F
receives the input activation (or takes the tokens), runs the stage, keeps what backward
needs and sends the output on; BW receives ∂L/∂y, backpropagates it and sends ∂L/∂x back.
The split backward (lesson 07b): B = `torch.autograd.grad` w.r.t. the input (and the few
weights that are not a Linear's) — autograd then skips every Linear's ∂L/∂W matmul — while
hooks keep each Linear's input x and output gradient g; W = the skipped matmuls, ∂L/∂W = gᵀx,
later. (The first stage has no input gradient: its B is empty and its W the whole backward.)

The machinery follows. Messages (`_Mailbox`): sends are eager — each is posted with a
non-blocking `comm.isend` in program order, so a rank never waits for its receiver; receives
are posted ahead (`comm.irecv`, the next two of each sender), so a message lands as it
arrives and the op that needs it waits only if it has not. Activations and their gradients
have the same shape, so the messages between two ranks form one FIFO: the receiver knows the
sender's op list and takes messages in the sender's order, keeping any that arrive before
they are needed. With this model `pipeline_simulator.validate` predicts exactly which
schedules deadlock (a message must never wait behind one to another rank — with blocking
sends torch's interleaved zero-bubble schedule hangs). Figures use cost emulation
(picolib.timeline): `run_schedule` hands the executor a span per op.

Two pipelines (DualPipe): each direction runs its own copy of the model, so a layer's
gradient is the sum over its two copies; `schedule_stages` builds both copies' stages from
one model (they share its parameters, so in one process the sum happens by itself). On real
ranks the two holders of a stage (ranks r and p−1−r, `mesh.pairs()`) are just more ranks
that hold the same weights: `pair_gradient_groups` hands DDP or ZeRO (`groups=`) the group
pair × dp × cp for every parameter, and the one gradient path sums over it and divides by
the data-parallel size, as it does for experts (lesson 09). Nothing else reduces them. The
executor runs an overlapped F&B pair as its two ops, one after the other.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.nn as nn

from . import comm
from .model import TinyLlama
from .parallel_layout import ZERO3_PIPELINE, stage_ranges
from .pipeline_schedules import Schedule
from .pipeline_simulator import validate

__all__ = ["Executor", "partition", "split_stages", "schedule_stages", "run_schedule", "stage_grads",
           "backward_weights", "accumulate_grads", "pair_gradient_groups"]


class Executor:
    """One rank's part of a schedule: `run` walks its op list; `mail` carries the messages,
    `span(op)` times an op. Built by `run_schedule`."""

    def run(self):
        """Every op of this rank, in the schedule's order; returns this rank's part of the loss."""
        handler = {"F": self.forward, "BW": self.backward,
                   "B": self.backward_input, "W": self.backward_weight}
        for i, op in enumerate(self.ops):
            if op.kind != "F":
                self.sync_gradients(i, op)
            handler[op.kind](op)
            self.mail.flush()                   # the op's sends leave now
        return self.loss

    def forward(self, op):
        """F: receive the input activation (the first stage: the tokens), run the stage, keep
        x and y for backward, send y on (the last stage: add its share of the loss)."""
        s, mb = op.stage, op.mb
        if self.sched.is_first(s):
            x = self.tokens[mb]
        else:
            x = self.mail.recv("act", s, mb).requires_grad_()   # a leaf: backward fills x.grad
        with self.span(op), self.record_linears(op) as linears:
            y = self.stages[s](x)
            if self.sched.is_last(s):
                y = self.loss_fns[s](y, self.targets[mb]) / self.sched.n_micro
                self.loss = y.detach() if self.loss is None else self.loss + y.detach()
            else:
                self.mail.send("act", self.sched.next_stage(s), mb, y.detach())
        self.saved[(s, mb)] = (x, y, linears)

    def backward(self, op):
        """BW: receive ∂L/∂y (the last stage: y is the loss), backpropagate through the stage —
        its weight gradients accumulate in .grad — and send ∂L/∂x back."""
        s, mb = op.stage, op.mb
        x, y, _ = self.saved.pop((s, mb))
        dy = None if self.sched.is_last(s) else self.mail.recv("grad", s, mb)
        with self.span(op):
            torch.autograd.backward(y, dy)
            if not self.sched.is_first(s):
                self.mail.send("grad", self.sched.prev_stage(s), mb, x.grad)

    def backward_input(self, op):
        """B: only ∂L/∂x, what the previous stage waits for. autograd.grad w.r.t. x and the
        weights no hook recorded (the norms) skips every Linear's ∂L/∂W; the hooks keep g."""
        s, mb = op.stage, op.mb
        x, y, linears = self.saved[(s, mb)]
        dy = None if self.sched.is_last(s) else self.mail.recv("grad", s, mb)
        with self.span(op):
            if self.sched.is_first(s):          # no ∂L/∂x to send: W runs the whole backward
                self.saved[(s, mb)] = (x, y, dy)
                return
            recorded = {id(linear.weight) for linear, _, _ in linears}
            rest = [w for w in self.stages[s].parameters() if id(w) not in recorded]
            x.grad, *grads = torch.autograd.grad(y, [x] + rest, dy)
            accumulate_grads(rest, grads)
            self.mail.send("grad", self.sched.prev_stage(s), mb, x.grad)

    def backward_weight(self, op):
        """W: the weight gradients B skipped, gᵀx for each recorded Linear (the first stage:
        its whole backward, with the ∂L/∂y its B kept)."""
        x, y, linears_or_dy = self.saved.pop((op.stage, op.mb))
        with self.span(op):
            if self.sched.is_first(op.stage):
                torch.autograd.backward(y, linears_or_dy)
            else:
                backward_weights(linears_or_dy)

    # ------------------------------------------------------------------ machinery

    def __init__(self, sched, stages, tokens, targets, mail, span=None, loss_fn=None,
                 data_parallel=None):
        self.sched, self.stages, self.mail = sched, stages, mail
        self.tokens, self.targets, self.loss = tokens, targets, None
        self.span = span or (lambda op: contextlib.nullcontext())
        self.loss_fns = {s: loss_fn or st.loss_fn for s, st in stages.items()}
        self.data_parallel = data_parallel or {}
        self.recorders = {s: _LinearRecorder(st) for s, st in stages.items()}
        self.ops = sched.ops[mail.me]
        self.saved: dict = {}  # (stage, mb) -> (x, y, recorded Linears | B's ∂L/∂y on a first stage)
        self.split = {(op.stage, op.mb) for op in self.ops if op.kind == "W"}
        self.last_backward = {op.stage: i for i, op in enumerate(self.ops) if op.kind != "F"}

    def record_linears(self, op):
        """During F of a micro-batch whose backward is split (not on a first stage): the list
        the stage's Linears are recorded into (else None)."""
        on = (op.stage, op.mb) in self.split and not self.sched.is_first(op.stage)
        return self.recorders[op.stage].recording(on)

    def sync_gradients(self, i, op):
        """A stage's gradients are final after its last backward op of the step: only that op
        lets its DDP/ZeRO wrapper communicate."""
        if op.stage in self.data_parallel:
            self.data_parallel[op.stage].set_requires_gradient_sync(i == self.last_backward[op.stage])

    def close(self):
        for recorder in self.recorders.values():
            recorder.remove()
        for wrapper in self.data_parallel.values():
            wrapper.set_requires_gradient_sync(True)


def backward_weights(linears) -> None:
    """W's matmuls: ∂L/∂W = gᵀx for every Linear recorded during a forward (input x) and its
    B (output gradient g), accumulated into .grad."""
    with torch.no_grad():
        grads = [g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
                 for _, x, g in linears]
    accumulate_grads([linear.weight for linear, _, _ in linears], grads)


class _LinearRecorder:
    """For the split backward: while `recording(True)` is open, every plain nn.Linear of the
    stage that runs appends [module, input, output gradient] (the gradient arrives in B)."""

    def __init__(self, stage: nn.Module):
        self.linears = None
        self.handles = [m.register_forward_hook(self._record)
                        for m in stage.modules() if type(m) is nn.Linear]

    @contextlib.contextmanager
    def recording(self, on: bool):
        self.linears = [] if on else None
        try:
            yield self.linears
        finally:
            self.linears = None

    def _record(self, mod, args, out):
        if self.linears is not None and out.requires_grad:
            entry = [mod, args[0], None]
            self.linears.append(entry)
            out.register_hook(lambda g: entry.__setitem__(2, g))

    def remove(self):
        for h in self.handles:
            h.remove()


class _Into(torch.autograd.Function):
    """A leaf's gradient, handed to autograd: its backward *is* the given gradient."""

    @staticmethod
    def forward(ctx, leaf, grad):
        ctx.grad = grad
        return leaf.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.grad, None


def accumulate_grads(params, grads) -> None:
    """params[i].grad += grads[i] — through autograd, never by assigning `.grad`, so every
    hook that watches a gradient arrive (DDP's buckets, ZeRO's reduce-scatters) sees it."""
    if params:
        torch.autograd.backward([_Into.apply(p, g) for p, g in zip(params, grads, strict=True)])


# --------------------------------------------------------------------------- the stages

def partition(n_layers: int, n_stages: int, layer_costs=None) -> list[range]:
    """Contiguous layer ranges, one per stage. Without costs: the one stage split
    (`parallel_layout.stage_layers`: equal counts where they divide, else one layer fewer on
    the end stages first). With `layer_costs`: the split that minimises the largest stage cost."""
    if n_stages < 1 or n_stages > n_layers:
        raise ValueError(f"{n_stages} stages for {n_layers} layers: need 1 ≤ stages ≤ layers")
    if layer_costs is None:
        return stage_ranges(n_layers, n_stages)
    costs = [float(c) for c in layer_costs]
    if len(costs) != n_layers:
        raise ValueError(f"layer_costs has {len(costs)} entries for {n_layers} layers")
    # best[j][s]: the smallest max-stage-cost that splits the first j layers into s stages
    INF = float("inf")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    best = [[INF] * (n_stages + 1) for _ in range(n_layers + 1)]
    cut = [[0] * (n_stages + 1) for _ in range(n_layers + 1)]
    best[0][0] = 0.0
    for j in range(1, n_layers + 1):
        for s in range(1, min(j, n_stages) + 1):
            for i in range(s - 1, j):
                val = max(best[i][s - 1], pre[j] - pre[i])
                if val < best[j][s]:
                    best[j][s], cut[j][s] = val, i
    bounds, j = [], n_layers
    for s in range(n_stages, 0, -1):
        bounds.append(range(cut[j][s], j))
        j = cut[j][s]
    return bounds[::-1]


def split_stages(model: TinyLlama, n_stages: int, layer_costs=None) -> list[TinyLlama]:
    """All stages of `model`: the first embeds, the last ends in the norm, head and loss.
    They share `model`'s parameters; a rank keeps the ones it holds."""
    parts = partition(len(model.blocks), n_stages, layer_costs)
    return [model.part(layers, embed=i == 0, head=i == n_stages - 1)
            for i, layers in enumerate(parts)]


def schedule_stages(model: TinyLlama, sched: Schedule, layer_costs=None) -> dict[int, TinyLlama]:
    """{stage: module} for every stage of `sched`: each pipeline of the schedule cuts the whole
    model (one pipeline: split_stages(model, S); DualPipe: a second copy of the p stages for
    the other direction — separate modules that share `model`'s parameters). Ordered by the
    layers they hold (then by pipeline), so the two ranks of a DualPipe pair list the same
    layers in the same order: wrappers built in this order issue their collectives alike."""
    out = []
    for stages, _ in sched.pipes:
        for position, (s, part) in enumerate(zip(stages, split_stages(model, len(stages), layer_costs))):
            out.append((position, s, part))
    return {s: part for _, s, part in sorted(out, key=lambda x: x[:2])}


def pair_gradient_groups(stages: dict, mesh) -> dict:
    """{parameter: group} for `DDP(stage, mesh.group("dp", "cp"), groups=...)` (or ZeRO) under
    DualPipe: every parameter of this rank's stages is held by its pair too (pipeline ranks
    r and p−1−r), so its group is pair × dp × cp. The wrapper sums over that group and
    divides by the size of its own group (dp × cp), the rule for every gradient held by
    another set of ranks than the replicas (experts: edp). Collective (mesh.pairs()).
    `stages` must keep `schedule_stages`' order (by layers): the two ranks of a pair then
    build their wrappers, and issue their collectives, for the same layers in the same order."""
    p = mesh.size("pp")
    if list(stages) != sorted(stages, key=lambda s: (s % p, s)):
        raise ValueError(f"stages {list(stages)} are not in schedule_stages' order (by the layers "
                         f"they hold, {sorted(stages, key=lambda s: (s % p, s))}): the two ranks "
                         "of a pair would build their wrappers for different layers at once")
    mesh.pairs()
    group = mesh.group("pair", "dp", "cp")
    return {p: group for st in stages.values() for p in st.parameters() if p.requires_grad}


def stage_grads(stage: nn.Module, model: TinyLlama) -> dict[str, torch.Tensor]:
    """{model parameter name: grad} for the parameters this stage holds."""
    ids = {id(p) for p in stage.parameters()}
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if id(p) in ids and p.grad is not None}


# --------------------------------------------------------------------------- running a schedule

def _check_inputs(sched: Schedule, stages: dict, tokens, targets) -> None:
    """Clear errors for stages that do not fit the schedule and for micro-batches that do not
    fit each other (before any op runs)."""
    m = sched.n_micro
    if len(tokens) != m or len(targets) != m:
        raise ValueError(f"the schedule runs m={m} micro-batches; got {len(tokens)} token and "
                         f"{len(targets)} target micro-batches")
    shapes = {tuple(t.shape) for t in tokens} | {tuple(t.shape) for t in targets}
    if len(shapes) != 1:
        raise ValueError(f"micro-batches must all have one shape (b, s); got {sorted(shapes)}")
    for s, st in stages.items():
        first, last = sched.is_first(s), sched.is_last(s)
        if (st.embed is not None) != first or (st.lm_head is not None) != last:
            raise ValueError(
                f"stage {s} of this {sched.n_stages}-stage schedule "
                f"{'must' if first else 'must not'} embed and "
                f"{'must' if last else 'must not'} end in the head; were the stages "
                f"built for this schedule (schedule_stages(model, sched))?")


def _channels(sched: Schedule, rank: int) -> dict[int, list]:
    """For each sender, the messages it sends to `rank`, in its order: ("act"|"grad", stage, mb)
    where stage is the stage that consumes the message."""
    sr = sched.stage_ranks
    out: dict[int, list] = {}
    for src, seq in enumerate(sched.ops):
        if src == rank:
            continue
        for op in seq:
            nxt, prev = sched.next_stage(op.stage), sched.prev_stage(op.stage)
            if op.kind == "F" and nxt is not None and sr[nxt] == rank:
                out.setdefault(src, []).append(("act", nxt, op.mb))
            if op.kind in ("B", "BW") and prev is not None and sr[prev] == rank:
                out.setdefault(src, []).append(("grad", prev, op.mb))
    return out


class _Mailbox:
    """The messages of one rank: sends are posted at once (`comm.isend`, so compute never
    waits for a receiver); receives are posted AHEAD messages ahead on each sender's channel
    (`comm.irecv`); a receive takes the sender's messages in the sender's order, keeping any
    that come before they are needed; a message to a stage on this rank never leaves it.
    `send` collects inside an op's span, `flush` sends when the op ends (so emulated op
    costs are not overlapped by the sends)."""

    AHEAD = 2

    def __init__(self, sched, me, glob, group, shape, like):
        self.sched, self.me, self.glob, self.group = sched, me, glob, group
        self.shape, self.like = shape, like
        self.channels = {src: iter(msgs) for src, msgs in _channels(sched, me).items()}
        self.posted = {src: deque() for src in self.channels}  # (key, buffer, work), in order
        self.inbox: dict = {}   # (kind, stage, mb) -> tensor that arrived early or locally
        self.outbox: list = []
        self.pending: list = []  # posted sends, with their tensors kept alive
        for src in self.channels:
            for _ in range(self.AHEAD):
                self._post_recv(src)

    def _post_recv(self, src):
        key = next(self.channels[src], None)
        if key is not None:
            buf = torch.empty(self.shape, device=self.like.device, dtype=self.like.dtype)
            self.posted[src].append((key, buf, comm.irecv(buf, self.glob(src), group=self.group)))

    def recv(self, kind, stage, mb):
        key, sr = (kind, stage, mb), self.sched.stage_ranks
        src = sr[self.sched.prev_stage(stage) if kind == "act" else self.sched.next_stage(stage)]
        while key not in self.inbox:
            got, buf, work = self.posted[src].popleft()
            work.wait()
            self.inbox[got] = buf
            self._post_recv(src)
        return self.inbox.pop(key)

    def send(self, kind, stage, mb, tensor):
        self.outbox.append((kind, stage, mb, tensor))

    def flush(self):
        for kind, stage, mb, tensor in self.outbox:
            dst = self.sched.stage_ranks[stage]
            if dst == self.me:
                self.inbox[(kind, stage, mb)] = tensor
            else:
                work = comm.isend(tensor, self.glob(dst), group=self.group)
                self.pending.append((work, tensor))
        self.outbox.clear()

    def close(self, wait: bool = True):
        """Wait until every send is delivered (not after a failure: a peer may be gone)."""
        if wait:
            for work, _ in self.pending:
                work.wait()
        self.pending.clear()


def _check_data_parallel(data_parallel: dict, stages: dict) -> None:
    if set(data_parallel) - set(stages):
        raise ValueError(f"data_parallel names stages {sorted(set(data_parallel) - set(stages))} "
                         f"this rank does not hold ({sorted(stages)})")
    for s, wrapper in data_parallel.items():
        if getattr(wrapper, "stage", None) == 3:
            raise ValueError(f"{ZERO3_PIPELINE} (stage {s})")


def run_schedule(sched: Schedule, stages: dict, tokens, targets, timeline=None,
                 group_ranks=None, group=None, measure=None,
                 loss_fn=None, data_parallel=None) -> dict:
    """Run this rank's ops of `sched`. `stages` = {stage index: stage} for the stages this
    rank holds (from `schedule_stages`); `tokens`/`targets` = lists of m micro-batches of one
    shape (b, s), given on every rank (the stages that embed or end in the loss use them;
    the others take the shape of the messages from them). The loss is the mean over
    micro-batches of each one's `loss_fn(logits, targets)` (default: the last stage's own
    `loss_fn`), so gradients equal one process on the whole batch. Gradients accumulate in the stages' `.grad`, through autograd.
    `group_ranks[r]` is the global rank of pipeline rank r (default: r). `measure`: a
    memory.SavedActivations to open around the step (for its peak). `data_parallel` =
    {stage: DDP or ZeRO wrapping that stage}: gradients accumulate without communication
    until the stage's last backward op of the step, which synchronises them (the executor
    tells the wrapper which one that is).
    Returns {"loss": the summed loss of the micro-batches whose last stage this rank holds
    (else None); with two pipelines (DualPipe) two ranks hold a part, the sum is the loss}."""
    validate(sched)
    me = torch.distributed.get_rank()
    me = group_ranks.index(me) if group_ranks else me
    glob = (lambda r: group_ranks[r]) if group_ranks else (lambda r: r)
    mine = set(sched.stages_of(me))
    if set(stages) != mine:
        raise ValueError(f"rank {me} holds stages {sorted(mine)} in this schedule, "
                         f"got {sorted(stages)}")
    _check_inputs(sched, stages, tokens, targets)
    data_parallel = data_parallel or {}
    _check_data_parallel(data_parallel, stages)
    first = stages[min(stages)]
    mail = _Mailbox(sched, me, glob, group, first.hidden_shape(*tokens[0].shape),
                    like=next(first.parameters()))  # receive buffers: the stage's device, dtype

    def span(op):
        if timeline is None:
            return contextlib.nullcontext()
        return timeline.span(op.kind, mb=op.mb, stage=op.stage, chunk=sched.chunk(op.stage))

    run = Executor(sched, stages, tokens, targets, mail, span, loss_fn, data_parallel)
    ok = False
    try:
        with measure if measure is not None else contextlib.nullcontext():
            loss = run.run()
        ok = True
    finally:
        mail.close(wait=ok)
        run.close()
    return {"loss": loss}
