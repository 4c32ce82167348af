"""A tiny Llama: the model every lesson trains, small enough for 8 ranks on a laptop.

Same parts as Llama 3 — RMSNorm, rotary position embedding (RoPE), grouped-query
attention (GQA: fewer key/value heads than query heads) and a SwiGLU MLP — at sizes of a
few hundred thousand parameters. Lesson 01 counts its parameters with a formula and
measures its memory; the technique files (tensor, sequence, pipeline parallel, ...) cut
it into pieces and must give back the same numbers as this single-process reference.

Choices made for teaching:
- q, k, v, o and gate, up, down are separate `nn.Linear`s, named as in the literature,
  so a parallel version can shard each one;
- attention is written out (`attn_impl="eager"`) so the saved s×s score matrices are
  visible to the memory lesson; `attn_impl="sdpa"` uses the fused kernel (flash-style
  on CPU and GPU), which saves no s×s matrix and takes the K/V heads unrepeated (GQA);
- RoPE is one complex multiply (`apply_rope`); generation keeps the keys and values of
  the tokens seen in a `KVCache` (`picolib.generate`);
- `recompute="full"` recomputes each block in backward, `"selective"` only the
  attention core (the softmax(QKᵀ)V part), as in Korthikanti et al. 2022 (lesson 01b);
- weights come from the config's seed alone: same seed → bitwise same model.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["LlamaConfig", "TinyLlama", "INIT_STD", "init_tensor", "RMSNorm", "AttentionCore", "Attention", "SwiGLU", "Block",
           "CrossEntropy", "KVCache",
           "rope_tables", "apply_rope", "upcast", "attention_core", "causal_mask", "param_count",
           "random_tokens", "TextData", "repeat_kv"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256          # bytes: the shipped text is tokenised byte by byte
    hidden: int = 64               # h
    n_layers: int = 4              # L
    n_heads: int = 4               # a (query heads)
    n_kv_heads: int = 2            # key/value heads (GQA); = n_heads is plain multi-head
    ffn_hidden: int = 128          # SwiGLU inner size
    max_seq: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0
    attn_impl: str = "eager"       # "eager" | "sdpa"
    recompute: str = "none"        # "none" | "full" | "selective"

    def __post_init__(self):
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} must divide by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide by n_kv_heads={self.n_kv_heads}")
        if self.attn_impl not in ("eager", "sdpa"):
            raise ValueError(f"attn_impl must be 'eager' or 'sdpa', not {self.attn_impl!r}")
        if self.recompute not in ("none", "full", "selective"):
            raise ValueError(f"recompute must be 'none', 'full' or 'selective', not {self.recompute!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def replace(self, **changes) -> "LlamaConfig":
        return replace(self, **changes)


def param_count(cfg: LlamaConfig) -> int:
    """Parameters of TinyLlama by formula (lesson 01).

    embedding v·h + per layer [q: h·a·d, k and v: 2·h·kv·d, o: a·d·h, SwiGLU: 3·h·f,
    two norms: 2h] + final norm h + output head h·v (untied).
    """
    h, v, L, f = cfg.hidden, cfg.vocab_size, cfg.n_layers, cfg.ffn_hidden
    d, a, kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    per_layer = h * a * d + 2 * h * kv * d + a * d * h + 3 * h * f + 2 * h
    return v * h + L * per_layer + h + h * v


class RMSNorm(nn.Module):
    """x / rms(x) · g — LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self.normalize(x) * self.weight


INIT_STD = 0.02    # the standard deviation of every drawn weight


@torch.no_grad()
def init_tensor(name: str, shape, generator: torch.Generator, out: torch.Tensor | None = None):
    """The initial value of the parameter `name` (its name in the module being initialised)
    of `shape`: ones for a norm's weight (nothing drawn), else Normal(0, INIT_STD) drawn from
    `generator`, one whole tensor at a time — written into `out` (a tensor of `shape`) where
    given. The one rule of the model's initialisation: `TinyLlama.reset_parameters`,
    `moe.MoE.reset_parameters` and `picolib.materialize` (a rank building only its part)
    all call it, so they give the same values (tests/lib/test_materialize.py)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape) if out is None else out.fill_(1.0)
    return torch.randn(shape, generator=generator, out=out).mul_(INIT_STD)


def rope_tables(head_dim: int, max_seq: int, theta: float):
    """cos and sin of position·frequency, shape (max_seq, head_dim/2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


class _Rotate(torch.autograd.Function):
    """x rotated by the angles (cos, sin); its backward rotates the gradient back (the
    opposite angle: cos, −sin). Saving only the tables (views of the model's buffers) keeps
    the rotation's saved bytes at zero, as lesson 01 counts them."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:      # e.g. an expanded gradient: a pair must be adjacent
            grad = grad.contiguous()
        return _rotate(grad, cos, -sin), None, None


def _rotate(x, cos, sin):
    pairs = torch.view_as_complex(upcast(x).unflatten(-1, (-1, 2)))       # x[2i] + i·x[2i+1]
    turn = torch.complex(upcast(cos), upcast(sin))                        # e^{i·angle}, (s, d/2)
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


def apply_rope(x, cos, sin):
    """Rotate each pair (x[2i], x[2i+1]) by its position's angle. x: (b, heads, s, d);
    cos/sin: (s, d/2).

    One step: the pair is read as the complex number x[2i] + i·x[2i+1] and multiplied by
    cos + i·sin — one complex multiply, in fp32 at least (Meta's Llama code does the same).
    We chose it over the rotate-half form (x·cos + rotate_half(x)·sin, Hugging Face's)
    because rotate-half turns the pairs (x[i], x[i + d/2]): the same weights would then be
    a different model, while the complex multiply keeps the pairs this model always used
    (losses and gradients equal the two-slice form it replaced, tests/lib/test_model.py) and
    is one kernel where two slices, four products and a stack were seven (measured on one
    CPU thread: forward + backward 3× faster or more)."""
    return _Rotate.apply(x, cos, sin)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 → fp32 for a numerically touchy step (softmax, loss); fp32/fp64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def repeat_kv(x, n_rep: int):
    """GQA: each key/value head serves n_rep query heads. (b, kv, s, d) → (b, kv·n_rep, s, d)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


# SDPA takes K/V heads unrepeated (enable_gqa) from torch 2.5 on, but the CPU's fused kernel
# only from 2.9 (pytorch/pytorch#157893): before, a CPU call with enable_gqa falls back to the
# math path, which saves the s×s probabilities; there the K/V heads are repeated here instead
_TORCH = torch.torch_version.TorchVersion(torch.__version__)
SDPA_GQA = _TORCH >= (2, 5)
SDPA_GQA_CPU = _TORCH >= (2, 9)


def attention_core(q, k, v, impl: str = "eager", causal: bool = True):
    """softmax(q kᵀ/√d + causal mask) v. q (b, heads, s_q, d); k, v (b, kv_heads, s_k, d)
    with kv_heads dividing heads (GQA: each K/V head serves heads/kv_heads query heads).
    With s_k > s_q (a K/V cache) the queries are the last s_q positions."""
    n_rep = q.shape[1] // k.shape[1]
    s_q, s_k = q.shape[-2], k.shape[-2]
    if impl == "sdpa":
        gqa_ok = SDPA_GQA_CPU or (SDPA_GQA and q.device.type != "cpu")
        if not gqa_ok:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        gqa = {"enable_gqa": n_rep > 1} if gqa_ok else {}
        if s_q == s_k or not causal:                   # SDPA's is_causal aligns top-left
            if q.is_meta:                              # the flash kernel's bytes (picolib.meta)
                from .meta import flash_attention
                return flash_attention(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(s_q, s_k, q.device), **gqa)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~causal_mask(s_q, s_k, q.device), float("-inf"))
    return scores.softmax(-1) @ v


def causal_mask(s_q: int, s_k: int, device=None):
    """(s_q, s_k) bool, True where query i (the (s_k − s_q + i)-th position) may see key j."""
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(s_k - s_q)


class AttentionCore(nn.Module):
    """The part of attention that mixes tokens: softmax(q kᵀ/√d + causal mask) v.

    A module of its own so that a transform can swap it (context parallelism puts ring
    attention here, lesson 06) while the projections around it stay. It receives the
    key/value heads unrepeated (GQA), so a core that moves K/V between ranks moves the
    smaller tensors; the fused kernel (`sdpa`) takes them so too, eager attention repeats
    them (the repeated K/V are what it saves). `selective` recomputes it in backward
    instead of saving the s×s scores (lesson 01b)."""

    def __init__(self, impl: str = "eager", selective: bool = False):
        super().__init__()
        self.impl, self.selective = impl, selective

    def forward(self, q, k, v):
        """q (b, heads, s, d); k, v (b, kv_heads, s, d) with kv_heads dividing heads (GQA)."""
        if self.impl == "eager":   # heads may be a shard: keep the ratio, not the totals
            n_rep = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if self.selective and torch.is_grad_enabled():
            return checkpoint(attention_core, q, k, v, self.impl, use_reentrant=False)
        return attention_core(q, k, v, self.impl)


class Attention(nn.Module):
    """Grouped-query self-attention: project (q, k, v), rotate q and k, the core, project out.

    `project` and `output` are the two places tensor parallelism changes (lesson 04:
    `ParallelAttention` overrides them); `core` is where context parallelism does."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, d
        self.wq = nn.Linear(h, cfg.n_heads * d, bias=False)
        self.wk = nn.Linear(h, cfg.n_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, cfg.n_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.n_heads * d, h, bias=False)
        self.core = AttentionCore(cfg.attn_impl, cfg.recompute == "selective")

    def project(self, x):
        return self.wq(x), self.wk(x), self.wv(x)

    def output(self, y):
        return self.wo(y)

    def forward(self, x, cos, sin, cache: "KVCache | None" = None):
        """`cache` (generation): this layer's earlier keys and values; the new ones join
        them and the queries attend to all."""
        q, k, v = self.project(x)
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(self, k, v)
        out = self.core(q, k, v)
        return self.output(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, cache: "KVCache | None" = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class KVCache:
    """Keys and values of the tokens a sequence has seen so far, per attention layer
    (generation, `picolib.generate`): each new token computes only its own K/V, appends
    them, and attends to all. `length` is the number of tokens cached."""

    def __init__(self):
        self.keys: dict = {}        # attention module -> (b, kv_heads, length, d)
        self.values: dict = {}

    @property
    def length(self) -> int:
        return next(iter(self.keys.values())).shape[2] if self.keys else 0

    def append(self, layer, k, v):
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class CrossEntropy(nn.Module):
    """The loss as a part of the model: mean cross-entropy of (..., vocab) logits, in fp32
    at least. Tensor parallelism swaps it for the vocab-parallel one (lesson 04)."""

    def forward(self, logits, targets):
        return F.cross_entropy(upcast(logits.flatten(0, -2)), targets.flatten())


class TinyLlama(nn.Module):
    """tokens (b, s) → logits (b, s, vocab); `loss(tokens, targets)` is `loss_fn` of them.

    The one forward every technique runs. Its parts are attributes a transform replaces
    in place (`picolib.tensor_parallel.apply_tensor_parallel`, ...), and a pipeline stage
    is this model with some parts absent (`part`, lesson 07): without `embed` the input
    is the hidden states (b, s, h); without `lm_head` the output is.

    `positions` (a tensor (s,) or a range) are the tokens' positions for RoPE (default
    range(s), or `position_ids(s)` where context parallelism set it: the positions of the
    tokens a rank holds, lesson 06). `sequence_shards` is the
    number of slices the residual stream is cut into along the sequence (sequence
    parallelism sets it to tp: a rank's hidden states are then (b, s/tp, h))."""

    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.sequence_shards = 1
        self.position_ids = None              # context parallelism: local length → positions
        self.layers = range(cfg.n_layers)     # which of the model's blocks this one holds
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.loss_fn = CrossEntropy()
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(cfg.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int):
        """Normal(0, 0.02) weights and unit norms, drawn from a private generator (seeded)
        in parameter order (`init_tensor`); a rank replays this stream to build only its
        part (`picolib.materialize`). On meta there is nothing to draw."""
        if next(self.parameters()).is_meta:
            return
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, g))

    def rope(self, positions: torch.Tensor | range):
        """(cos, sin) at `positions`, each (s, head_dim/2). A range gives views of the
        tables (nothing copied, nothing for backward to keep); a tensor, any positions."""
        if len(positions):
            last = max(positions) if isinstance(positions, range) else int(positions.max())
            if last >= self.cfg.max_seq:
                raise ValueError(f"position {last} is beyond max_seq={self.cfg.max_seq}")
        if isinstance(positions, range):
            positions = slice(positions.start, positions.stop, positions.step)
        return self.rope_cos[positions], self.rope_sin[positions]

    def hidden_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """The shape of this rank's hidden states for (batch, seq) tokens (what a pipeline
        stage sends and receives)."""
        return batch, seq // self.sequence_shards, self.cfg.hidden

    def forward(self, x, positions: torch.Tensor | range | None = None, cache: KVCache | None = None):
        """`cache`: the K/V of the tokens before `x` (generation); positions then continue
        from its length."""
        start = 0 if cache is None else cache.length
        if self.embed is not None:
            seq = x.shape[1]
            if seq % self.sequence_shards:
                raise ValueError(f"the sequence length {seq} must divide by tp="
                                 f"{self.sequence_shards} (sequence parallelism gives each "
                                 "rank s/tp tokens)")
            x = self.embed(x)
        else:
            seq = x.shape[1] * self.sequence_shards
        if positions is None:
            positions = (range(start, start + seq) if self.position_ids is None
                         else self.position_ids(seq))
        cos, sin = self.rope(positions)
        for block in self.blocks:
            if self.cfg.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, cache, use_reentrant=False)
            else:
                x = block(x, cos, sin, cache)
        return x if self.lm_head is None else self.lm_head(self.norm(x))

    def loss(self, tokens, targets, positions: torch.Tensor | range | None = None):
        return self.loss_fn(self(tokens, positions), targets)

    def part(self, layers, embed: bool = True, head: bool = True) -> "TinyLlama":
        """This model restricted to the blocks `layers`, with or without the embedding and
        the head (norm, lm_head, loss): a pipeline stage (lesson 07). It shares this model's
        modules and parameters; replacing a part of it leaves this model alone."""
        stage = copy.copy(self)
        # nn.Module keeps its parts in dicts: give the stage its own (the parts are shared)
        stage.__dict__.update({k: v.copy() for k, v in vars(self).items() if isinstance(v, dict)})
        stage.blocks = nn.ModuleList(self.blocks[i] for i in layers)
        stage.layers = layers
        if not embed:
            stage.embed = None
        if not head:
            stage.norm = stage.lm_head = stage.loss_fn = None
        return stage


# --------------------------------------------------------------------------- data

def random_tokens(batch: int, seq: int, vocab: int = 256, seed: int = 0):
    """(tokens, targets) of uniform random ids; targets are tokens shifted by one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class TextData:
    """The shipped text (picolib/data/tiny.txt) as bytes; `batch(b, s, step)` gives
    (tokens, targets) windows, deterministic in `step`. Nothing is downloaded."""

    path = Path(__file__).parent / "data" / "tiny.txt"

    def __init__(self, path: str | Path | None = None):
        self.ids = torch.tensor(list(Path(path or self.path).read_bytes()), dtype=torch.long)

    def batch(self, batch: int, seq: int, step: int = 0, seed: int = 0):
        if seq + 1 > len(self.ids):
            raise ValueError(f"seq={seq} is longer than the text ({len(self.ids)} bytes)")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.ids) - seq - 1, (batch,), generator=g)
        windows = torch.stack([self.ids[s:s + seq + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
