"""A 5-D configuration (lesson 10): what it is (`TrainConfig`), whether it can run
(`check_config`, before any process starts), and one rank's part of it (`build`): the
transforms applied to the one model in the documented order (docs/design.md) — tensor
(+ sequence) parallel, context parallel, experts, pipeline stages — then DDP or ZeRO over the
ranks that hold the same weights (dp × cp), and the optimizer. `picolib.train` runs it.

Resuming from a checkpoint (`picolib.checkpoint.load_into`) reads each rank's own part
straight into what `build` made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checkpoint
from .context_parallel import LAYOUTS, apply_context_parallel, check_context_parallel
from .data_parallel import DDP
from .expert_parallel import apply_expert_parallel, expert_gradient_groups
from .mesh import Mesh, check_mesh
from .model import LlamaConfig, TinyLlama
from .moe import apply_moe, aux_loss_in_backward, check_moe
from .pipeline_parallel import schedule_stages
from .pipeline_schedules import SCHEDULES, make_schedule
from .rank import device
from .tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from .zero import ZeRO

__all__ = ["PRESETS", "LR_SCHEDULES", "TrainConfig", "check_config", "transform", "build",
           "decay_groups", "lr_factor"]

LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY = 0.2   # wsd (warmup-stable-decay): the last 20% of the steps after warmup decay

PRESETS = {  # model shapes: a few hundred thousand to a few million parameters
    "tiny": dict(hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64),
    "small": dict(hidden=64, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=192),
    "base": dict(hidden=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=768),
}


@dataclass
class TrainConfig:
    """One training run; every field is a command-line option (`--help`)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0                 # 0: DDP; 1, 2, 3: ZeRO stage
    schedule: str = "1f1b"
    chunks: int = 2               # v for the interleaved schedule
    micro_batches: int = 1
    batch: int = 8                # global batch (sequences per step)
    seq: int = 32
    steps: int = 10
    preset: str = "tiny"
    recompute: str = "none"
    precision: str = "fp32"       # "bf16": bf16 autocast (+ ZeRO: bf16 copies of fp32 masters)
    experts: int = 0              # > 0: every MLP becomes a mixture of this many experts
    top_k: int = 1
    ep: int = 1                   # expert-parallel ranks, a block of the dp ranks
    cp_algorithm: str = "ring"
    cp_layout: str = "zigzag"
    data: str = "text"            # "text": the shipped text; "random": uniform tokens
    lr: float = 1e-3
    warmup: int = 0               # steps of linear warmup to lr
    lr_schedule: str = "constant"  # after warmup: constant, cosine, linear or wsd, to min_lr
    min_lr: float = 0.0
    weight_decay: float = 0.01    # AdamW's, on parameters of 2 or more dimensions only
    clip_grad: float = 1.0        # clip the global gradient norm to this (0: off)
    seed: int = 0
    peak_tflops: float | None = None
    log: str | None = None
    trace: str | None = None
    save: str | None = None       # checkpoint folder (torch.distributed.checkpoint)
    save_every: int = 0           # also save every this many steps (0: only at the end)
    keep: int = 2                 # complete step folders kept (older ones deleted)
    resume: str | None = None     # continue from this checkpoint, on any mesh
    progress: bool = True

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(**PRESETS[self.preset], max_seq=max(self.seq, 16), seed=self.seed,
                           recompute=self.recompute)


def check_config(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Refuse a configuration before any process starts, naming the numbers."""
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    check_mesh(cfg.world_size if world_size is None else world_size,
               **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    for name in ("batch", "seq", "steps", "micro_batches", "chunks"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}")
    if cfg.warmup < 0:
        raise ValueError(f"--warmup must be ≥ 0, not {cfg.warmup}")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, not {cfg.lr_schedule!r}")
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise ValueError(f"--min-lr must be between 0 and --lr {cfg.lr:g}, not {cfg.min_lr:g}")
    if cfg.weight_decay < 0:
        raise ValueError(f"--weight-decay must be ≥ 0, not {cfg.weight_decay:g}")
    if cfg.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0 (DDP), 1, 2 or 3, not {cfg.zero}")
    if cfg.data not in ("text", "random"):
        raise ValueError(f"--data must be 'text' or 'random', not {cfg.data!r}")
    if cfg.precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision must be fp32 or bf16, not {cfg.precision!r}")
    mcfg = cfg.model_config()
    if cfg.tp > 1:
        check_tensor_parallel(mcfg, cfg.tp)
    if cfg.sp and cfg.tp == 1:
        raise ValueError("--sp (sequence parallelism) splits the sequence over tp: it needs --tp ≥ 2")
    local_seq = cfg.seq // cfg.cp
    if cfg.sp and (cfg.seq % cfg.cp or local_seq % cfg.tp):
        raise ValueError(f"with --sp each rank's {cfg.seq}/{cfg.cp} tokens must divide by tp={cfg.tp}")
    if cfg.cp > 1:
        if cfg.cp_layout not in LAYOUTS:
            raise ValueError(f"unknown --cp-layout {cfg.cp_layout!r}; known: {list(LAYOUTS)}")
        check_context_parallel(mcfg, cfg.cp, cfg.cp_algorithm, cfg.cp_layout, tp=cfg.tp, seq=cfg.seq)
    per_replica = cfg.dp * cfg.micro_batches
    if cfg.batch % per_replica:
        raise ValueError(f"the batch of {cfg.batch} sequences must divide into dp={cfg.dp} "
                         f"replicas × {cfg.micro_batches} micro-batches")
    if cfg.pp > 1:
        if cfg.schedule == "dualpipe":
            raise ValueError("the trainer runs one copy of each stage; DualPipe keeps two "
                             "(lesson 07 runs it): choose another --schedule")
        v = cfg.chunks if cfg.schedule == "interleaved" else 1
        sched = make_schedule(cfg.schedule, cfg.pp, cfg.micro_batches, v)
        n_stages = len(sched.stage_ranks)
        if n_stages > mcfg.n_layers:
            raise ValueError(f"{n_stages} pipeline stages need at least as many "
                             f"layers; the {cfg.preset} preset has {mcfg.n_layers}")
        if mcfg.n_layers % n_stages:   # pipeline_parallel.partition: equal stages only
            raise ValueError(f"{mcfg.n_layers} layers do not split evenly into {n_stages} stages "
                             f"(--pp {cfg.pp}" + (f" × --chunks {v}" if v > 1 else "") + "): the "
                             "trainer gives every stage the same number of layers; choose a "
                             f"pipeline whose stages divide {mcfg.n_layers}")
        if cfg.zero == 3:
            raise ValueError("ZeRO-3 × pipeline parallelism is not supported: ZeRO-3 frees a "
                             "stage's parameters after each forward while a schedule keeps "
                             f"{cfg.micro_batches} micro-batches in flight; use --zero 1 or 2")
    elif cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown --schedule {cfg.schedule!r}; choose one of {sorted(SCHEDULES)}")
    if cfg.experts:
        check_moe(cfg.experts, cfg.top_k, None, "softmax", cfg.ep)
        if cfg.dp % cfg.ep:
            raise ValueError(f"--ep {cfg.ep} must divide --dp {cfg.dp} (expert-parallel groups "
                             "are made of data-parallel ranks)")
        if cfg.zero == 3 and cfg.ep > 1:
            raise ValueError(f"--zero 3 gathers each block over all dp={cfg.dp} replicas, but "
                             f"with --ep {cfg.ep} a block's experts differ between them: use "
                             "--zero 1 or 2")
    elif cfg.ep > 1:
        raise ValueError(f"--ep {cfg.ep} spreads experts: add --experts")
    if not cfg.clip_grad >= 0:
        raise ValueError(f"--clip-grad must be ≥ 0 (0 turns clipping off), not {cfg.clip_grad}")
    if cfg.save_every < 0:
        raise ValueError(f"--save-every must be ≥ 0, not {cfg.save_every}")
    if cfg.keep < 1:
        raise ValueError(f"--keep must be at least 1 (the newest checkpoint), not {cfg.keep}")
    if cfg.save:
        checkpoint.check_save(cfg.save)
    if cfg.resume:
        checkpoint.check_resume(cfg.resume, cfg)
    if cfg.zero == 3 and cfg.recompute != "none":
        raise ValueError("ZeRO-3 frees parameters after forward: --recompute needs --zero ≤ 2")


def transform(model: TinyLlama, cfg: TrainConfig, mesh: Mesh):
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
    if cfg.experts:     # a stage's balancing loss cannot reach the last stage's loss
        aux_loss_in_backward(model, scale=1 / cfg.micro_batches,
                             group=mesh.group("cp") if cfg.cp > 1 else None)
    sched = None
    stages = {0: model}
    if cfg.pp > 1:
        sched = make_schedule(cfg.schedule, cfg.pp, cfg.micro_batches,
                              cfg.chunks if cfg.schedule == "interleaved" else 1)
        mine = sched.stages_of(mesh.coordinate("pp"))
        stages = {s: m for s, m in schedule_stages(model, sched).items() if s in mine}
    return stages, sched, expert_groups


def build(cfg: TrainConfig, mesh: Mesh):
    """This rank's stages {index: module}, their data-parallel wrappers (each owns its
    stage's AdamW: the one data-parallel contract, picolib/data_parallel.py), the things to
    step (the wrappers) and the schedule. The only place that asks which wrapper: below.
    A resume then reads each rank's part into them (`checkpoint.load_into`)."""
    model = TinyLlama(cfg.model_config())
    stages, sched, expert_groups = transform(model.to(device()), cfg, mesh)
    replicas = mesh.group("dp", "cp") if cfg.cp > 1 else mesh.group("dp")
    adamw = dict(optimizer=torch.optim.AdamW, lr=cfg.lr)
    if cfg.zero:   # bf16: compute copies of the weights; fp32 masters (and autocast, train.py)
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        wrappers = {s: ZeRO(m, cfg.zero, group=replicas, param_dtype=dtype, groups=expert_groups,
                            param_groups=decay_groups(m, cfg.weight_decay), **adamw)
                    for s, m in stages.items()}
    else:          # bf16: autocast around forward (train.py); weights and gradients fp32
        wrappers = {s: DDP(m, group=replicas, groups=expert_groups,
                           param_groups=decay_groups(m, cfg.weight_decay), **adamw)
                    for s, m in stages.items()}
    optimizers = list(wrappers.values())
    return stages, wrappers, optimizers, sched, replicas


def decay_groups(module, weight_decay: float) -> list[dict]:
    """torch.optim param groups: weight decay on the parameters of 2 or more dimensions
    (matrices, embeddings), none on the 1-D ones (norm weights, biases), as Megatron-LM and
    nanoGPT do. The rule reads each parameter's own shape, which no transform changes the
    rank of (a TP slice of a matrix is a matrix)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate of step `step` (from 0) as a fraction of cfg.lr: linear warmup over
    cfg.warmup steps (lr·(step+1)/warmup), then cfg.lr_schedule from lr at the first step
    after warmup to min_lr at the last: constant (min_lr unused), cosine, linear, or wsd
    (constant, then linear over the last 20% of the steps after warmup)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    t = min((step - cfg.warmup) / max(cfg.steps - cfg.warmup - 1, 1), 1.0)
    if cfg.lr_schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    if cfg.lr_schedule == "linear":
        return 1 - (1 - floor) * t
    if cfg.lr_schedule == "wsd" and t > 1 - WSD_DECAY:
        return 1 - (1 - floor) * (t - (1 - WSD_DECAY)) / WSD_DECAY
    return 1.0


