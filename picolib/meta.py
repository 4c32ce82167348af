"""What picolib's code does on `meta` tensors — shapes and dtypes without values — where a
real device would run a kernel the meta device does not choose (the dry run, lesson 11).

- `flash_attention`: on meta, PyTorch's fused attention takes its math path, which saves
  the s×s probabilities; a CPU or GPU run takes the flash kernel. `model.attention_core`
  calls this on meta tensors instead: the flash kernel's output and saved tensors.
- `fast_arithmetic`: PyTorch's meta add/sub/mul are Python (~0.5 ms a call); inside this
  block (the dry run's rank runs its step in it) they are a shape rule instead: the same
  shapes and dtypes, about 5× faster.

How: `fast_arithmetic` registers the rule as the Meta kernel of aten's ops through
`torch.library` (PyTorch's documented way to give an operator a kernel for a dispatch key;
nothing is assigned to a torch module or class). A kernel registration holds for the whole
process, so it is scoped: it is undone when the block ends (`torch_compat.scoped_library`),
and tests/lib/test_dry_run.py checks that PyTorch's own meta kernel is back afterwards.

The other places where picolib reads values say what they do on meta where they read them
(`memory.storage_key`, `flat.is_finite`, `moe.keep_mask` and `moe.sort_by_expert`,
`comm`'s calls, `model.TinyLlama.reset_parameters`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["flash_attention", "fast_arithmetic"]


class _FlashShapes(torch.autograd.Function):
    """Flash attention's shapes and saved tensors on meta: the output, and q, k, v (K/V heads
    not repeated: grouped-query flash kernels read them as they are), the output and one
    log-sum-exp per row of each head — what a GPU's kernel keeps for backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        # contiguous (b, heads, s, d), so the output projection's input is a copy of it, as
        # the planner counts. empty_like(q) took q's layout, which the meta kernels set
        # differently by release: under torch 2.6 q stayed transposed, the copy became a view
        # and the dry run counted about 4 % less than under 2.13 (measured; 2.11's 6 % less
        # looks the same). A flash kernel's own output is laid out (b, s, heads, d), which
        # would make it a view too: one s·b·h tensor a layer fewer than counted here.
        out = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def flash_attention(q, k, v):
    """Causal attention of meta q (b, heads, s, d), k, v (b, kv_heads, s, d), as the flash
    kernel's shapes and saved bytes."""
    return _FlashShapes.apply(q, k, v)


def _broadcast(a, b, *_, **__):
    shape = torch.broadcast_shapes(tuple(a.shape), tuple(getattr(b, "shape", ())))
    return torch.empty(shape, dtype=torch.result_type(a, b), device="meta")


@contextmanager
def fast_arithmetic():
    """Inside this block, aten's add, sub and mul on meta tensors run the shape rule
    (torch.library, module docstring); yields the ops registered. Torch 2.11 keeps its own
    Python meta kernel (the registration is refused): slower there, the same shapes."""
    from .torch_compat import scoped_library
    with scoped_library("aten", "IMPL") as lib:
        done = []
        for op in ("add.Tensor", "sub.Tensor", "mul.Tensor"):
            try:
                lib.impl(op, _broadcast, "Meta")
                done.append(op)
            except RuntimeError:
                pass
        yield done
