"""FlashAttention as I/O: the bytes attention moves between slow memory (HBM) and a fast
on-chip memory of M bytes, computed naively and in tiles (lesson 12).

Naive attention for one head (s tokens, head size d, `elem` bytes per number) runs three
kernels, each a round trip through slow memory:

    S = Q Kᵀ         reads Q, K (2sd)          writes S (s²)
    P = softmax(S)   reads S (s²)              writes P (s²)
    O = P V          reads P, V (s² + sd)      writes O (sd)

    bytes = elem · (4sd + 4s²)         and the s×s matrices S and P are held in slow memory.

Tiled (FlashAttention, here in the order of its second version): a block of B query rows
stays on chip with its running output, row maxima and row sums (the online softmax of
`blockwise_attention.py`); the keys and values stream past in blocks of B rows. Each query
block reads all of K and V once:

    bytes = elem · (sd [Q] + sd [O] + (s / B) · 2sd [K, V])  =  elem · (2sd + 2s²d / B)

and nothing of size s×s is ever written. On chip a step holds a Q block and a K and a V
block (elem · 3Bd), the fp32 running output (4Bd) and the B×B block of scores (4B²): that
must fit in M, which bounds B — and the traffic falls as 1/B. The ratio naive / tiled tends
to 2B/d for long sequences.

`tiled_attention` runs the tiled algorithm on real tensors, counting the bytes it loads
and stores, so the formula can be checked against a run.
"""
from __future__ import annotations

import math

import torch

__all__ = ["naive_bytes", "tiled_bytes", "on_chip_bytes", "largest_block", "tiled_attention"]


def naive_bytes(s: int, d: int, elem: int = 2) -> int:
    """Slow-memory traffic of naive attention, one head."""
    return elem * (4 * s * d + 4 * s * s)


def tiled_bytes(s: int, d: int, block: int, elem: int = 2) -> int:
    """Slow-memory traffic of tiled attention with blocks of `block` rows, one head."""
    blocks = math.ceil(s / block)
    return elem * (2 * s * d + blocks * 2 * s * d)


def on_chip_bytes(d: int, block: int, elem: int = 2) -> int:
    """Fast memory one step of the tiled loop holds: Q, K, V blocks, the fp32 output
    accumulator, the fp32 block of scores."""
    return elem * 3 * block * d + 4 * block * d + 4 * block * block


def largest_block(d: int, on_chip: int, elem: int = 2) -> int:
    """The largest power-of-two block whose step fits in `on_chip` bytes."""
    block = 1
    while on_chip_bytes(d, 2 * block, elem) <= on_chip:
        block *= 2
    if on_chip_bytes(d, block, elem) > on_chip:
        raise ValueError(f"not even one row of d={d} fits in {on_chip} bytes")
    return block


def tiled_attention(q, k, v, block: int):
    """Causal-free attention of (s, d) tensors by query blocks and key/value blocks with the
    online softmax. Returns (output, bytes loaded from and stored to the inputs/output):
    every slice read from q, k, v and every block written to the output is counted."""
    s, d = q.shape
    out = torch.empty_like(q)
    moved = 0
    for i in range(0, s, block):
        qi = q[i:i + block]
        moved += qi.numel() * qi.element_size()
        acc = torch.zeros(qi.shape[0], d, dtype=torch.float32, device=q.device)
        row_max = torch.full((qi.shape[0], 1), -math.inf, device=q.device)
        row_sum = torch.zeros(qi.shape[0], 1, device=q.device)
        for j in range(0, s, block):
            kj, vj = k[j:j + block], v[j:j + block]
            moved += 2 * kj.numel() * kj.element_size()
            scores = qi.float() @ kj.float().t() / math.sqrt(d)
            new_max = torch.maximum(row_max, scores.amax(dim=1, keepdim=True))
            p = torch.exp(scores - new_max)
            correction = torch.exp(row_max - new_max)
            row_sum = row_sum * correction + p.sum(dim=1, keepdim=True)
            acc = acc * correction + p @ vj.float()
            row_max = new_max
        out[i:i + block] = (acc / row_sum).to(q.dtype)
        moved += qi.numel() * qi.element_size()
    return out, moved
