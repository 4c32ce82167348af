"""Causal attention computed block by block, merged with the online softmax (lesson 06).

Context parallelism cuts the sequence into equal chunks; a rank sees the keys and values of
one chunk at a time. Attention over the whole sequence is still exact, because softmax
can be finished later: a block of scores S = q kᵀ/√d gives a partial result

    o = softmax(S) v        and its log-sum-exp   lse = log Σⱼ exp(Sⱼ)

and two partial results over disjoint keys merge into the result over both:

    lse = log(exp(lse₁) + exp(lse₂))
    o   = exp(lse₁ − lse) · o₁ + exp(lse₂ − lse) · o₂

(each oᵢ was normalised by exp(lseᵢ); reweighting by exp(lseᵢ − lse) renormalises by the
total). This is FlashAttention's rule, with chunks of the sequence as the blocks.

Chunks carry their index in the sequence (`q_ids`, `k_ids`): query chunk i sees key chunk
j fully when j < i, with the causal triangle when j == i, and not at all when j > i — so a
masked pair is skipped, never computed (that is what makes the work per rank uneven, and
zig-zag even).

The backward recomputes each block's probabilities from the saved lse (no s×s matrix is
kept): with Δ = rowsum(dO ∘ O),

    P = exp(S − lse)    dV += Pᵀ dO    dS = P ∘ (dO Vᵀ − Δ)    dQ += dS K/√d    dK += dSᵀ Q/√d

Keys and values come with fewer heads than queries (GQA): a block repeats them for its
matmuls and sums their gradients back. Everything accumulates in fp32 for fp16/bf16.
"""
from __future__ import annotations

import math

import torch

from .model import repeat_kv, upcast

__all__ = ["merge", "block_forward", "block_backward", "add_block_grads", "visible", "visible_pairs",
           "unmasked_scores", "count",
           "ChunkedAttention", "chunked_attention"]


def visible(q_id: int, k_id: int) -> str | None:
    """How query chunk `q_id` sees key chunk `k_id` under the causal mask:
    "full", "diagonal" (the triangle) or None (fully masked: skip it)."""
    return "full" if k_id < q_id else "diagonal" if k_id == q_id else None


def visible_pairs(q_ids, k_ids) -> list[tuple[int, int, str]]:
    """(a, b, kind) for query chunk q_ids[a] against key chunk k_ids[b], the masked pairs left out."""
    return [(a, b, visible(i, j)) for a, i in enumerate(q_ids) for b, j in enumerate(k_ids)
            if visible(i, j)]


def block_forward(q, k, v, diagonal: bool):
    """One block: (o, lse) of q (b, a, c, d) against k, v (b, kv, c, d). o is fp32 or fp64."""
    n_rep = q.shape[1] // k.shape[1]
    s = _scores(q, repeat_kv(k, n_rep), diagonal)
    lse = s.logsumexp(-1)
    return (s - lse.unsqueeze(-1)).exp() @ upcast(repeat_kv(v, n_rep)), lse


def merge(o, lse, o_blk, lse_blk):
    """Fold a block's partial result into the running one (in place); returns (o, lse)."""
    new = torch.logaddexp(lse, lse_blk)
    o.mul_((lse - new).exp().unsqueeze(-1)).add_((lse_blk - new).exp().unsqueeze(-1) * o_blk)
    lse.copy_(new)
    return o, lse


def block_backward(do, q, k, v, lse, delta, diagonal: bool):
    """Gradients (dq, dk, dv) of one block, from the output gradient `do` (fp32), the
    saved lse and Δ = rowsum(dO ∘ O) of the query rows."""
    kv, n_rep = k.shape[1], q.shape[1] // k.shape[1]
    k_rep, v_rep = upcast(repeat_kv(k, n_rep)), upcast(repeat_kv(v, n_rep))
    p = (_scores(q, k_rep, diagonal) - lse.unsqueeze(-1)).exp()
    dv = _sum_groups(p.transpose(-2, -1) @ do, kv)
    ds = p * (do @ v_rep.transpose(-2, -1) - delta.unsqueeze(-1)) / math.sqrt(q.shape[-1])
    dq = ds @ k_rep
    dk = _sum_groups(ds.transpose(-2, -1) @ upcast(q), kv)
    return dq, dk, dv


# ------------------------------------------------------------------ the machinery

def unmasked_scores(kind: str, c: int) -> int:
    """Query-key pairs a c×c block really uses: c² for a full block, c(c+1)/2 on the diagonal."""
    return c * c if kind == "full" else c * (c + 1) // 2


def _scores(q, k, diagonal: bool):
    s = upcast(q) @ upcast(k).transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal:
        c = s.shape[-1]
        future = torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _sum_groups(g, kv_heads: int):
    """(b, kv·n_rep, c, d) → (b, kv, c, d): a key head's gradient is the sum over its queries."""
    b, a, c, d = g.shape
    return g.view(b, kv_heads, a // kv_heads, c, d).sum(2)


class ChunkedAttention(torch.autograd.Function):
    """Causal attention of query chunks `q_ids` against key chunks `k_ids`, all local: the
    all-gather and Ulysses variants of context parallelism run it on what they gathered.
    Saves q, k, v, the output and lse; `work` (a dict, optional) counts blocks and scores."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids, k_ids, work):
        qs, ks, vs = q.chunk(len(q_ids), 2), k.chunk(len(k_ids), 2), v.chunk(len(k_ids), 2)
        outs, lses = [], []
        for qc, i in zip(qs, q_ids):
            o = qc.new_zeros(qc.shape, dtype=upcast(qc).dtype)
            lse = o.new_full(qc.shape[:-1], float("-inf"))
            for kc, vc, j in zip(ks, vs, k_ids):
                kind = visible(i, j)
                if kind is not None:
                    merge(o, lse, *block_forward(qc, kc, vc, kind == "diagonal"))
                    count(work, kind, qc.shape[2])
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)
        ctx.ids = (q_ids, k_ids)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_ids, k_ids = ctx.ids
        do = upcast(dout)
        delta = (do * upcast(out)).sum(-1)
        dq = torch.zeros_like(q, dtype=do.dtype)
        dk, dv = (torch.zeros_like(t, dtype=do.dtype) for t in (k, v))
        add_block_grads(do, q, k, v, lse, delta, q_ids, k_ids, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def add_block_grads(do, q, k, v, lse, delta, q_ids, k_ids, dq, dk, dv) -> None:
    """Add every visible block's gradients into dq (query chunks `q_ids`) and dk, dv (key
    chunks `k_ids`), all chunks of one size."""
    c = q.shape[2] // len(q_ids)
    for qi, i in enumerate(q_ids):
        rows = slice(qi * c, (qi + 1) * c)
        for ki, j in enumerate(k_ids):
            kind = visible(i, j)
            if kind is None:
                continue
            cols = slice(ki * c, (ki + 1) * c)
            g = block_backward(do[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                               lse[:, :, rows], delta[:, :, rows], kind == "diagonal")
            dq[:, :, rows] += g[0]
            dk[:, :, cols] += g[1]
            dv[:, :, cols] += g[2]


def count(work: dict | None, kind: str, c: int) -> None:
    """Add one computed c×c block to a work counter {"blocks": …, "scores": …}."""
    if work is not None:
        work["blocks"] = work.get("blocks", 0) + 1
        work["scores"] = work.get("scores", 0) + unmasked_scores(kind, c)


def chunked_attention(q, k, v, q_ids, k_ids, work: dict | None = None):
    """softmax(q kᵀ/√d + causal mask) v over chunks with known sequence indices."""
    if q.shape[2] % len(q_ids) or k.shape[2] % len(k_ids) or \
            q.shape[2] // len(q_ids) != k.shape[2] // len(k_ids):
        raise ValueError(f"{q.shape[2]} queries in {len(q_ids)} chunks and {k.shape[2]} keys in "
                         f"{len(k_ids)} chunks: the chunks must be of one size")
    return ChunkedAttention.apply(q, k, v, tuple(q_ids), tuple(k_ids), work)
