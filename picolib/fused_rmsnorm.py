"""RMSNorm as one fused kernel, forward and backward, written in Triton (lesson 12).

PyTorch's eager RMSNorm, y = x · rsqrt(mean(x²) + eps) · w, runs six kernels (pow, mean, add,
rsqrt, two multiplies), each reading its inputs from main memory and writing its output
back. A fused kernel reads each row of x once, keeps it on chip, and writes y once:

    forward   one program per row:  r = 1/sqrt(mean(x²) + eps);  y = x · r · w;  keep r
    backward  one program per row:  g = dy · w
                                    dx = r · g − x · r³ · mean(g · x)
                                    dw_row = dy · x · r        (summed over rows afterwards)

(the dx formula is the derivative of x·r with r depending on every element of the row).

On a GPU, Triton compiles the kernels; on a machine without one, Triton's interpreter runs
the same code on CPU tensors (the environment variable TRITON_INTERPRET=1, which must be set
before Triton is imported: this module sets it when there is no GPU). The interpreter is a
Python simulation — correct, and slow; speed is a GPU question.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["rmsnorm", "RMSNormFunction", "interpreted"]


def interpreted() -> bool:
    """True when Triton runs its interpreter (on CPU tensors), not compiled GPU code."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_sum(x):
    # tl.sum would do; tl.reduce with our own combine function also runs in the interpreter
    # when Triton was imported (by torch.compile, say) before TRITON_INTERPRET was set
    return tl.reduce(x, 0, _add)


@triton.jit
def _forward(X, W, Y, R, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(_row_sum(x * x) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, x * r * w, mask=mask)
    tl.store(R + row, r)


@triton.jit
def _backward(DY, X, W, R, DX, DW_ROWS, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row)
    g = dy * w
    dx = r * g - x * (r * r * r) * (_row_sum(g * x) / n_cols)
    tl.store(DX + row * n_cols + cols, dx, mask=mask)
    tl.store(DW_ROWS + row * n_cols + cols, dy * x * r, mask=mask)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: the forward kernel saves x and the per-row r; the backward kernel
    gives dx and per-row dw, which one sum over rows turns into the weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous().float()
        rows, cols = x2.shape
        y = torch.empty_like(x2)
        r = torch.empty(rows, device=x.device, dtype=torch.float32)
        block = triton.next_power_of_2(cols)
        _forward[(rows,)](x2, weight.contiguous().float(), y, r, cols, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, r)
        ctx.shape, ctx.block = shape, block
        return y.reshape(shape).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, r = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous().float()
        dx = torch.empty_like(x2)
        dw_rows = torch.empty_like(x2)
        _backward[(rows,)](dy2, x2, weight.contiguous().float(), r, dx, dw_rows, cols,
                           BLOCK=ctx.block)
        return dx.reshape(ctx.shape).to(dy.dtype), dw_rows.sum(0).to(weight.dtype), None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x · rsqrt(mean(x², last dim) + eps) · weight, by the fused Triton kernels."""
    return RMSNormFunction.apply(x, weight, eps)
