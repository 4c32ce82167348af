"""Checkpoints that any mesh can resume (lesson 10), with `torch.distributed.checkpoint`.

What is saved is the *logical* state: the single-process model's parameters and AdamW state,
under the single-process names (`blocks.5.attn.wq.weight`, not stage 1's `blocks.1...`),
whole tensors, and the step. So a checkpoint written at dp2×tp2 resumes at tp4, pp2 or on one
process: resuming builds the whole model from it and applies the same transforms as a fresh
start, which cut out each rank's slice (`apply_tensor_parallel` shards a whole model). The
optimizer state is cut the same way: a model whose weights are the state, transformed alike.

Saving is a collective. A rank turns what it holds into whole tensors — ZeRO's flat shards
all-gathered over the replicas, tensor-parallel slices all-gathered over tp (a KV head held
by several tp ranks once) — and hands them to `dcp.save`; DCP writes every tensor once,
from one of the ranks that hold it, each rank its own file. Pipeline stages hold different
tensors, so they write different parts. At the sizes of these lessons the whole tensors fit
on a rank; a production checkpoint keeps the shards as DTensors instead and lets DCP reshard.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .mappings import gather_along
from .tensor_parallel import ColumnParallelLinear, ParallelAttention, RowParallelLinear
from .vocab_parallel import VocabParallelEmbedding

__all__ = ["STATE", "save", "load", "global_name"]

STATE = ("exp_avg", "exp_avg_sq")   # AdamW's state per parameter (and its step count)


def global_name(stage, name: str) -> str:
    """A stage's parameter name in the whole model: its block i is the model's block layers[i]."""
    return re.sub(r"^blocks\.(\d+)\.", lambda m: f"blocks.{stage.layers[int(m.group(1))]}.", name)


def _tp_layouts(stage) -> dict[str, tuple[int, int, object]]:
    """{parameter name: (dim, replicas, group)} for the tensor-parallel slices of `stage`."""
    out = {}
    for mname, m in stage.named_modules():
        prefix = mname + "." if mname else ""
        if isinstance(m, ColumnParallelLinear | VocabParallelEmbedding):
            out[prefix + "weight"] = (0, 1, m.group)
            if getattr(m, "bias", None) is not None and isinstance(m, ColumnParallelLinear):
                out[prefix + "bias"] = (0, 1, m.group)
        elif isinstance(m, RowParallelLinear):
            out[prefix + "weight"] = (1, 1, m.group)
        if isinstance(m, ParallelAttention) and m.replicas > 1:   # KV heads held by `replicas` ranks
            for lin in ("wk", "wv"):
                for p in ("weight", "bias"):
                    if prefix + f"{lin}.{p}" in out:
                        out[prefix + f"{lin}.{p}"] = (0, m.replicas, m.group)
    return out


def _whole(t: torch.Tensor, layout) -> torch.Tensor:
    if layout is None:
        return t.detach().clone()
    dim, replicas, group = layout
    whole = gather_along(t.detach().contiguous(), dim, group)
    return torch.cat(whole.chunk(dist.get_world_size(group), dim)[::replicas], dim)


def _zero_flat(wrapper, key: str | None) -> dict[str, torch.Tensor]:
    """{name: tensor} of a ZeRO wrapper's masters (key None) or optimizer state `key`,
    all-gathered from the shards (a collective over its group)."""
    return {n: t for u in wrapper.units
            for n, t in u.gather(u.master if key is None else u.state[key], wrapper.group).items()}


def _local_state(stage, wrapper, optimizer, zero: bool) -> tuple[dict, dict, int]:
    """(params, {state key: tensors}, step) of one stage, by its local names, as held here."""
    if zero:
        params = _zero_flat(wrapper, None)
        return params, {k: _zero_flat(wrapper, k) for k in STATE}, wrapper.steps
    params = dict(stage.named_parameters())
    state, step = {k: {} for k in STATE}, 0
    for name, p in params.items():
        s = optimizer.state.get(p, {})
        for k in STATE:
            state[k][name] = s[k] if k in s else torch.zeros_like(p)
        step = int(s["step"]) if "step" in s else step
    return params, state, step


def save(path, stages: dict, wrappers: dict, optimizers: list, zero: bool, next_step: int) -> None:
    """Write the logical state of all ranks' stages to the folder `path` (every rank calls it)."""
    sd = {}
    for s, stage in stages.items():
        params, state, step = _local_state(stage, wrappers[s], optimizers[0] if not zero else None, zero)
        layouts = _tp_layouts(stage)
        for name, t in params.items():
            g = global_name(stage, name)
            sd[f"model.{g}"] = _whole(t, layouts.get(name)).float()
            for k in STATE:
                sd[f"optim.{k}.{g}"] = _whole(state[k][name], layouts.get(name)).float()
    sd["optim.step"] = torch.tensor(step)
    sd["next_step"] = torch.tensor(next_step)
    dcp.save(sd, checkpoint_id=str(path))


def load(path, model_cfg, names: list[str] | None = None) -> tuple[dict, dict, int, int]:
    """Read a checkpoint into whole tensors: (params, {state key: tensors}, optimizer step,
    next data step), for the parameters `names` (default: all of a TinyLlama of `model_cfg`)."""
    from .model import TinyLlama
    shapes = {n: p.shape for n, p in TinyLlama(model_cfg).named_parameters()}
    names = list(shapes) if names is None else names
    sd = {f"model.{n}": torch.empty(shapes[n]) for n in names}
    sd.update({f"optim.{k}.{n}": torch.empty(shapes[n]) for k in STATE for n in names})
    sd["optim.step"], sd["next_step"] = torch.tensor(0), torch.tensor(0)
    dcp.load(sd, checkpoint_id=str(path))
    params = {n: sd[f"model.{n}"] for n in names}
    state = {k: {n: sd[f"optim.{k}.{n}"] for n in names} for k in STATE}
    return params, state, int(sd["optim.step"]), int(sd["next_step"])
