"""The 5-D composition (lesson 10): one model, transformed in place, in one order, on one mesh.

The file opens with the composition itself: `transform` applies the techniques of lessons
04-09 to the one model — tensor (+ sequence) parallel over the mesh's "tp" group, context
parallel over "cp", experts over ep of the "dp" ranks, pipeline stages over "pp" — and
`build` wraps each of this rank's stages in DDP or ZeRO over the ranks that hold the same
weights (dp × cp), each wrapper owning its stage's AdamW. `picolib.step.forward_backward` is
the step that drives it; `picolib.train` runs the loop. docs/design.md explains the order.

After it, the machinery: `build_stages` builds the model on the `meta` device, transforms it
there, and then allocates only the parameters this rank holds, with the one-process values
(`picolib.materialize`); what a configuration is (`TrainConfig`), whether it can run
(`check_config`, before any process starts), its data and its learning-rate schedule.
Resuming from a checkpoint (`picolib.checkpoint.load_into`) reads each rank's own part
straight into what `build` made.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist

from . import checkpoint
from .context_parallel import apply_context_parallel
from .data_parallel import DDP
from .expert_parallel import apply_expert_parallel, expert_gradient_groups
from .materialize import materialize
from .mesh import Mesh
from .model import Block, LlamaConfig, TinyLlama
from .moe import apply_moe, aux_loss_in_backward
from .parallel_layout import Layout, check_layout, layout_of
from .pipeline_parallel import pair_gradient_groups, schedule_stages
from .tensor_parallel import apply_tensor_parallel
from .zero import ZeRO

__all__ = ["MODEL_PRESETS", "LR_SCHEDULES", "TrainConfig", "check_config", "open_data", "transform",
           "build_stages", "build",
           "decay_groups", "lr_factor"]


def transform(model: TinyLlama, cfg: TrainConfig, mesh: Mesh, log: list | None = None):
    """The one `model` made parallel in place, technique after technique, each over its own
    group of `mesh`: this rank's stages {index: module}, the schedule, and {parameter: group}
    for weights that ranks besides the replicas hold too (experts' edp, DualPipe's pair).
    `log`, a list, gets (technique, group) for each step applied, in order."""
    log = [] if log is None else log
    if cfg.tp > 1:
        apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=cfg.sp)
        log.append(("tensor", mesh.group("tp")))
    if cfg.cp > 1:
        apply_context_parallel(model, mesh.group("cp"), layout=cfg.cp_layout,
                               algorithm=cfg.cp_algorithm)
        log.append(("context", mesh.group("cp")))
    groups = {}
    if cfg.experts and cfg.ep > 1:       # EP: blocks of ep consecutive "dp" ranks
        apply_expert_parallel(model, mesh, n_experts=cfg.experts, top_k=cfg.top_k, ep=cfg.ep)
        groups = expert_gradient_groups(model)
        log.append(("expert", mesh.group("ep")))
    elif cfg.experts:
        apply_moe(model, n_experts=cfg.experts, top_k=cfg.top_k)
    if cfg.experts:     # a stage's balancing loss cannot reach the last stage's loss
        aux_loss_in_backward(model, scale=1 / cfg.micro_batches,
                             group=mesh.group("cp") if cfg.cp > 1 else None)
    if cfg.pp == 1:
        return {0: model}, None, groups
    sched = cfg.make_schedule()
    mine = sched.stages_of(mesh.coordinate("pp"))
    stages = {s: m for s, m in schedule_stages(model, sched).items() if s in mine}
    log.append(("pipeline", mesh.group("pp")))
    if cfg.schedule == "dualpipe":      # each stage's second copy is on the mirror rank
        groups |= pair_gradient_groups(stages, mesh)
    return stages, sched, groups


def build(cfg: TrainConfig, mesh: Mesh, log: list | None = None):
    """This rank's stages (`transform`ed, only its part allocated), each wrapped in DDP or ZeRO
    over its replicas (dp × cp), the wrapper owning the stage's AdamW. `log`: as `transform`'s,
    the data-parallel wrapping last."""
    stages, sched, groups = build_stages(cfg, mesh, log)
    replicas = mesh.group("dp", "cp") if cfg.cp > 1 else mesh.group("dp")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32   # of the compute copies
    data_parallel = partial(ZeRO, stage=cfg.zero) if cfg.zero else DDP
    wrappers = {s: data_parallel(m, group=replicas, groups=groups, param_dtype=dtype,
                                 param_groups=decay_groups(m, cfg.weight_decay),
                                 optimizer=torch.optim.AdamW, lr=cfg.lr)
                for s, m in stages.items()}
    if log is not None and dist.get_world_size(replicas) > 1:
        log.append(("data", replicas))
    if sched is not None and cfg.schedule == "dualpipe":   # gradients reduced over the pair too
        replicas = mesh.group("pair", "dp", "cp")
    return stages, wrappers, list(wrappers.values()), sched, replicas


# --------------------------------------------------------------------------- the machinery

def build_stages(cfg: TrainConfig, mesh: Mesh, log: list | None = None):
    """This rank's part of the model: the model is created on the `meta` device (no
    storage), transformed there, and then only the parameters this rank holds get storage
    on its device, with the values the one-process model has there (`materialize`: a rank
    holds at most its part plus one whole tensor while it builds). On a meta `mesh.device` (the
    dry run) nothing is materialized. With `cfg.compile`, each block is then compiled
    (`compile_blocks`). Returns `transform`'s (stages, schedule, gradient groups)."""
    with torch.device("meta"):     # what the transforms create (experts) too
        stages, sched, groups = transform(TinyLlama(cfg.model_config()), cfg, mesh, log)
    if mesh.device.type != "meta":
        materialize(stages, cfg, dist.get_rank(), mesh.device)
    if cfg.compile:
        compile_blocks(stages)
    return stages, sched, groups


LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY = 0.2   # wsd (warmup-stable-decay): the last 20% of the steps after warmup decay

MODEL_PRESETS = {  # model shapes; the first three train on a CPU (0.1 to a few million parameters)
    "tiny": dict(hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64),
    "small": dict(hidden=64, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=192),
    "base": dict(hidden=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=768),
    # for a GPU: 145 M parameters, SDPA attention (the flash kernel under bf16)
    "150m": dict(hidden=1024, n_layers=12, n_heads=16, n_kv_heads=4, ffn_hidden=3072,
                 attn_impl="sdpa"),
    # Published models' shapes, for the dry run (`--dry-run`, lesson 11) and GPU clusters. They
    # take fused attention (`sdpa`): nobody trains at 8k tokens with s×s score matrices saved.
    "llama3-8b": dict(vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_hidden=14336, rope_theta=500000.0, attn_impl="sdpa"),
    "llama3-70b": dict(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_hidden=28672, rope_theta=500000.0, attn_impl="sdpa"),
    "llama3-405b": dict(vocab_size=128256, hidden=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_hidden=53248, rope_theta=500000.0, attn_impl="sdpa"),
    # DeepSeek-V3's sizes on picolib's blocks (GQA instead of MLA; every layer a mixture of
    # --experts of this ffn size; no shared expert): use with --experts 256 --top-k 8
    "deepseek-v3-like": dict(vocab_size=129280, hidden=7168, n_layers=61, n_heads=128,
                             n_kv_heads=128, ffn_hidden=2048, attn_impl="sdpa"),
}


@dataclass(frozen=True)
class TrainConfig(Layout):
    """One training run: its layout (`picolib.parallel_layout.Layout`: degrees, schedule,
    chunks, micro-batches, ZeRO stage, sequence length, recomputation, precision, experts,
    context-parallel algorithm) and the run's options; every field but `model` (which a plan
    sets: `from_plan`) is a command-line option (`--help`)."""
    batch: int = 8                # global batch (sequences per step)
    steps: int = 10
    preset: str | None = "tiny"
    model: LlamaConfig | None = None   # a shape no preset has (a plan's), instead of `preset`
    data: str = "text"            # "text": the shipped paragraph (all of it trained on);
    #  "course": the shipped corpus; a path: a UTF-8 text file or a token file (.bin); "random"
    eval_every: int = 0           # > 0: the held-out loss every this many steps (and at the end)
    eval_batches: int = 4         # batches (of --batch × --seq tokens) each evaluation reads
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
    compile: bool = False         # torch.compile each transformer block (not with tp, cp, experts, ZeRO-3)
    progress: bool = True

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one replica: batch / (dp · micro_batches)."""
        return self.batch // (self.dp * self.micro_batches)

    def __post_init__(self):
        if isinstance(self.model, dict):          # read back from JSON or `asdict`
            object.__setattr__(self, "model", LlamaConfig(**self.model))

    def model_config(self) -> LlamaConfig:
        """The model this run trains: `model` if given, else the `preset`'s shape."""
        run = dict(max_seq=max(self.seq, 16), seed=self.seed, recompute=self.recompute)
        if self.model is not None:
            return self.model.replace(**run)
        return LlamaConfig(**MODEL_PRESETS[self.preset], **run)

    @classmethod
    def from_plan(cls, plan, **options) -> "TrainConfig":
        """The run of a planner's `Plan` (picolib.planner; each `plan_search.search` result's
        "plan"): the plan's layout as it is (`layout_of(plan.par)`: the same fields, no
        renaming), its model as the preset of that shape (`MODEL_PRESETS`: the preset's
        attention kernel and RoPE base with it) or, for a shape no preset has, as `model`, the
        global `batch` of dp × micro_batches × micro_batch_size sequences.
        `options`: the rest of the run (steps, lr, data, ...); one that contradicts the plan
        is refused, as are experts the trainer's MoE cannot build (shared ones, or another
        size than the model's MLP); `check_config` then judges the layout as for any run. The
        planner's own assumptions (`activations`, `flash`, `fp32_grad_accum`) change what it
        counts, not what runs."""
        shape = ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
        want = {k: getattr(plan.model, k) for k in shape}
        preset = next((n for n, kw in MODEL_PRESETS.items()
                       if {k: getattr(LlamaConfig(**kw), k) for k in shape} == want), None)
        moe = plan.moe
        if moe is not None and moe.shared:
            raise ValueError(f"the plan's MoE has {moe.shared} shared experts; the trainer's have none")
        if moe is not None and moe.expert_ffn != plan.model.ffn_hidden:
            raise ValueError(f"the plan's experts have expert_ffn={moe.expert_ffn}; the trainer's "
                             f"are the model's MLP, ffn_hidden={plan.model.ffn_hidden}")
        par = plan.par
        run = dict(asdict(layout_of(par)), preset=preset, model=None if preset else plan.model,
                   batch=par.dp * par.micro_batches * par.micro_batch_size)
        for k, v in options.items():
            if k in run and v != run[k]:
                raise ValueError(f"--{k.replace('_', '-')} {v} contradicts the plan ({k}={run[k]!r})")
        return cls(**{**options, **run})


def check_config(cfg: TrainConfig, world_size: int | None = None, read_data: bool = True) -> None:
    """Refuse a configuration before any process starts, naming the numbers: the layout by
    the rules every user of one shares (`check_layout`, none of the planner's switches), then
    the run's own options. `read_data`: also read the data file through once (UTF-8; the
    ranks, checked again, skip that)."""
    if cfg.model is not None and cfg.preset is not None:
        raise ValueError(f"give a preset ({cfg.preset!r}) or a model, not both")
    if cfg.model is None and cfg.preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; choose one of {sorted(MODEL_PRESETS)}")
    check_layout(cfg, cfg.model_config(), cfg.world_size if world_size is None else world_size)
    for name in ("batch", "steps"):
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
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every must be ≥ 0 (0: no evaluation), not {cfg.eval_every}")
    if cfg.eval_batches < 1:
        raise ValueError(f"--eval-batches must be at least 1, not {cfg.eval_batches}")
    per_replica = cfg.dp * cfg.micro_batches
    if cfg.batch % per_replica:
        raise ValueError(f"the batch of {cfg.batch} sequences must divide into dp={cfg.dp} "
                         f"replicas × {cfg.micro_batches} micro-batches")
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
    if cfg.compile:
        check_compile(cfg)
    open_data(cfg, check=read_data)


def check_compile(cfg: TrainConfig) -> None:
    """--compile compiles each block, which on these layouts holds collectives, hooks that swap
    its parameters, or routing whose shapes depend on the data: refused there, naming why."""
    why = {"--tp": (cfg.tp > 1, "tensor parallelism calls collectives inside each block"),
           "--cp": (cfg.cp > 1, "context parallelism exchanges K/V inside each block's attention"),
           "--experts": (cfg.experts > 0, "routing sends data-dependent numbers of tokens to each expert"),
           "--zero 3": (cfg.zero == 3, "ZeRO-3 gathers and frees each block's parameters around it")}
    for flag, (used, reason) in why.items():
        if used:
            raise ValueError(f"--compile does not work with {flag}: {reason}; drop --compile or {flag}")


def compile_blocks(stages: dict) -> None:
    """torch.compile every transformer block of this rank's stages in place (`Module.compile`:
    the parameters, their names and the hooks the wrappers put on them stay the same)."""
    for stage in stages.values():
        for module in stage.modules():
            if isinstance(module, Block):
                module.compile()


def open_data(cfg: TrainConfig, check: bool = True):
    """(training data, held-out data) of `cfg.data`, as `picolib.data.TokenData` (None for
    random tokens; no held-out data for "text", which trains on all of the paragraph);
    a ValueError naming the problem for a file that cannot serve. `check`: read the whole
    file once to check it (UTF-8, vocabulary)."""
    from .data import TokenData
    if cfg.data == "random" or cfg.data == "text":
        train = None if cfg.data == "random" else TokenData("text", "all", check=check)
        if cfg.eval_every:
            raise ValueError(f"--eval-every needs held-out text, and --data {cfg.data} has none "
                             + ("(random tokens)" if train is None else
                                "(the 2.5 KB paragraph is all trained on)")
                             + ": give --data course (the shipped corpus) or --data PATH; their "
                               "last 10% is held out")
        return train, None
    try:
        train = TokenData(cfg.data, "train", check=check)
        val = TokenData(cfg.data, "val", check=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"--data {cfg.data}: {e}") from None
    vocab = cfg.model_config().vocab_size
    if train.vocab_size > vocab:
        raise ValueError(f"--data {cfg.data}: its token ids reach {train.vocab_size - 1}, beyond "
                         f"the model's vocabulary of {vocab}")
    if len(train) < cfg.seq + 2:
        raise ValueError(f"--data {cfg.data}: its training split has {len(train)} tokens, too "
                         f"few for --seq {cfg.seq}")
    if cfg.eval_every and val.max_val_batches(cfg.batch, cfg.seq) < cfg.eval_batches:
        raise ValueError(f"--data {cfg.data}: its held-out split ({len(val):,} tokens) holds "
                         f"{val.max_val_batches(cfg.batch, cfg.seq)} batches of {cfg.batch}×"
                         f"{cfg.seq} tokens, fewer than --eval-batches {cfg.eval_batches}")
    return train, val


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


