"""Low precision below bf16: a dynamic loss scaler for fp16, and FP8 with scales per tensor,
per row or per 1×128 tile (lesson 12).

fp16 has 5 exponent bits: its smallest normal number is 6.1e-5 (subnormals reach 6e-8), so
small gradients become 0. Loss scaling multiplies the loss by S before backward — every
gradient is S times larger and stays representable — and divides the gradients by S (in
fp32) before the update. A *dynamic* scaler starts large, halves S whenever a gradient
overflows (inf/NaN: that step is skipped) and doubles it after `growth_interval` clean steps.
bf16 has fp32's 8 exponent bits and needs none of this.

FP8 comes in two formats (PyTorch's `torch.float8_e4m3fn` and `torch.float8_e5m2`): e4m3
(largest 448, 3 mantissa bits) for weights and activations, e5m2 (largest 57,344, 2 mantissa
bits) with more range for gradients. Eight bits hold only a few hundred values, so a tensor
is stored as FP8 codes times a scale: scale = amax / largest, chosen per *group* of
elements. One scale per tensor lets one large value push every small one below FP8's
smallest numbers; one per row, or per 1×128 tile (DeepSeek-V3's choice for activations),
follows the data. `Fp8Linear` quantizes a linear layer's matmul inputs this way (forward
and backward) and multiplies in fp32 — what FP8 matmul units do, minus their speed.
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["FP8", "fp8_max", "as_groups", "quantize", "dequantize", "fake_quantize", "relative_error",
           "DynamicLossScaler", "Fp8Linear", "fp8_model"]

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max(fmt: str = "e4m3") -> float:
    """The largest finite number of an FP8 format: 448 (e4m3), 57,344 (e5m2)."""
    return float(torch.finfo(FP8[fmt]).max)


def as_groups(x: torch.Tensor, group: str, tile: int = 128) -> torch.Tensor:
    """x viewed as (groups, elements per group): one group for "tensor", one per row (last
    dimension) for "row", one per 1×tile piece of a row for "tile"."""
    if group == "tensor":
        return x.reshape(1, -1)
    rows = x.reshape(-1, x.shape[-1])
    if group == "row":
        return rows
    if group == "tile":
        if x.shape[-1] % tile:
            raise ValueError(f"rows of {x.shape[-1]} do not split into 1×{tile} tiles")
        return rows.reshape(-1, tile)
    raise ValueError(f"group must be 'tensor', 'row' or 'tile', not {group!r}")


def quantize(x: torch.Tensor, group: str = "tensor", fmt: str = "e4m3", tile: int = 128):
    """(FP8 codes shaped like the groups, fp32 scale per group): x ≈ codes · scale."""
    g = as_groups(x.float(), group, tile)
    amax = g.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8_max(fmt), torch.ones_like(amax))
    return (g / scale).to(FP8[fmt]), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    return (codes.float() * scale).reshape(shape)


def fake_quantize(x: torch.Tensor, group: str = "tensor", fmt: str = "e4m3", tile: int = 128):
    """x rounded to what FP8 with these scales can hold, back in fp32."""
    return dequantize(*quantize(x, group, fmt, tile), x.shape)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖ / ‖exact‖."""
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


class DynamicLossScaler:
    """Loss scaling for fp16: `scale(loss)` before backward; `unscale_and_check(params)`
    after it divides the gradients by S in fp32 and returns False (skip the step, halve S)
    if any overflowed; S doubles after `growth_interval` good steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 100):
        self.scale_value, self.growth_interval, self.good = init_scale, growth_interval, 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_and_check(self, params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        finite = all(torch.isfinite(g).all() for g in grads)
        if not finite:
            self.scale_value /= 2
            self.good = 0
            return False
        for p in params:
            if p.grad is not None:
                p.grad = p.grad.float() / self.scale_value
        self.good += 1
        if self.good % self.growth_interval == 0:
            self.scale_value *= 2
        return True


def _fit(group: str, x: torch.Tensor, tile: int = 128) -> str:
    """Tiles where the rows split into them; rows that do not (the tiny Llama's h = 64) get
    one scale per row."""
    return "row" if group == "tile" and x.shape[-1] % tile else group


class _Fp8Matmul(torch.autograd.Function):
    """y = Q(x) Q(W)ᵀ with fp32 accumulation; backward: dx = Q(dy) Q(W), dW = Q(dy)ᵀ Q(x)."""

    @staticmethod
    def forward(ctx, x, weight, group, grad_fmt):
        xq = fake_quantize(x, _fit(group, x), "e4m3")
        wq = fake_quantize(weight, "row" if group != "tensor" else "tensor", "e4m3")
        ctx.save_for_backward(xq, wq)
        ctx.group, ctx.grad_fmt = group, grad_fmt
        return xq @ wq.t()

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        dyq = fake_quantize(dy, _fit(ctx.group, dy), ctx.grad_fmt)
        dx = dyq @ wq
        dw = dyq.reshape(-1, dy.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        return dx, dw, None, None


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose matmul inputs are FP8 (e4m3 activations and weights,
    `grad_fmt` for gradients) with scales per `group`; the products add up in fp32."""

    def __init__(self, linear: nn.Linear, group: str = "tile", grad_fmt: str = "e4m3"):
        super().__init__()
        self.weight, self.group, self.grad_fmt = linear.weight, group, grad_fmt

    def forward(self, x):
        return _Fp8Matmul.apply(x, self.weight, self.group, self.grad_fmt)


def fp8_model(model: nn.Module, group: str = "tile", grad_fmt: str = "e4m3",
              skip=("lm_head",)) -> nn.Module:
    """Swap every nn.Linear of `model` (except those named in `skip`) for an Fp8Linear
    sharing its weight, in place; returns the model."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name not in skip:
                setattr(module, child_name, Fp8Linear(child, group, grad_fmt))
    return model

