"""Context parallelism: each of N ranks holds a slice of the sequence (lesson 06).

Every layer of the model works token by token — except attention, where each query needs
the keys and values of all earlier tokens. So the sequence can be cut over N ranks (the
mesh's "cp" dimension) everywhere, as long as attention brings the missing K/V in. Three
ways, all exact (`picolib.blockwise_attention` merges the pieces with the online softmax):

- **ring** (ring attention): K/V blocks travel around the ring of ranks, one hop per step,
  each hop a non-blocking send/recv posted before the step's block computation so that it
  hides behind it. A rank holds one K/V block besides its own (plus the one arriving). The
  backward sends K/V around again and passes the accumulating dK/dV along with them; after
  the last step one more hop brings each block's gradient home. Point-to-point traffic,
  not an all-to-all.
- **allgather** (Llama 3): one all-gather of K/V, then local attention; its backward is a
  reduce-scatter of dK/dV. Simple, but every rank holds all N blocks.
- **ulysses** (DeepSpeed-Ulysses): an all-to-all turns "all heads, s/N tokens" into
  "a/N heads, all tokens", attention runs locally, a second all-to-all turns it back. The
  heads must divide by N.

The layout says which tokens a rank holds. `contiguous`: rank r holds chunk r of N. Under
the causal mask the last rank then computes 2N−1 times the first rank's scores.
`zigzag`: the sequence is cut into 2N chunks and rank r holds chunks r and 2N−1−r, an
early and a late one, so every rank computes the same number of scores. RoPE needs each
token's true position, so the layout also gives the position ids.

Gradients: a rank's weights see only its tokens, so the weight gradients are summed over
the cp ranks as over dp ranks — wrap the model in DDP or ZeRO over `mesh.group("dp", "cp")`
(each rank's loss is the mean over its tokens; the average over dp×cp is the global mean).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .comm import ring_neighbours
from .blockwise_attention import (add_block_grads, block_forward, chunked_attention, count, merge,
                                  unmasked_scores, visible_pairs)
from .mappings import all_gather_to_region
from .mesh import dim_group
from .model import AttentionCore, LlamaConfig, TinyLlama, repeat_kv, upcast

__all__ = ["LAYOUTS", "ALGORITHMS", "chunk_len", "chunk_ids", "positions", "shard_sequence",
           "unshard_sequence", "check_context_parallel", "ring_attention", "ring_attention_forward",
           "ring_attention_backward", "post_hop", "allgather_attention", "seq_to_heads",
           "heads_to_seq", "ulysses_attention", "ContextParallelAttention", "apply_context_parallel",
           "ring_step_cost"]

LAYOUTS = ("contiguous", "zigzag")
ALGORITHMS = ("ring", "allgather", "ulysses")


# ------------------------------------------------------------------ the core: layouts

def chunk_ids(layout: str, rank: int, n: int) -> list[int]:
    """The chunks rank `rank` of `n` holds: [r] of n (contiguous), [r, 2n−1−r] of 2n (zigzag)."""
    return [rank] if _layout(layout) == "contiguous" else [rank, 2 * n - 1 - rank]


def shard_sequence(x: torch.Tensor, layout: str, rank: int, n: int, dim: int = 1) -> torch.Tensor:
    """The tokens rank `rank` holds of `x` (its chunks along `dim`, concatenated)."""
    c = chunk_len(layout, n, x.shape[dim])
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(layout, rank, n)], dim)


# ------------------------------------------------------------------ the core: ring attention

def ring_attention_forward(q, k, v, group=None, layout: str = "zigzag", work=None, timeline=None):
    """(output, lse) of this rank's queries against every rank's K/V, passed round the ring."""
    n, me, right, left = ring_neighbours(group)
    mine = chunk_ids(layout, me, n)                  # this rank's query chunks
    qs = q.chunk(len(mine), 2)
    o = [qc.new_zeros(qc.shape, dtype=upcast(qc).dtype) for qc in qs]   # running output and
    lse = [oc.new_full(oc.shape[:-1], float("-inf")) for oc in o]       # lse of each chunk
    kv = torch.stack((k, v))                         # this rank's K and V: one message per hop
    for step in range(n):
        src = (me - step) % n                        # whose K/V this rank holds now
        if step < n - 1:
            hop = post_hop(kv, right, left, group)   # send it right, receive the left's (async)
        theirs = chunk_ids(layout, src, n)
        ks, vs = kv[0].chunk(len(theirs), 2), kv[1].chunk(len(theirs), 2)
        pairs = visible_pairs(mine, theirs)          # (query chunk, key chunk, kind), unmasked
        with _attend(timeline, work, pairs, qs, step=step, src=src):
            for a, b, kind in pairs:
                merge(o[a], lse[a], *block_forward(qs[a], ks[b], vs[b], kind == "diagonal"))
        if step < n - 1:
            kv = hop.wait(timeline, step=step)       # the next block has arrived
    return torch.cat(o, 2), torch.cat(lse, 2)


def ring_attention_backward(do, q, k, v, out, lse, group=None, layout: str = "zigzag"):
    """(dq, dk, dv): K/V go round the ring again, each block's dK/dV one hop behind it."""
    n, me, right, left = ring_neighbours(group)
    mine = chunk_ids(layout, me, n)
    delta = (do * out).sum(-1)                       # Δ = rowsum(dO ∘ O), one per query
    dq = torch.zeros_like(q, dtype=do.dtype)
    kv, dkv_hop = torch.stack((k, v)), None
    for step in range(n):
        src = (me - step) % n                        # whose K/V this rank holds now
        if step < n - 1:
            kv_hop = post_hop(kv, right, left, group)
        dkv = torch.zeros_like(kv, dtype=do.dtype)   # this rank's share of src's dK/dV
        add_block_grads(do, q, kv[0], kv[1], lse, delta, mine, chunk_ids(layout, src, n),
                        dq, dkv[0], dkv[1])
        if dkv_hop is not None:                      # plus the shares of the ranks src passed
            dkv += dkv_hop.wait()
        if n > 1:                                    # pass src's dK/dV on, behind its K/V
            dkv_hop = post_hop(dkv, right, left, group)
        if step < n - 1:
            kv = kv_hop.wait()
    if dkv_hop is not None:
        dkv = dkv_hop.wait()                         # the last hop: this rank's own block
    return dq, dkv[0], dkv[1]


# ------------------------------------------------------------------ the core: all-gather K/V, Ulysses

def allgather_attention(q, k, v, group=None, layout: str = "zigzag", work: dict | None = None):
    """Llama 3's variant: all-gather K/V (backward: reduce-scatter dK/dV), attend locally."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    kv = all_gather_to_region(torch.stack((k, v)), 3, group)   # (2, b, kv, s, d), rank order
    all_ids = [i for r in range(n) for i in chunk_ids(layout, r, n)]
    return chunked_attention(q, kv[0], kv[1], chunk_ids(layout, me, n), all_ids, work)


def seq_to_heads(x, group=None):
    """(b, h, s/N, d) → (b, h/N, s, d) by one all-to-all; tokens end in rank order."""
    n = dist.get_world_size(group)
    b, h, m, d = x.shape
    send = x.reshape(b, n, h // n, m, d).movedim(1, 0).contiguous()   # send[j]: head group j
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)                          # recv[j]: rank j's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * m, d)


def heads_to_seq(x, group=None):
    """(b, h/N, s, d) → (b, h, s/N, d): the inverse all-to-all."""
    n = dist.get_world_size(group)
    b, hn, s, d = x.shape
    send = x.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()   # send[j]: j's tokens
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)                          # recv[j]: head group j
    return recv.movedim(0, 1).reshape(b, n * hn, s // n, d)


def ulysses_attention(q, k, v, group=None, layout: str = "zigzag", work: dict | None = None):
    """DeepSpeed-Ulysses: all-to-all to a/N heads of all tokens, attention, all-to-all back."""
    n, a = dist.get_world_size(group), q.shape[1]
    if a % n:
        raise ValueError(f"Ulysses splits {a} query heads over {n} ranks: they must divide")
    if k.shape[1] % n:
        k, v = repeat_kv(k, a // k.shape[1]), repeat_kv(v, a // k.shape[1])
    kv_heads = k.shape[1]
    # one all-to-all for all three: head group j of q, k and v side by side goes to rank j
    qkv = torch.cat([t.unflatten(1, (n, t.shape[1] // n)) for t in (q, k, v)], 2).flatten(1, 2)
    q, k, v = _SeqHeads.apply(qkv, group, True).split((a // n, kv_heads // n, kv_heads // n), 1)
    all_ids = [i for r in range(n) for i in chunk_ids(layout, r, n)]   # the sequence, rank order
    out = chunked_attention(q, k, v, all_ids, all_ids, work)           # a/N heads, all tokens
    return _SeqHeads.apply(out, group, False)


# ------------------------------------------------------------------ layouts: checks and inverses

def _layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {list(LAYOUTS)}")
    return layout


def chunk_len(layout: str, n: int, seq: int) -> int:
    """Tokens per chunk of a sequence of `seq` over n cp ranks: N chunks (contiguous) or 2N
    (zig-zag); a ValueError when they do not divide it."""
    parts = n if _layout(layout) == "contiguous" else 2 * n
    if seq % parts:
        raise ValueError(f"the sequence length {seq} must divide by {parts} "
                         f"({'N' if parts == n else '2N'} chunks, N = {n} cp ranks, {layout} layout)")
    return seq // parts


def positions(layout: str, rank: int, n: int, seq: int) -> torch.Tensor:
    """Positions (for RoPE) of the tokens rank `rank` holds of a `seq`-token sequence."""
    c = chunk_len(layout, n, seq)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(layout, rank, n)])


def unshard_sequence(parts: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: every rank's slice, in rank order → the whole sequence."""
    n = len(parts)
    chunks = {}
    for r, part in enumerate(parts):
        ids = chunk_ids(layout, r, n)
        chunks.update(zip(ids, part.chunk(len(ids), dim)))
    return torch.cat([chunks[i] for i in sorted(chunks)], dim)


def check_context_parallel(cfg: LlamaConfig, cp: int, algorithm: str = "ring",
                           layout: str = "zigzag", tp: int = 1, seq: int | None = None) -> None:
    """Refuse what cannot work, before any collective: unknown names, heads that Ulysses
    cannot split, a sequence that does not cut into the layout's chunks."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, not {cp!r}")
    _layout(layout)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown context-parallel algorithm {algorithm!r}; known: {list(ALGORITHMS)}")
    if algorithm == "ulysses" and (cfg.n_heads // tp) % cp:
        raise ValueError(f"Ulysses splits the {cfg.n_heads // tp} query heads of a rank "
                         f"(n_heads={cfg.n_heads}, tp={tp}) over cp={cp}: they must divide by cp")
    if seq is not None:
        chunk_len(layout, cp, seq)


# ------------------------------------------------------------------ ring attention: the machinery

class _Hop:
    """A posted hop: `buf` on its way to the right neighbour, the left one's arriving."""

    def __init__(self, buf, right, left, group):
        self.t0 = time.perf_counter()
        self.incoming = torch.empty_like(buf)
        self.work = comm.exchange([(buf, right)], [(self.incoming, left)], group, async_op=True)

    def wait(self, timeline=None, **meta):
        """The block that arrived (a `Timeline` records the hop as "kv", posting to arrival)."""
        if timeline is None:
            self.work.wait()
        else:
            timeline.wait("kv", self.work, self.t0, **meta)
        return self.incoming


def post_hop(buf, right, left, group) -> _Hop:
    """Post: send `buf` to the right neighbour, receive the left one's into a new buffer."""
    return _Hop(buf, right, left, group)


def _attend(timeline, work, pairs, qs, **meta):
    """Count a step's blocks into `work`; a `Timeline` records the step as "attn", its emulated
    cost per (s/N)² unmasked scores, any layout."""
    c, local = qs[0].shape[2], sum(qc.shape[2] for qc in qs)
    for *_, kind in pairs:
        count(work, kind, c)
    if timeline is None:
        return nullcontext()
    units = sum(unmasked_scores(kind, c) for *_, kind in pairs) / local ** 2
    return timeline.span("attn", size=units, **meta)     # emulated cost: emulate["attn"] × units


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, work, timeline):
        out, lse = ring_attention_forward(q, k, v, group, layout, work, timeline)
        out = out.to(q.dtype)
        ctx.group, ctx.layout = group, layout
        ctx.save_for_backward(q, k, v, out, lse)  # this rank's K/V only: one block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(upcast(dout), q, k, v, upcast(out), lse,
                                             ctx.group, ctx.layout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group=None, layout: str = "zigzag", work: dict | None = None,
                   timeline=None):
    """Causal attention of this rank's tokens (q: (b, a, s/N, d); k, v: (b, kv, s/N, d), in
    `layout`) against the whole sequence, K/V passed around the ring of `group`. `work`
    counts the blocks computed; a `Timeline` records each step's compute ("attn"; its
    emulated cost is per (s/N)² unmasked scores, so layouts compare) and each hop ("kv")."""
    return _RingAttention.apply(q, k, v, group, layout, work, timeline)


# ------------------------------------------------------------------ Ulysses: the autograd wrapper

class _SeqHeads(torch.autograd.Function):
    """Sequence-sharded → head-sharded (`to_heads`) or back; the backward is the other way."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (seq_to_heads if to_heads else heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = heads_to_seq if ctx.to_heads else seq_to_heads
        return back(grad.contiguous(), ctx.group), None, None


# ------------------------------------------------------------------ the transform

_ALGORITHM = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


class ContextParallelAttention(nn.Module):
    """The attention core of a context-parallel model: q, k, v of this rank's tokens in,
    attention over the whole sequence out, by `algorithm`. `work` accumulates the blocks
    and unmasked scores this rank computed (lesson 06 compares ranks with it)."""

    def __init__(self, group, layout: str = "zigzag", algorithm: str = "ring"):
        super().__init__()
        self.group, self.layout, self.algorithm = group, _layout(layout), algorithm
        self.work: dict[str, int] = {}

    def extra_repr(self) -> str:
        return f"algorithm={self.algorithm}, layout={self.layout}"

    def forward(self, q, k, v):
        return _ALGORITHM[self.algorithm](q, k, v, self.group, self.layout, self.work)


def apply_context_parallel(model: TinyLlama, cp=None, *, layout: str = "zigzag",
                           algorithm: str = "ring") -> TinyLlama:
    """Make `model` context-parallel over `cp` (a Mesh — its "cp" dimension — or a process
    group; None: all ranks), in place, and return it.

    Every block's attention core becomes a `ContextParallelAttention`, and the model's
    positions follow the layout: feed it this rank's tokens (`shard_sequence`) and it ropes
    them at their true positions. Composes with tensor (and sequence) parallelism in either
    order: the core sees this rank's heads."""
    group = dim_group(cp, "cp")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    attn = model.blocks[0].attn if len(model.blocks) else None
    tp = model.cfg.n_heads * attn.head_dim // attn.wq.weight.shape[0] if attn else 1  # TP first?
    check_context_parallel(model.cfg, n, algorithm, layout, tp=tp)
    for block in model.blocks:
        core = block.attn.core
        if isinstance(core, ContextParallelAttention):
            raise ValueError("this model is context-parallel already")
        if type(core) is not AttentionCore:
            raise TypeError(f"context parallelism replaces the attention core, and cannot wrap "
                            f"a {type(core).__name__} (it knows picolib.model.AttentionCore)")
    for block in model.blocks:
        block.attn.core = ContextParallelAttention(group, layout, algorithm)
    model.position_ids = _Positions(layout, me, n)
    return model


class _Positions:
    """A context-parallel model's positions: this rank's local length → its token positions."""

    def __init__(self, layout: str, rank: int, n: int):
        self.layout, self.rank, self.n = layout, rank, n

    def __call__(self, seq: int) -> torch.Tensor:
        return positions(self.layout, self.rank, self.n, seq * self.n)


# ------------------------------------------------------------------ does a hop hide? (computed)

def ring_step_cost(seq: int, cp: int, n_heads: int, n_kv_heads: int, head_dim: int,
                   flops: float, link: float, dtype_bytes: int = 2, tp: int = 1) -> dict:
    """One rank's step of a zig-zag ring, any step but the first, on a real device: is the
    hop hidden behind the step's compute? (Computed; lesson 06 checks the FLOPs against
    torch's FlopCounterMode and the bytes against the ledger on real ranks.)

    In such a step a rank computes two full blocks of (s/2N)² scores — (s/N)²/2 scores —
    with 2·2·d FLOPs per score and head (QKᵀ, then PV): 2·(s/N)²·d·a/tp FLOPs forward.
    Its backward recomputes the scores and does four more matmuls (dV, dP, dQ, dK): 5/2 of
    that. A hop carries this rank's K and V, 2·(kv/tp)·(s/N)·d elements; backward posts
    two hops per step (K/V, and dK/dV in the same dtype). The hop hides while it takes
    less than the step's compute: at `flops` FLOP/s and `link` bytes/s per GPU, while

        s/N > kv·dtype_bytes·flops / (a·link)      tokens per rank

    (tp divides the compute and the bytes alike, so it does not move the condition)."""
    if min(seq, cp, n_heads, n_kv_heads, head_dim, tp, dtype_bytes) < 1 or flops <= 0 or link <= 0:
        raise ValueError("need positive sizes, flops and link")
    chunk_len("zigzag", cp, seq)
    if n_heads % tp or n_kv_heads % tp or n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} heads and {n_kv_heads} KV heads must divide by tp={tp}, "
                         f"and the heads by the KV heads")
    local, a, kv = seq // cp, n_heads // tp, n_kv_heads // tp
    fwd_flops = 2 * local * local * head_dim * a
    hop = 2 * kv * local * head_dim * dtype_bytes
    out = {"tokens_per_rank": local, "fwd_flops": fwd_flops, "bwd_flops": fwd_flops * 5 // 2,
           "hop_bytes": hop, "fwd_compute_s": fwd_flops / flops, "fwd_hop_s": hop / link,
           "bwd_compute_s": 2.5 * fwd_flops / flops, "bwd_hop_s": 2 * hop / link,
           "min_tokens_per_rank": n_kv_heads * dtype_bytes * flops / (n_heads * link)}
    out["fwd_hidden"] = out["fwd_hop_s"] < out["fwd_compute_s"]
    out["bwd_hidden"] = out["bwd_hop_s"] < out["bwd_compute_s"]
    return out
