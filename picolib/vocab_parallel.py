"""Vocabulary parallelism: the embedding and the loss split over the vocabulary (lesson 04).

The vocabulary is the widest dimension of a Llama (128,256 words in Llama 3), so under
tensor parallelism its two ends are split too. Rank r owns words [r·v/tp, (r+1)·v/tp):
its rows of the embedding table and, through the column-parallel `lm_head`, its slice of
the logits. Gathering the (b, s, v) logits for the loss would move b·s·v numbers; the
cross-entropy needs only three per token (max, sum of exponentials, target logit), each
an all-reduce. Builds on the conjugate operator g (`reduce_from_region`, picolib.mappings).
"""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .model import upcast
from .mappings import reduce_from_region, shard

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]


class VocabParallelEmbedding(nn.Module):
    """Slice r holds rows [r·v/tp, (r+1)·v/tp) of the table; a token outside gives zeros,
    so summing over ranks (`reduce`: all-reduce, or reduce-scatter under SP) is the lookup.
    `slot`: the slice this rank holds — `tensor_parallel.tp_cut` decides it when the model is
    made tensor-parallel; by default the rank's index in `group`."""

    def __init__(self, embedding: nn.Embedding, group=None, reduce=reduce_from_region, slot: int | None = None):
        super().__init__()
        tp = dist.get_world_size(group)
        r = dist.get_rank(group) if slot is None else slot
        v = embedding.num_embeddings
        if v % tp:
            raise ValueError(f"tp={tp} must divide vocab_size={v}")
        self.group, self.reduce = group, reduce
        self.start, self.end = r * v // tp, (r + 1) * v // tp
        self.weight = nn.Parameter(shard(embedding.weight, 0, r, tp))

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.reduce(partial, self.group)


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group=None):
    """Mean cross-entropy from vocab-sharded logits (..., v/tp), never gathering them.

    loss = log Σ_v exp(z_v − m) + m − z_target, with three all-reduces: the max m (no
    gradient needed: it cancels), the sum of exponentials and the target logit (each g)."""
    logits = upcast(logits)
    m = logits.detach().amax(-1)
    comm.all_reduce(m, op="max", group=group)
    shifted = logits - m.unsqueeze(-1)
    sum_exp = reduce_from_region(shifted.exp().sum(-1), group)
    local = targets - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_region(picked * inside, group)
    return (sum_exp.log() - target_logit).mean()


class VocabParallelCrossEntropy(nn.Module):
    """The loss part of a tensor-parallel TinyLlama: `vocab_parallel_cross_entropy` for the
    vocab slice that starts at `vocab_start` (this rank's slice of the lm_head)."""

    def __init__(self, vocab_start: int, group=None):
        super().__init__()
        self.vocab_start, self.group = vocab_start, group

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.group)
