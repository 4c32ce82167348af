"""Tensor parallelism (Megatron-LM): split the matmuls inside each block across a group (lesson 04).

Data parallelism copies the model; tensor parallelism (TP) cuts every weight matrix into
`tp` slices, so each rank stores and multiplies 1/tp of it. Two ways to cut y = x Wᵀ
(W is the nn.Linear weight, shape (out, in)):

- ColumnParallelLinear: rank r keeps rows r of W (= columns of the math's A in y = xA):
  every rank needs the whole input x and produces a slice of the output features;
- RowParallelLinear: rank r keeps columns r of W: it takes a slice of the input features
  and produces a *partial sum* of the whole output, which an all-reduce completes.

Column then row needs no communication in between (the slice the first produces is the
slice the second consumes), so a block's attention (q, k, v column; o row) and MLP
(gate, up column; down row) each cost one pair of conjugate operators:
    f: identity forward, all-reduce backward    (where the replicated input enters)
    g: all-reduce forward, identity backward    (where the partial sums leave)
One all-reduce per f/g pair forward, one backward (the autograd functions are in
`picolib.mappings`). The vocabulary is split too: `picolib.vocab_parallel` (embedding
and loss), which `TPLlama` uses. Biases follow the output: a column-parallel bias is cut
with the output features; a row-parallel bias is added once, after the sum.

Grouped-query attention rule (n_heads = a query heads, kv key/value heads, tp ranks):
    a % tp == 0 always; if tp <= kv: kv % tp == 0 and each rank holds kv/tp KV heads;
    if tp > kv: tp % kv == 0 and each KV head is replicated on tp/kv ranks (the ranks
    whose query heads read it); the replicas' weight gradients are summed in backward.
`check_tensor_parallel` raises a ValueError naming the numbers when the rule is broken.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .mappings import copy_to_region as copy_to_tp, copy_to_replicas, gather_from_region, shard
from .mappings import reduce_from_region as reduce_from_tp   # lesson 04's f and g
from .model import LlamaConfig, RMSNorm, TinyLlama, apply_rope, attention_core, repeat_kv
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "column_matmuls", "add_biases",
           "kv_heads_per_rank", "check_tensor_parallel", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelAttention", "ParallelSwiGLU", "ParallelBlock", "TPLlama", "tensor_parallel_llama"]


# ------------------------------------------------------------------ entering and leaving a TP region

def gather_from_tp(x, group=None):
    """All-gather the last dim (the vocabulary slices of the logits); backward keeps the slice."""
    return gather_from_region(x, -1, group)


def column_matmuls(x, weights, group=None):
    """Entering a TP region: f once, then every column-parallel matmul (q, k, v share one f)."""
    x = copy_to_tp(x, group)
    return [F.linear(x, w) for w in weights]


def add_biases(outputs, biases):
    """The column-parallel biases (each rank's slice), added after the region's matmuls."""
    return [y if b is None else y + b for y, b in zip(outputs, biases, strict=True)]


# ------------------------------------------------------------------ sharding and rules

def kv_heads_per_rank(n_heads: int, n_kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks sharing each KV head) under the module's GQA rule."""
    if n_heads % tp:
        raise ValueError(f"tp={tp} must divide n_heads={n_heads} (each rank takes whole query heads)")
    if tp <= n_kv_heads:
        if n_kv_heads % tp:
            raise ValueError(f"tp={tp} must divide n_kv_heads={n_kv_heads} (tp <= kv heads: KV heads are split)")
        return n_kv_heads // tp, 1
    if tp % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide tp={tp} (tp > kv heads: each KV head "
                         f"is replicated on tp/kv ranks)")
    return 1, tp // n_kv_heads


def check_tensor_parallel(cfg: LlamaConfig, tp: int, seq_len: int | None = None) -> None:
    """Raise a ValueError naming both numbers if `tp` cannot split this model (or sequence)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    kv_heads_per_rank(cfg.n_heads, cfg.n_kv_heads, tp)
    for name, value in (("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ValueError(f"tp={tp} must divide {name}={value}")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"tp={tp} must divide the sequence length {seq_len} (sequence parallel "
                         "gives each rank s/tp tokens)")


# ------------------------------------------------------------------ the two linears

class _ShardedLinear(nn.Module):
    """What the two linears share: `from_linear` cuts a dense nn.Linear along `split_dim`."""
    split_dim: int

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw):
        """This rank's shard of `linear`; a bias follows the output (sliced by column, whole by row)."""
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        out_f, in_f = linear.weight.shape
        m = cls(in_f, out_f, group, bias=linear.bias is not None, **kw,
                device=linear.weight.device, dtype=linear.weight.dtype)
        return m.load_shard(linear, r, tp)

    @torch.no_grad()
    def load_shard(self, linear: nn.Linear, index: int, count: int):
        """Copy slice `index` of `count` of `linear` (weight, and bias where it is split) here."""
        self.weight.copy_(shard(linear.weight, self.split_dim, index, count))
        if self.bias is not None:
            self.bias.copy_(shard(linear.bias, 0, index, count) if self.split_dim == 0 else linear.bias)
        return self


class ColumnParallelLinear(_ShardedLinear):
    """y_r = x W_rᵀ with W_r = rows r of W: the input is whole, the output is sliced.
    `copy_input` applies f to the input (off when the caller already did);
    `gather_output` all-gathers the slices into the whole output."""
    split_dim = 0

    def __init__(self, in_features, out_features, group=None, bias=False,
                 copy_input=True, gather_output=False, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(group)
        if out_features % tp:
            raise ValueError(f"tp={tp} must divide out_features={out_features}")
        self.group, self.copy_input, self.gather_output = group, copy_input, gather_output
        like = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **like))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, **like)) if bias else None

    def forward(self, x):
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """y = Σ_r x_r W_rᵀ with W_r = columns r of W: the input is sliced, the output a partial
    sum that `reduce_output` (g) completes. The bias is added once, after the sum: with
    `reduce_output=False` forward returns the partial sum *without* it, and the caller
    adds it with `add_bias` after its own reduction (all-reduce or reduce-scatter)."""
    split_dim = 1

    def __init__(self, in_features, out_features, group=None, bias=False, reduce_output=True,
                 device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(group)
        if in_features % tp:
            raise ValueError(f"tp={tp} must divide in_features={in_features}")
        self.group, self.reduce_output = group, reduce_output
        like = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **like))
        self.bias = nn.Parameter(torch.zeros(out_features, **like)) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight)
        return self.add_bias(reduce_from_tp(y, self.group)) if self.reduce_output else y

    def add_bias(self, y):
        """The bias, added to an output that has been summed over the group."""
        return y if self.bias is None else y + self.bias


# ------------------------------------------------------------------ blocks

class ParallelAttention(nn.Module):
    """Heads split over the group: wq, wk, wv column-parallel, wo row-parallel.

    `enter(x, weights, group)` does the column matmuls behind the region's entry operator
    (f for TP; an all-gather along the sequence for TP+SP), so q, k and v share one;
    `leave(y, group)` is the exit (g for TP; a reduce-scatter along the sequence)."""

    def __init__(self, attn, group=None, enter=column_matmuls, leave=reduce_from_tp):
        super().__init__()
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        kv_local, self.replicas = kv_heads_per_rank(attn.n_heads, attn.n_kv_heads, tp)
        self.group, self.enter, self.leave = group, enter, leave
        self.head_dim, self.impl, self.selective = attn.head_dim, attn.impl, attn.selective
        self.wq = ColumnParallelLinear.from_linear(attn.wq, group, copy_input=False)
        # K, V: this rank holds KV slice r // replicas of tp // replicas (when tp > kv, each
        # KV head is held by the `replicas` ranks whose query heads read it)
        self.slot, self.n_slots = r // self.replicas, tp // self.replicas
        rows = kv_local * attn.head_dim
        self.wk, self.wv = (ColumnParallelLinear(
            lin.in_features, rows * tp, group, bias=lin.bias is not None, copy_input=False,
            device=lin.weight.device, dtype=lin.weight.dtype).load_shard(lin, self.slot, self.n_slots)
            for lin in (attn.wk, attn.wv))
        self.wo = RowParallelLinear.from_linear(attn.wo, group, reduce_output=False)

    def _kv(self, t):
        if self.replicas == 1 or t is None:
            return t
        return copy_to_replicas(t, self.slot, self.n_slots, self.group)

    def forward(self, x, cos, sin):
        weights = [self.wq.weight, self._kv(self.wk.weight), self._kv(self.wv.weight)]
        biases = [self.wq.bias, self._kv(self.wk.bias), self._kv(self.wv.bias)]
        q, k, v = add_biases(self.enter(x, weights, self.group), biases)
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if self.selective and torch.is_grad_enabled():
            out = checkpoint(attention_core, q, k, v, self.impl, use_reentrant=False)
        else:
            out = attention_core(q, k, v, self.impl)
        y = self.leave(self.wo(out.transpose(1, 2).reshape(b, s, -1)), self.group)
        return self.wo.add_bias(y)                  # once, after the sum


class ParallelSwiGLU(nn.Module):
    """gate and up column-parallel (each rank a slice of ffn_hidden), down row-parallel."""

    def __init__(self, mlp, group=None, enter=column_matmuls, leave=reduce_from_tp):
        super().__init__()
        self.group, self.enter, self.leave = group, enter, leave
        self.w_gate = ColumnParallelLinear.from_linear(mlp.w_gate, group, copy_input=False)
        self.w_up = ColumnParallelLinear.from_linear(mlp.w_up, group, copy_input=False)
        self.w_down = RowParallelLinear.from_linear(mlp.w_down, group, reduce_output=False)

    def forward(self, x):
        gate, up = add_biases(self.enter(x, [self.w_gate.weight, self.w_up.weight], self.group),
                              [self.w_gate.bias, self.w_up.bias])
        return self.w_down.add_bias(self.leave(self.w_down(F.silu(gate) * up), self.group))


def _copy_norm(norm: RMSNorm) -> RMSNorm:
    out = RMSNorm(norm.weight.numel(), norm.eps).to(norm.weight)
    with torch.no_grad():
        out.weight.copy_(norm.weight)
    return out


class ParallelBlock(nn.Module):
    """The reference Block with parallel attention and MLP; norms and residuals unchanged."""

    def __init__(self, block, group=None, enter=column_matmuls, leave=reduce_from_tp):
        super().__init__()
        self.attn_norm, self.mlp_norm = _copy_norm(block.attn_norm), _copy_norm(block.mlp_norm)
        self.attn = ParallelAttention(block.attn, group, enter, leave)
        self.mlp = ParallelSwiGLU(block.mlp, group, enter, leave)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


# ------------------------------------------------------------------ the whole model

class TPLlama(nn.Module):
    """TinyLlama, tensor-parallel over `group`. forward → this rank's vocab slice of the
    logits (b, s, v/tp); `loss` is the vocab-parallel cross-entropy (same value on every rank)."""

    def __init__(self, model, group=None, enter=column_matmuls, leave=reduce_from_tp,
                 embed_reduce=reduce_from_tp):
        super().__init__()
        self.cfg, self.group, self.tp = model.cfg, group, dist.get_world_size(group)
        check_tensor_parallel(self.cfg, self.tp)
        self.embed = VocabParallelEmbedding(model.embed, group, embed_reduce)
        self.blocks = nn.ModuleList(ParallelBlock(b, group, enter, leave) for b in model.blocks)
        self.norm = _copy_norm(model.norm)
        self.enter = enter
        self.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, copy_input=False)
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    rope = TinyLlama.rope   # the same (cos, sin) tables and max_seq check

    def forward(self, tokens):
        x = self.embed(tokens)
        cos, sin = self.rope(tokens.shape[1])
        for block in self.blocks:
            if self.cfg.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.enter(self.norm(x), [self.lm_head.weight], self.group)
        return add_biases(logits, [self.lm_head.bias])[0]

    def loss(self, tokens, targets):
        return vocab_parallel_cross_entropy(self(tokens), targets, self.embed.start, self.group)

    def full_logits(self, tokens):
        """All-gather the vocab slices (for tests and lessons; training never needs it)."""
        return gather_from_tp(self(tokens), self.group)


def tensor_parallel_llama(model, group=None) -> TPLlama:
    """The tensor-parallel form of a TinyLlama on `group` (TPLlama checks the sizes first)."""
    return TPLlama(model, group)
