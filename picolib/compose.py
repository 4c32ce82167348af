"""One rank's part of a 5-D configuration (lesson 10): the transforms applied to the one
model in the documented order (docs/design.md) — tensor (+ sequence) parallel, context
parallel, experts, pipeline stages — then DDP or ZeRO over the ranks that hold the same
weights (dp × cp), and the optimizer. `picolib.train` runs what `build` returns.

Resuming from a checkpoint (`picolib.checkpoint`) starts from the whole model and the whole
optimizer state, and cuts both exactly as a fresh start cuts the weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .checkpoint import STATE
from .context_parallel import apply_context_parallel
from .data_parallel import DDP
from .expert_parallel import apply_expert_parallel, expert_gradient_groups
from .flat import shard_bounds
from .mesh import Mesh
from .model import TinyLlama
from .moe import apply_moe
from .pipeline_parallel import schedule_stages
from .pipeline_schedules import make_schedule
from .rank import device
from .tensor_parallel import apply_tensor_parallel
from .zero import ZeRO

__all__ = ["transform", "build"]


def transform(model: TinyLlama, cfg, mesh: Mesh):
    """The transforms in their order; returns this rank's stages {index: module}, the schedule
    and the expert gradient groups."""
    if cfg.tp > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=cfg.sp)
    if cfg.cp > 1:
        apply_context_parallel(model, mesh, layout=cfg.cp_layout, algorithm=cfg.cp_algorithm)
    expert_groups = {}
    if cfg.experts and cfg.ep > 1:
        apply_expert_parallel(model, mesh, n_experts=cfg.experts, top_k=cfg.top_k, ep=cfg.ep)
        expert_groups = expert_gradient_groups(model)
    elif cfg.experts:
        apply_moe(model, n_experts=cfg.experts, top_k=cfg.top_k)
    sched = None
    stages = {0: model}
    if cfg.pp > 1:
        sched = make_schedule(cfg.schedule, cfg.pp, cfg.micro_batches,
                              cfg.chunks if cfg.schedule == "interleaved" else 1)
        mine = sched.stages_of(mesh.coordinate("pp"))
        stages = {s: m for s, m in schedule_stages(model, sched).items() if s in mine}
    return stages, sched, expert_groups


def build(cfg, mesh: Mesh, resume=None):
    """This rank's stages {index: module}, their wrappers, the optimizers and the schedule;
    with `resume` = checkpoint.load(...), the weights and optimizer state it holds."""
    model = TinyLlama(cfg.model_config())
    if resume:
        model.load_state_dict(resume[0])
    stages, sched, expert_groups = transform(model.to(device()), cfg, mesh)
    replicas = mesh.group("dp", "cp") if cfg.cp > 1 else mesh.group("dp")
    if cfg.zero:
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        wrappers = {s: ZeRO(m, cfg.zero, group=replicas, optimizer="adamw", lr=cfg.lr,
                            param_dtype=dtype) for s, m in stages.items()}
        optimizers = list(wrappers.values())
    else:
        wrappers = {s: DDP(m, group=replicas, groups=expert_groups) for s, m in stages.items()}
        params = [p for m in stages.values() for p in m.parameters()]
        optimizers = [torch.optim.AdamW(params, lr=cfg.lr)]
    if resume:
        _restore_optimizer(cfg, mesh, stages, wrappers, optimizers, resume)
    return stages, wrappers, optimizers, sched, replicas


def _restore_optimizer(cfg, mesh, stages, wrappers, optimizers, resume):
    """Cut the whole AdamW state like the weights: a model whose weights are the state goes
    through the same transforms; then hand each rank its part (ZeRO: its flat shard)."""
    _, state, step, _ = resume
    cut = {}
    for k in STATE:
        twin = TinyLlama(cfg.model_config())
        twin.load_state_dict(state[k])
        cut[k] = transform(twin.to(device()), cfg, mesh)[0]
    for s, stage in stages.items():
        local = {k: dict(cut[k][s].named_parameters()) for k in STATE}
        if cfg.zero:
            w = wrappers[s]
            w.steps = step
            for u in w.units:
                lo, hi = shard_bounds(u.numel, w.n, dist.get_rank(w.group))
                for k in STATE:
                    flat = torch.cat([local[k][n].detach().reshape(-1).float() for n in u.names])
                    flat = torch.cat([flat, flat.new_zeros(max(hi - u.numel, 0))])
                    u.state[k].copy_(flat[lo:hi])
        else:
            for name, p in stage.named_parameters():
                optimizers[0].state[p] = {"step": torch.tensor(float(step)),
                                          **{k: local[k][name].detach().clone() for k in STATE}}
