"""Each rank builds only its part (lesson 10's trainer, `compose.build`).

`compose.build` creates the model on PyTorch's `meta` device (shapes and dtypes, no
storage), applies the transforms there (tensor, sequence, context, expert parallelism,
pipeline stages), and only then calls `materialize`: every parameter this rank holds gets
storage on the rank's device and exactly the values the one-process model has in the box
this rank holds (`layout.placements`); buffers (the RoPE tables, the routers' expert
biases) are computed as the one-process model computes them.

How a rank knows its box's values without the whole model: the one-process model draws
its weights from one seeded generator, one whole tensor after another in parameter order
(`model.init_tensor`), and each MoE layer from a generator of its own (`MoE.seed`).
`init_streams` lists those draws; a rank replays them, each whole tensor into one scratch
buffer the size of the largest tensor it must draw, copies out its box and draws the next
into the same buffer, stopping after the last tensor it holds. So while it builds, a rank
holds its own part plus one whole tensor (`allocation_peak` measures it;
tests/lib/test_materialize.py on 8 ranks), and the values are bitwise those of
`TinyLlama(cfg)` — the initialisation every lesson's numbers come from is unchanged.

What it costs instead: time. A generator cannot jump ahead, so a rank draws every tensor
before its last one (the last pipeline stage draws the whole dense stream, discarding what
others hold). A generator per parameter, seeded from its name, would let each rank draw
only its own tensors; it would also change every weight of every lesson.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from .param_placement import placements
from .model import TinyLlama, init_tensor, rope_tables

__all__ = ["init_streams", "materialize", "AllocationPeak"]


def init_streams(cfg) -> list[tuple[int, list[tuple[str, str, tuple[int, ...]]]]]:
    """The one-process model of a TrainConfig's initialisation, as its generators draw it:
    [(seed, [(name in the one-process model, name in the module that draws it, shape)])],
    the TinyLlama's stream first (its dense MLPs included, which a mixture of experts then
    replaces), then one stream per MoE layer. Computed on `meta`: no values."""
    from .moe import build_moe_layers
    mcfg = cfg.model_config()
    with torch.device("meta"):
        model = TinyLlama(mcfg)
        streams = [(mcfg.seed, [(n, n, tuple(p.shape)) for n, p in model.named_parameters()])]
        if cfg.experts:
            for layer, moe in zip(model.layers, build_moe_layers(model, cfg.experts, cfg.top_k)):
                streams.append((moe.seed, [(f"blocks.{layer}.mlp.{n}", n, tuple(p.shape))
                                           for n, p in moe.named_parameters()]))
    return streams


def _buffer(module: nn.Module, name: str, cache: dict) -> torch.Tensor:
    """The one-process value of a buffer (computed on the CPU, as the one-process model does)."""
    from .moe import Router
    if isinstance(module, TinyLlama) and name in ("rope_cos", "rope_sin"):
        c = module.cfg
        key = (c.head_dim, c.max_seq, c.rope_theta)
        if key not in cache:
            cache[key] = dict(zip(("rope_cos", "rope_sin"), rope_tables(*key)))
        return cache[key][name]
    if isinstance(module, Router) and name == "expert_bias":
        return torch.zeros(module.n_experts)
    raise NotImplementedError(f"materialize does not know the values of the buffer {name!r} "
                              f"of {type(module).__name__}: add it to picolib.materialize._buffer")


@torch.no_grad()
def materialize(stages: dict, cfg, rank: int, device) -> int:
    """Give this rank's stages {index: module}, built on `meta` and transformed, storage on
    `device` and the one-process values of the boxes rank `rank` holds (module docstring).
    Parameters keep their identity (`torch.utils.swap_tensors`), so whatever a transform
    keyed by them stays valid. Returns the elements of the scratch buffer used."""
    places = {(p.stage, p.local): p for p in placements(cfg, rank)}
    wanted: dict[str, list] = {}              # one-process name -> [(local tensor, box)]
    done = set()
    for s, module in stages.items():
        for local, p in module.named_parameters():
            if id(p) in done:
                continue
            done.add(id(p))
            place = places.get((s, local))
            if place is None or tuple(p.shape) != place.sizes:
                raise RuntimeError(f"stage {s}'s {local} {tuple(p.shape)} is not what "
                                   f"layout.placements describes ({place})")
            real = nn.Parameter(torch.empty(place.sizes, dtype=p.dtype, device=device),
                                requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, real)
            box = tuple(slice(o, o + n) for o, n in zip(place.offsets, place.sizes))
            wanted.setdefault(place.name, []).append((p, box))
    cache: dict = {}
    for module in stages.values():
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[name] = _buffer(m, name, cache).to(device=device, dtype=b.dtype)
    walks = []
    for seed, draws in init_streams(cfg):
        last = max((i for i, d in enumerate(draws) if d[0] in wanted), default=-1)
        if last >= 0:
            walks.append((seed, draws[:last + 1]))
    size = max((math.prod(shape) for _, draws in walks for *_, shape in draws), default=0)
    scratch = torch.empty(size)               # one whole tensor at a time, on the CPU
    filled = set()
    for seed, draws in walks:
        g = torch.Generator().manual_seed(seed)
        for name, own, shape in draws:
            whole = init_tensor(own, shape, g, out=scratch[:math.prod(shape)].view(shape))
            for t, box in wanted.get(name, ()):
                t.copy_(whole[box])
                filled.add(name)
    if set(wanted) - filled:
        raise RuntimeError(f"no initialisation stream draws {sorted(set(wanted) - filled)}")
    for module in stages.values():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_meta:
                raise RuntimeError(f"{name} is still on meta after materialize")
    return size


class AllocationPeak(contextlib.AbstractContextManager):
    """The most bytes of tensor storage PyTorch's CPU allocator held at once inside the
    block, counted from the allocations and frees it reports (`torch.profiler` with
    `profile_memory`): `peak` (above what was held on entry), `allocated`, `freed` (totals).
    Every tensor that PyTorch allocates on the CPU counts, whoever asked for it; meta
    tensors have no storage and count nothing. Slow (each allocation is an event): for
    measuring a build, not a training loop."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        from torch.autograd import DeviceType
        events = [e for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
        events.sort(key=lambda e: e.start_ns())
        held = self.peak = self.allocated = self.freed = 0
        for e in events:
            n = e.nbytes()
            held += n
            self.peak = max(self.peak, held)
            if n > 0:
                self.allocated += n
            else:
                self.freed -= n
        return False
