"""Gradient clipping by the global norm, on any layout (lesson 10b).

`torch.nn.utils.clip_grad_norm_` on one process computes ‖g‖ = sqrt(Σ g²) over every element of
the model's gradient, and scales all of it by min(1, max_norm / (‖g‖ + 1e-6)). On a mesh no
rank holds the whole gradient, and a per-rank norm is wrong twice over: a rank sees only its
tp slices, its pipeline stage, its ZeRO shard, its experts (too small), while summing the
ranks' squares counts every copy again — the norm weights on each tp rank, a KV head held by
several tp ranks, every data-parallel replica (too large).

`clip_grad_norm_` counts each element of the whole gradient exactly once, from where each
parameter lives (`picolib.param_placement`): of the ranks that hold the same box (copies), only the
first set of data-parallel replicas counts it, and within that set each replica counts the
part it answers for (the wrapper's `holdings()`: a ZeRO shard, or a 1/n slice of a DDP replica's whole
tensor). One all-reduce of one number over all ranks then sums tp slices, ZeRO shards,
pipeline stages and experts alike. Every rank gets the same norm and scales the gradients
its optimizer reads by the same factor, min(1, max_norm / (norm + 1e-6)), computed on the
device: nothing waits for the norm (a factor of exactly 1 leaves the gradients as they were).
Call it after the data-parallel wrappers have
reduced the gradients (`finish_gradient_sync()`) and before the optimizer steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .param_placement import placements

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(cfg, wrappers: dict, max_norm: float = 1.0) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (a 0-d float64 tensor, equal on every rank),
    after scaling every rank's gradients by min(1, max_norm / (norm + 1e-6)); `max_norm` 0:
    measure only. `cfg`: the TrainConfig; `wrappers`: {stage: DDP or ZeRO} of this rank.
    A collective: every rank calls it."""
    place = {(p.stage, p.local): p for p in placements(cfg, dist.get_rank())}
    grads, owns = [], []
    for stage, wrapper in wrappers.items():
        for held in wrapper.holdings(create_state=False).items:
            if held.grad is None:
                continue
            grads.append(held.grad)
            if place[(stage, held.name)].first:
                owns.append(held.grad[held.own_lo - held.lo:held.own_hi - held.lo])
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    if owns:       # one kernel for every tensor's norm; their squares summed in float64
        total = torch.stack(torch._foreach_norm(owns, 2, dtype=torch.float64)).pow(2).sum()
    dist.all_reduce(total)            # one number over all ranks: stages, slices, shards, experts
    norm = total.sqrt()
    if max_norm > 0 and grads:        # on the device: no branch on the norm, no wait for it
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for dtype in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(dtype))
    return norm
