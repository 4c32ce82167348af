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
and loss). Biases follow the output: a column-parallel bias is cut with the output
features; a row-parallel bias is added once, after the sum.

`apply_tensor_parallel(model, tp, sequence_parallel=False)` turns a TinyLlama into its
TP (or TP+SP, lesson 05) form in place: it swaps the attention, MLP, embedding, head and
loss for their parallel versions, each carrying its own entry and exit operators, so the
model's one forward runs unchanged. Which weight is cut along which dim is one table,
`TP_PLAN`, that the transform builds its shards from and `picolib.param_placement` reads. Apply it
first, before context/expert parallelism, pipeline stages and data parallelism (the order
in `picolib.mesh`).

Grouped-query attention rule (n_heads = a query heads, kv key/value heads, tp ranks):
    a % tp == 0 always; if tp <= kv: kv % tp == 0 and each rank holds kv/tp KV heads;
    if tp > kv: tp % kv == 0 and each KV head is replicated on tp/kv ranks (the ranks
    whose query heads read it); the replicas' weight gradients are summed in backward.
`check_tensor_parallel` raises a ValueError naming the numbers when the rule is broken.

The file opens with what lesson 04 reads: the entry operator and the two linears, the
attention and MLP built from them, the transform. The machinery follows: cutting a dense
layer into shards, the GQA rule, the plan `TP_PLAN`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .mappings import Region, copy_to_replicas, gather_from_region, shard
from .mappings import copy_to_region as copy_to_tp
from .mappings import reduce_from_region as reduce_from_tp   # lesson 04's f and g
from .mesh import dim_group
from .model import Attention, LlamaConfig, SwiGLU, TinyLlama
from .sequence_parallel import SequenceParallelRMSNorm, sequence_parallel_region
from .vocab_parallel import VocabParallelCrossEntropy, VocabParallelEmbedding

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "column_matmuls", "add_biases",
           "Region", "TP_REGION", "kv_heads_per_rank", "check_tensor_parallel",
           "COLUMN", "ROW", "KV_HEADS", "VOCAB", "TP_PLAN", "Cut", "tp_cut", "parallel_linear",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelAttention", "ParallelSwiGLU",
           "apply_tensor_parallel"]


# ------------------------------------------------------------------ the two linears and their f/g (lesson 04)

def column_matmuls(x, weights, group=None):
    """Entering a TP region: f once, then every column-parallel matmul (q, k, v share one f)."""
    x = copy_to_tp(x, group)
    return [F.linear(x, w) for w in weights]


TP_REGION = Region(column_matmuls, reduce_from_tp, False)   # f and g (lesson 04)


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
    `enter(x, [weight], group)` is the entry operator and the matmul (default f then the
    matmul; None: the caller has entered the region already); `gather_output` all-gathers
    the slices into the whole output."""
    split_dim = 0

    def __init__(self, in_features, out_features, group=None, bias=False,
                 enter=column_matmuls, gather_output=False, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(group)
        if out_features % tp:
            raise ValueError(f"tp={tp} must divide out_features={out_features}")
        self.group, self.enter, self.gather_output = group, enter, gather_output
        like = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **like))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, **like)) if bias else None

    def forward(self, x):
        if self.enter is None:                    # the caller has entered the region already
            y = F.linear(x, self.weight, self.bias)
        else:                                     # f, then x W_rᵀ: this rank's output features
            y = add_biases(self.enter(x, [self.weight], self.group), [self.bias])[0]
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
        y = F.linear(x, self.weight)              # x_r W_rᵀ: a partial sum of the whole output
        return self.add_bias(reduce_from_tp(y, self.group)) if self.reduce_output else y   # g

    def add_bias(self, y, sequence_split: bool = False):
        """The bias, added to an output summed over the group. With `sequence_split` (the
        sum was a reduce-scatter) the bias meets s/tp tokens here: f on it sums its
        gradient over the group in backward."""
        if self.bias is None:
            return y
        return y + (copy_to_tp(self.bias, self.group) if sequence_split else self.bias)


# ------------------------------------------------------------------ attention and MLP

class ParallelAttention(Attention):
    """Heads split over the group: wq, wk, wv column-parallel, wo row-parallel. The
    forward is `Attention`'s; `project` enters the region (q, k and v share one entry
    operator) and `output` leaves it, per `region` (TP: f and g; TP+SP: an all-gather and
    a reduce-scatter along the sequence)."""

    def __init__(self, attn: Attention, group=None, region: Region = TP_REGION):
        nn.Module.__init__(self)
        self.group, self.region, self.core = group, region, attn.core
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        heads = (attn.n_heads, attn.n_kv_heads)
        self.wq, self.wk, self.wv, self.wo = (parallel_linear(getattr(attn, n), f"attn.{n}", group, heads)
                                              for n in ("wq", "wk", "wv", "wo"))
        # when tp > kv, each KV head is held by the `replicas` ranks whose query heads read it:
        # this rank's K, V are slice `slot` of `n_slots`
        cut = tp_cut("attn.wk", dist.get_world_size(group), dist.get_rank(group), heads)
        self.slot, self.n_slots, self.replicas = cut.index, cut.count, len(cut.holders)

    def _kv(self, t):
        """K or V's weight (or bias), which `replicas` ranks hold alike when tp > KV heads: it
        enters through f over those ranks alone, so backward sums their gradients."""
        if self.replicas == 1 or t is None:
            return t
        return copy_to_replicas(t, self.slot, self.n_slots, self.group)

    def project(self, x):
        weights = [self.wq.weight, self._kv(self.wk.weight), self._kv(self.wv.weight)]
        biases = [self.wq.bias, self._kv(self.wk.bias), self._kv(self.wv.bias)]
        return add_biases(self.region.enter(x, weights, self.group), biases)

    def output(self, y):
        y = self.region.leave(self.wo(y), self.group)
        return self.wo.add_bias(y, self.region.sequence_split)     # once, after the sum


class ParallelSwiGLU(nn.Module):
    """gate and up column-parallel (each rank a slice of ffn_hidden), down row-parallel."""

    def __init__(self, mlp: SwiGLU, group=None, region: Region = TP_REGION):
        super().__init__()
        self.group, self.region = group, region
        self.w_gate, self.w_up, self.w_down = (parallel_linear(getattr(mlp, n), f"mlp.{n}", group)
                                               for n in ("w_gate", "w_up", "w_down"))

    def forward(self, x):
        gate, up = add_biases(self.region.enter(x, [self.w_gate.weight, self.w_up.weight], self.group),
                              [self.w_gate.bias, self.w_up.bias])
        y = self.region.leave(self.w_down(F.silu(gate) * up), self.group)
        return self.w_down.add_bias(y, self.region.sequence_split)


# ------------------------------------------------------------------ the transform

def apply_tensor_parallel(model: TinyLlama, tp=None, *, sequence_parallel: bool = False,
                          regather: bool = True) -> TinyLlama:
    """Make `model` tensor-parallel over `tp` (a Mesh — its "tp" dimension — or a process
    group; None: all ranks), in place, and return it.

    Each block's attention and MLP become `ParallelAttention` and `ParallelSwiGLU`; the
    embedding, the head and the loss become vocab-parallel, so `model(tokens)` gives this
    rank's vocab slice of the logits (b, s, v/tp) and `model.loss` the same value on every
    rank. With `sequence_parallel` (lesson 05) the regions are entered by an all-gather
    and left by a reduce-scatter along the sequence; the norms and residuals between them
    hold s/tp tokens, and the norm weights sum their gradients over the group inside
    backward. `regather` (SP only): save the s/tp slice and all-gather it again in
    backward (see picolib.sequence_parallel). A model whose parts are already parallel is
    refused."""
    group = dim_group(tp, "tp")
    n = dist.get_world_size(group)
    check_tensor_parallel(model.cfg, n)
    if any(isinstance(m, (_ShardedLinear, VocabParallelEmbedding)) for m in model.modules()):
        raise ValueError("this model is tensor-parallel already")
    region = sequence_parallel_region(regather) if sequence_parallel else TP_REGION

    def norm(m):
        return SequenceParallelRMSNorm(m, group) if sequence_parallel else m

    if model.embed is not None:
        model.embed = VocabParallelEmbedding(model.embed, group, region.leave,
                                             slot=tp_cut("embed", n, dist.get_rank(group)).index)
    for block in model.blocks:
        block.attn_norm, block.mlp_norm = norm(block.attn_norm), norm(block.mlp_norm)
        block.attn = ParallelAttention(block.attn, group, region)
        block.mlp = ParallelSwiGLU(block.mlp, group, region)
    if model.lm_head is not None:
        model.norm = norm(model.norm)
        model.lm_head = parallel_linear(model.lm_head, "lm_head", group, enter=region.enter)
        vocab_start = tp_cut("lm_head", n, dist.get_rank(group)).index * model.cfg.vocab_size // n
        model.loss_fn = VocabParallelCrossEntropy(vocab_start, group)
    model.sequence_shards = n if sequence_parallel else 1
    return model


# ------------------------------------------------------------------ the machinery: shards, helpers, rules, the plan

def parallel_linear(linear: nn.Linear, role: str, group=None, heads=None, enter=None):
    """This rank's piece of `linear` as TP_PLAN cuts `role`, for a module that enters and
    leaves the region itself: a ColumnParallelLinear (`enter`: its entry operator; None: the
    caller has entered) or a RowParallelLinear whose partial sum the caller completes."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    cut = tp_cut(role, tp, r, heads)
    if cut.dim is None:
        raise ValueError(f"TP_PLAN does not cut {role}")
    out_f, in_f = linear.weight.shape
    like = {"bias": linear.bias is not None, "device": linear.weight.device,
            "dtype": linear.weight.dtype}
    if cut.dim == 0:        # out_f/count rows each (count < tp: a KV head on several ranks)
        m = ColumnParallelLinear(in_f, out_f // cut.count * tp, group, enter=enter, **like)
    else:
        m = RowParallelLinear(in_f, out_f, group, reduce_output=False, **like)
    return m.load_shard(linear, cut.index, cut.count)


def gather_from_tp(x, group=None):
    """All-gather the last dim (the vocabulary slices of the logits); backward keeps the slice."""
    return gather_from_region(x, -1, group)


def add_biases(outputs, biases):
    """The column-parallel biases (each rank's slice), added after the region's matmuls."""
    return [y if b is None else y + b for y, b in zip(outputs, biases, strict=True)]


# ------------------------------------------------------------------ rules

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


# ------------------------------------------------------------------ the plan: how each weight is cut

COLUMN, ROW, KV_HEADS, VOCAB = "column", "row", "kv heads", "vocabulary"

# Which weight tensor parallelism cuts, and how, by its name inside a block or at the model's
# ends (torchtitan calls such a table a parallelize plan): column = dim 0 (output features),
# row = dim 1 (input features), kv heads = dim 0 by KV head (a head on tp/kv ranks when
# tp > kv), vocabulary = dim 0 (words). Any other weight (norms, a router, experts) is whole on
# every tp rank. The modules above take their shards from it (`tp_cut`), and picolib.param_placement
# reads it to say where each parameter lives.
TP_PLAN = {"embed": VOCAB, "attn.wq": COLUMN, "attn.wk": KV_HEADS, "attn.wv": KV_HEADS,
           "attn.wo": ROW, "mlp.w_gate": COLUMN, "mlp.w_up": COLUMN, "mlp.w_down": ROW,
           "lm_head": VOCAB}


class Cut(NamedTuple):
    dim: int | None           # the dim cut (None: whole)
    index: int                # this rank's slice
    count: int                # slices along `dim`
    holders: tuple[int, ...]  # the tp ranks holding this same slice


def tp_cut(role: str, tp: int, rank: int, heads: tuple[int, int] | None = None) -> Cut:
    """Where TP_PLAN puts the weight `role` (e.g. "attn.wk") on tp rank `rank` of `tp`;
    `heads` = (n_heads, n_kv_heads), needed for a KV-heads cut."""
    how = TP_PLAN.get(role)
    if how is None:
        return Cut(None, 0, 1, tuple(range(tp)))
    if how == KV_HEADS:
        _, shared = kv_heads_per_rank(*heads, tp)
        slot = rank // shared
        return Cut(0, slot, tp // shared, tuple(range(slot * shared, (slot + 1) * shared)))
    return Cut(1 if how == ROW else 0, rank, tp, (rank,))
