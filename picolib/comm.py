"""The collectives, behind one thin instrumented layer (lesson 00).

Every technique in picolib talks to other ranks through these functions, so a lesson can
open a `Ledger` around a training step and read back what moved:

    with Ledger() as ledger:
        all_reduce(grad, group=dp_group)
    ledger.total("sent_bytes")      # bytes this rank put on the wire

Each record holds the op, the group size, the payload bytes (the full buffer of the
collective), the bytes this rank sends under the standard algorithm, the wall time and the
global ranks taking part (the trainer sorts traffic into DP, TP, PP, CP and EP by them).

Two kinds of implementation:
- the *native* ones call torch.distributed (gloo's or NCCL's own algorithms). Their
  `sent_bytes` is the textbook cost of the ring (or direct) algorithm, computed by
  `ring_sent_bytes` — a model, marked `measured=False`;
- `ring_reduce_scatter`, `ring_all_gather` and `ring_all_reduce` are picolib's own rings,
  built from send/recv; their `sent_bytes` adds up the tensors actually sent
  (`measured=True`). Lesson 00 uses them to check the formulas against real traffic.

To *measure* a technique's traffic rather than compute it, open the ledger with
`Ledger(rings=True)`: while it is open, `all_reduce`, `reduce_scatter` and `all_gather` run on
picolib's rings (any size, sum / avg / max), their records carry `measured=True`, and
`ledger.measured_total()` sums the bytes counted as sent — raising `NotMeasured` if a record
it sums was computed (a native broadcast, all-to-all or send). Lessons 04 and 05 measure the
tensor- and sequence-parallel traffic this way. The rings are slower than gloo's own
collectives: use them to count, not to train.

The ring formulas for B payload bytes on N ranks (each rank sends, per collective):
    reduce-scatter, all-gather: (N−1)/N · B        all-reduce: 2(N−1)/N · B
    all-to-all (direct):        (N−1)/N · B        broadcast (pipelined chain): B, 0 for the last rank
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Record", "Ledger", "NotMeasured", "measured_total", "ring_sent_bytes", "all_reduce",
           "reduce_scatter", "all_gather",
           "broadcast", "all_to_all", "send", "recv", "isend", "irecv", "exchange", "barrier",
           "ring_neighbours", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


@dataclass
class Record:
    op: str
    group_size: int
    nbytes: int              # the collective's full buffer (for send/recv: the tensor)
    sent_bytes: int          # what this rank puts on the wire
    seconds: float | None    # wall time; for async ops, from issue to the end of wait()
    measured: bool = False   # True when sent_bytes was counted, not computed
    meta: dict = field(default_factory=dict)
    ranks: tuple = ()        # the global ranks taking part (point-to-point: this rank, the peer)


class NotMeasured(ValueError):
    """A total asked for as measured includes records whose bytes were computed."""


def measured_total(records, what: str = "sent_bytes", op: str | None = None) -> int:
    """Sum `what` over `records` (a Ledger, its Records, or `as_dicts()` rows; only `op` if
    given), refusing to call a computed number measured: raises `NotMeasured`, naming the
    records, if any record summed carries `measured=False`."""
    rows = records.records if isinstance(records, Ledger) else list(records)
    get = (lambda r, k: r[k]) if rows and isinstance(rows[0], dict) else getattr
    rows = [r for r in rows if op is None or get(r, "op") == op]
    computed = [get(r, "op") for r in rows if not get(r, "measured")]
    if computed:
        raise NotMeasured(f"{len(computed)} of {len(rows)} records were computed from the ring "
                          f"formula, not counted ({sorted(set(computed))}); open the ledger with "
                          f"Ledger(rings=True) or call the result computed")
    return sum(get(r, what) or 0 for r in rows)


class Ledger:
    """Records every picolib collective called while it is open (in this process only).

    Ledgers nest: an inner ledger's records also reach the outer ones. With `rings=True`,
    all_reduce, reduce_scatter and all_gather run on picolib's own rings while it is open, so
    their bytes are counted as sent (`measured=True`; module docstring). With
    `keep_inputs=True`, `inputs` gets (record, a copy of the tensor this rank handed in) for
    each native all_reduce, reduce_scatter, all_gather, broadcast and blocking send (not on the
    rings): what a rank sent, which a grader reads (lesson 03's ZeRO-1 check)."""

    _open: list["Ledger"] = []

    def __init__(self, rings: bool = False, keep_inputs: bool = False):
        self.records: list[Record] = []
        self.rings = rings
        self.keep_inputs = keep_inputs
        self.inputs: list[tuple[Record, torch.Tensor]] = []

    def __enter__(self):
        Ledger._open.append(self)
        return self

    def __exit__(self, *exc):
        Ledger._open.remove(self)

    def select(self, op: str | None = None) -> list[Record]:
        return [r for r in self.records if op is None or r.op == op]

    def count(self, op: str | None = None) -> int:
        return len(self.select(op))

    def total(self, what: str = "sent_bytes", op: str | None = None):
        return sum(getattr(r, what) or 0 for r in self.select(op))

    def summary(self) -> dict[str, dict]:
        """{op: {"calls", "nbytes", "sent_bytes", "seconds"}} — picklable, for returning from a rank."""
        out: dict[str, dict] = {}
        for r in self.records:
            s = out.setdefault(r.op, {"calls": 0, "nbytes": 0, "sent_bytes": 0, "seconds": 0.0})
            s["calls"] += 1
            s["nbytes"] += r.nbytes
            s["sent_bytes"] += r.sent_bytes
            s["seconds"] += r.seconds or 0.0
        return out

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def measured_total(self, what: str = "sent_bytes", op: str | None = None) -> int:
        """`total`, but raises `NotMeasured` if any record summed was computed (measured=False)."""
        return measured_total(self, what, op)

    @staticmethod
    def _add(record: Record, given: torch.Tensor | None = None):
        if _TAGS:
            record.meta = {**record.meta, **_TAGS}
        for ledger in Ledger._open:
            ledger.records.append(record)
            if ledger.keep_inputs and given is not None:
                ledger.inputs.append((record, given.detach().clone()))

    @staticmethod
    def _on_rings() -> bool:
        return any(ledger.rings for ledger in Ledger._open)


_TAGS: dict = {}


@contextmanager
def tagged(**meta):
    """Every record made inside also carries `meta`: what a collective is for, which its
    ranks alone may not tell. The data-parallel wrappers tag their gradient syncs
    `purpose="gradients"` (an expert's replicas can be exactly the context-parallel ranks,
    whose balancing statistics are all-reduced too); `train` counts those as DP."""
    old = dict(_TAGS)
    _TAGS.update(meta)
    try:
        yield
    finally:
        _TAGS.clear()
        _TAGS.update(old)


def ring_sent_bytes(op: str, nbytes: int, n: int, rank: int = 0, root: int = 0) -> int:
    """Bytes one rank sends for a collective over `nbytes` on `n` ranks (module docstring)."""
    if n == 1:
        return 0
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return nbytes * (n - 1) // n
    if op == "all_reduce":
        return 2 * nbytes * (n - 1) // n
    if op == "broadcast":  # chain root → root+1 → ...: everyone but the last forwards B
        return 0 if (rank - root) % n == n - 1 else nbytes
    if op == "send":
        return nbytes
    if op == "recv":
        return 0
    raise ValueError(f"unknown collective {op!r}")


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timed:
    """Wraps an async Work so that wait() completes the ledger record's time (and keeps a
    CPU copy staged for gloo alive until then)."""

    def __init__(self, work, record: Record, t0: float, staged=None, then=None):
        self._work, self._record, self._t0, self._staged, self._then = work, record, t0, staged, then

    def wait(self):
        self._work.wait()
        if self._then is not None:
            self._then()
            self._then = None
        self._record.seconds = time.perf_counter() - self._t0
        self._staged = None
        return True

    def is_completed(self):
        return self._work.is_completed()


def _nothing_to_move(*tensors) -> bool:
    """Meta tensors (the dry run, lesson 11) have no values to move: a call on them is recorded
    in the ledger as any other and not handed to the backend (torch 2.6 has no meta kernels
    for the collectives)."""
    return all(t.is_meta for t in tensors)


def _members(group, peer: int | None = None) -> tuple:
    if peer is not None:
        return dist.get_rank(), peer
    return tuple(dist.get_process_group_ranks(group) if group is not None
                 else range(dist.get_world_size()))


def _native(op, call, nbytes, group, async_op, rank_in_group=0, root=0, meta=None, peer=None,
            then=None, tensors=()):
    n = dist.get_world_size(group)
    rec = Record(op, n, nbytes, ring_sent_bytes(op, nbytes, n, rank_in_group, root), None,
                 meta=meta or {}, ranks=_members(group, peer))
    Ledger._add(rec, tensors[-1] if tensors and op != "recv" else None)   # the input comes last
    t0 = time.perf_counter()
    work = _Done() if _nothing_to_move(*tensors) else call(async_op)
    if async_op:
        return _Timed(work, rec, t0, then=then)
    if then is not None:
        then()
    rec.seconds = time.perf_counter() - t0
    return None


def _sum_then_divide(op: str, tensor, group) -> bool:
    """gloo's average is not the same in every torch: torch 2.6's all-reduce refuses AVG and
    its reduce-scatter sums instead (both measured; pytorch/pytorch#149781 added AVG to gloo in
    2025, and #162338 reports wrong gloo averages after that). On gloo picolib sums and divides
    by the group's size itself — what gloo's own AVG does where it has one; NCCL keeps AVG."""
    if op != "avg":
        return False
    backend = str(dist.get_backend(group)).lower()
    return "gloo" in backend and not (tensor.is_cuda and "nccl" in backend)


def _reduction(op: str, result, group):
    """(the ReduceOp to call, what to do to `result` once it has arrived, or None)."""
    if _sum_then_divide(op, result, group):
        n = dist.get_world_size(group)
        return dist.ReduceOp.SUM, lambda: result.div_(n)
    return _REDUCE_OPS[op], None


def all_reduce(tensor, op: str = "sum", group=None, async_op: bool = False):
    """In place: every rank ends with the reduction (sum / avg / max) of all ranks' tensors."""
    if Ledger._on_rings():
        return _routed(_rings_all_reduce, async_op, tensor, op, group)
    reduce_op, then = _reduction(op, tensor, group)
    return _native("all_reduce", lambda a: dist.all_reduce(tensor, reduce_op, group, a),
                   _bytes(tensor), group, async_op, then=then, tensors=(tensor,))


def reduce_scatter(output, input, op: str = "sum", group=None, async_op: bool = False):
    """Rank r gets chunk r of the reduction: input has N·output.numel() elements."""
    if Ledger._on_rings():
        return _routed(_rings_reduce_scatter, async_op, output, input, op, group)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_op, then = _reduction(op, output, group)
    return _native("reduce_scatter", lambda a: fn(output, input, reduce_op, group, a),
                   _bytes(input), group, async_op, then=then, tensors=(output, input))


def all_gather(output, input, group=None, async_op: bool = False):
    """Every rank gets all ranks' inputs, concatenated along dim 0, in rank order."""
    if Ledger._on_rings():
        return _routed(_rings_all_gather, async_op, output, input, group)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _native("all_gather", lambda a: fn(output, input, group, a),
                   _bytes(output), group, async_op, tensors=(output, input))


def broadcast(tensor, src: int, group=None, async_op: bool = False):
    """In place: every rank gets `src`'s tensor (`src` is a global rank)."""
    me = dist.get_rank(group)
    root = dist.get_group_rank(group, src) if group is not None else src
    return _native("broadcast", lambda a: dist.broadcast(tensor, src, group, a),
                   _bytes(tensor), group, async_op, rank_in_group=me, root=root, tensors=(tensor,))


def all_to_all(output, input, group=None, output_split_sizes=None, input_split_sizes=None,
               async_op: bool = False):
    """Rank r sends chunk j of its input to rank j and receives chunk r of every rank's input."""
    n = dist.get_world_size(group)
    if input_split_sizes is None:
        sent = _bytes(input) * (n - 1) // n
    else:
        me = dist.get_rank(group)
        row = input[0:1].numel() * input.element_size() if input.dim() else input.element_size()
        sent = sum(s for j, s in enumerate(input_split_sizes) if j != me) * row
    rec = Record("all_to_all", n, _bytes(input), sent, None, ranks=_members(group))
    Ledger._add(rec)
    t0 = time.perf_counter()
    work = _Done() if _nothing_to_move(output, input) else dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    if async_op:
        return _Timed(work, rec, t0)
    rec.seconds = time.perf_counter() - t0


def _through_cpu(tensor, group) -> bool:
    """gloo reduces, gathers and scatters CUDA tensors but cannot send or receive them: a
    point-to-point message of a CUDA tensor over gloo travels through a CPU copy."""
    return tensor.is_cuda and "nccl" not in str(dist.get_backend(group)).lower()


def _outgoing(tensor, group):
    return tensor.cpu() if _through_cpu(tensor, group) else tensor


def _incoming(tensor, group):
    """(buffer to receive into, (destination, buffer) to copy back after the wait, or None)."""
    if not _through_cpu(tensor, group):
        return tensor, None
    buf = torch.empty(tensor.shape, dtype=tensor.dtype)
    return buf, (tensor, buf)


def send(tensor, dst: int, group=None):
    """Blocking point-to-point send to global rank `dst`."""
    out = _outgoing(tensor, group)
    return _native("send", lambda a: dist.send(out, dst, group), _bytes(tensor), group, False,
                   peer=dst, tensors=(tensor,))


def isend(tensor, dst: int, group=None):
    """Non-blocking send to global rank `dst`: returns at once; `.wait()` returns when the
    receiver has it. Messages to one peer arrive in the order they were posted. Keep
    `tensor` unchanged until then."""
    rec = Record("send", dist.get_world_size(group), _bytes(tensor), _bytes(tensor), None,
                 meta={"peer": dst}, ranks=_members(group, dst))
    Ledger._add(rec)
    out = _outgoing(tensor, group)
    work = _Done() if _nothing_to_move(tensor) else dist.isend(out, dst, group)
    return _Timed(work, rec, time.perf_counter(), staged=out)


def recv(tensor, src: int, group=None):
    """Blocking point-to-point receive from global rank `src`, into `tensor`."""
    buf, back = _incoming(tensor, group)
    _native("recv", lambda a: dist.recv(buf, src, group), _bytes(tensor), group, False, peer=src,
            tensors=(tensor,))
    if back:
        tensor.copy_(buf)


def irecv(tensor, src: int, group=None):
    """Non-blocking receive from global rank `src` into `tensor`: returns at once; `tensor`
    holds the message after `.wait()`. Receives posted to one peer take its messages in order."""
    buf, back = _incoming(tensor, group)
    return _native("recv", lambda a: dist.irecv(buf, src, group), _bytes(tensor), group, True,
                   peer=src, then=(lambda: tensor.copy_(buf)) if back else None, tensors=(tensor,))


class _Exchange:
    """The handle of an async `exchange`: `wait()` waits for every send and receive, then
    completes their ledger records."""

    def __init__(self, works, records, t0, copy_back=()):
        self._works, self._records, self._t0, self._copy_back = works, records, t0, copy_back

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def wait(self):
        for w in self._works:
            w.wait()
        for dst, buf in self._copy_back:
            dst.copy_(buf)
        self._copy_back = ()
        dt = time.perf_counter() - self._t0
        for r in self._records:
            r.seconds = dt
        return True


def exchange(sends=(), recvs=(), group=None, async_op: bool = False):
    """Post all sends [(tensor, dst)] and receives [(tensor, src)] at once, then wait.

    Batching lets two neighbours send to each other without deadlock (ranks are global).
    With `async_op` it returns at once with a handle: compute, then `.wait()` (ring
    attention overlaps its K/V hops with the block computation this way, lesson 06)."""
    ops = [dist.P2POp(dist.isend, _outgoing(t, group), peer, group) for t, peer in sends]
    incoming = [_incoming(t, group) for t, _ in recvs]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for (buf, _), (_, peer) in zip(incoming, recvs)]
    n = dist.get_world_size(group)
    recs = [Record("send", n, _bytes(t), _bytes(t), None, meta={"peer": p},
                   ranks=_members(group, p)) for t, p in sends]
    recs += [Record("recv", n, _bytes(t), 0, None, meta={"peer": p},
                    ranks=_members(group, p)) for t, p in recvs]
    for r in recs:
        Ledger._add(r)
    t0 = time.perf_counter()
    moves = ops and not _nothing_to_move(*(t for t, _ in (*sends, *recvs)))
    handle = _Exchange(dist.batch_isend_irecv(ops) if moves else [], recs, t0,
                       [back for _, back in incoming if back])
    if async_op:
        return handle
    handle.wait()


def barrier(group=None):
    dist.barrier(group)


# ------------------------------------------------------------------- picolib's own rings

def ring_neighbours(group):
    """(N, this rank's index, the global ranks of its right and left neighbours) in `group`'s ring."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    return n, me, to_global((me + 1) % n), to_global((me - 1) % n)


def _ring_step(send_buf, recv_buf, right, left, group):
    """Send one chunk right, receive one from the left. Uneven chunks (routed collectives)
    may be empty: both ends know the sizes, so an empty one is skipped on both."""
    buf, back = _incoming(recv_buf, group)
    ops = [dist.P2POp(dist.isend, _outgoing(send_buf, group), right, group)] if send_buf.numel() else []
    ops += [dist.P2POp(dist.irecv, buf, left, group)] if recv_buf.numel() else []
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    if back and recv_buf.numel():
        recv_buf.copy_(buf)
    return _bytes(send_buf)


@contextmanager
def _ring_record(op, nbytes, group):
    rec = Record(op, dist.get_world_size(group), nbytes, 0, None, measured=True,
                 meta={"algorithm": "ring"}, ranks=_members(group))
    t0 = time.perf_counter()
    yield rec
    rec.seconds = time.perf_counter() - t0
    Ledger._add(rec)


def _reduce_scatter_steps(chunks, n, me, right, left, group, op: str = "sum", on_step=None):
    """N−1 steps: in step k, send the running sum of chunk (me−k−1) to the right, add what
    arrives from the left into chunk (me−k−2). Afterwards chunk me holds the full sum
    (the maximum for op="max"; "avg" sums, the caller divides)."""
    sent = 0
    for k in range(n - 1):
        s, r = (me - k - 1) % n, (me - k - 2) % n
        incoming = torch.empty_like(chunks[r])
        if on_step is not None:
            on_step(chunks[s], right)
        sent += _ring_step(chunks[s], incoming, right, left, group)
        if op == "max":
            torch.maximum(chunks[r], incoming, out=chunks[r])
        else:
            chunks[r] += incoming
    return sent


def _all_gather_steps(chunks, n, me, right, left, group, on_step=None):
    """N−1 steps: pass along the chunk received last; each rank ends with all N."""
    sent = 0
    for k in range(n - 1):
        s, r = (me - k) % n, (me - k - 1) % n
        if on_step is not None:
            on_step(chunks[s], right)
        sent += _ring_step(chunks[s], chunks[r], right, left, group)
    return sent


def _ring_chunks(tensor, n: int, op: str) -> list[torch.Tensor]:
    if tensor.numel() % n:
        raise ValueError(f"{op}: {tensor.numel()} elements do not divide by {n} ranks")
    return list(tensor.view(-1).chunk(n))


def ring_reduce_scatter(tensor, group=None) -> torch.Tensor:
    """Sum over ranks, rank r keeps chunk r (returned). `tensor.numel()` must divide by N; it
    is used as scratch space."""
    n, me, right, left = ring_neighbours(group)
    chunks = _ring_chunks(tensor, n, "ring_reduce_scatter")
    with _ring_record("reduce_scatter", _bytes(tensor), group) as rec:
        rec.sent_bytes = _reduce_scatter_steps(chunks, n, me, right, left, group)
    return chunks[me].clone()


def ring_all_gather(shard, group=None) -> torch.Tensor:
    """Concatenate every rank's `shard` in rank order, passing chunks around the ring."""
    n, me, right, left = ring_neighbours(group)
    out = torch.empty(n * shard.numel(), dtype=shard.dtype, device=shard.device)
    chunks = list(out.chunk(n))
    chunks[me].copy_(shard.reshape(-1))
    with _ring_record("all_gather", _bytes(out), group) as rec:
        rec.sent_bytes = _all_gather_steps(chunks, n, me, right, left, group)
    return out


def ring_all_reduce(tensor, group=None, on_step=None) -> torch.Tensor:
    """In place sum over ranks = ring reduce-scatter followed by ring all-gather. `on_step`:
    called as on_step(chunk, right) before each step sends `chunk` (a view of `tensor`) to
    global rank `right` (lesson 00 draws the steps)."""
    n, me, right, left = ring_neighbours(group)
    chunks = _ring_chunks(tensor, n, "ring_all_reduce")
    with _ring_record("all_reduce", _bytes(tensor), group) as rec:
        rec.sent_bytes = _reduce_scatter_steps(chunks, n, me, right, left, group, on_step=on_step)
        rec.sent_bytes += _all_gather_steps(chunks, n, me, right, left, group, on_step=on_step)
    return tensor


# ------------------------------------- all_reduce / reduce_scatter / all_gather on the rings
# (while a Ledger(rings=True) is open): any size, chunks as even as torch.tensor_split makes them

class _Done:
    """The handle of a call that has already finished (a routed collective called with
    async_op) or had nothing to move (meta tensors)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def _routed(fn, async_op, *args):
    fn(*args)
    return _Done() if async_op else None


def _check_op(op):
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; one of {sorted(_REDUCE_OPS)}")


def _rings_all_reduce(tensor, op, group):
    _check_op(op)
    n, me, right, left = ring_neighbours(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, n))
    with _ring_record("all_reduce", _bytes(tensor), group) as rec:
        rec.sent_bytes = _reduce_scatter_steps(chunks, n, me, right, left, group, op)
        rec.sent_bytes += _all_gather_steps(chunks, n, me, right, left, group)
    if op == "avg":
        flat /= n
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def _rings_reduce_scatter(output, input, op, group):
    _check_op(op)
    n, me, right, left = ring_neighbours(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, not "
                         f"{n} × {output.numel()}")
    chunks = list(input.reshape(-1).clone().chunk(n))      # the caller's input stays as it was
    with _ring_record("reduce_scatter", _bytes(input), group) as rec:
        rec.sent_bytes = _reduce_scatter_steps(chunks, n, me, right, left, group, op)
    output.view(-1).copy_(chunks[me] / n if op == "avg" else chunks[me])


def _rings_all_gather(output, input, group):
    n, me, right, left = ring_neighbours(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, not "
                         f"{n} × {input.numel()}")
    flat = output.view(-1)
    chunks = list(flat.chunk(n))
    chunks[me].copy_(input.reshape(-1))
    with _ring_record("all_gather", _bytes(output), group) as rec:
        rec.sent_bytes = _all_gather_steps(chunks, n, me, right, left, group)
