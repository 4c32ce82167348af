"""The trainer's command line (lesson 10): one option per `TrainConfig` field (but `model`, a
shape no preset has, which only `--plan` sets), parsed into the run it asks for.
`python -m picolib.train` reads it, and the dry run (`picolib.dry_run`) adds its own three
options to it; a module below both, so that neither imports the other's command line.
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from .compose import LR_SCHEDULES, MODEL_PRESETS, TrainConfig
from .context_parallel import ALGORITHMS, LAYOUTS
from .parallel_layout import PRECISIONS
from .pipeline_schedules import SCHEDULES
from .planner import Plan

__all__ = ["DESCRIPTION", "HELP", "build_parser", "config_from_args"]

DESCRIPTION = ("Train the tiny Llama on one process or on any mix of data (DDP or ZeRO-1/2/3), "
               "tensor (+ sequence), pipeline, context and expert parallelism; every layout "
               "gives the one-process loss curve.")

HELP = {
    "dp": "data-parallel replicas (each sees batch/dp sequences)",
    "tp": "tensor-parallel ranks (heads, FFN and vocabulary split)",
    "pp": "pipeline stages (the layers split by depth)",
    "cp": "context-parallel ranks (the sequence split; attention by --cp-algorithm)",
    "sp": "sequence parallelism inside tensor parallelism (norms and residuals split too)",
    "zero": "0: DDP; 1, 2, 3: ZeRO stage (optimizer state / + gradients / + parameters sharded)",
    "schedule": "pipeline schedule (dualpipe: two copies of each stage, on pipeline ranks r and p−1−r)",
    "chunks": "model chunks per rank for --schedule interleaved",
    "micro_batches": "micro-batches per step (pipelined, or accumulated without a pipeline)",
    "batch": "global batch in sequences per step", "seq": "tokens per sequence",
    "steps": "optimizer steps", "preset": "model size",
    "recompute": "activation recomputation",
    "precision": "fp32, or bf16: bf16 compute copies of fp32 master weights (DDP and ZeRO), "
                 "gradients reduced in bf16, forward under bf16 autocast",
    "experts": "mixture of experts: this many SwiGLU experts per MLP (0: dense)",
    "top_k": "experts per token", "ep": "expert-parallel ranks (a block of the dp ranks)",
    "cp_algorithm": "context-parallel attention",
    "cp_layout": "who holds which tokens",
    "data": "text: the shipped 2.5 KB paragraph, all trained on; course: the shipped corpus "
            "(picolib/data/course.txt, 0.5 MB); random: uniform tokens; or PATH: a UTF-8 text "
            "file (byte tokens) or a token file NAME.bin (numpy.memmap of uint16, written by "
            "`python -m picolib.data prepare IN.txt OUT.bin`). For course and PATH the last 10%% "
            "is held out (never trained on); each dp rank reads only its own sequences",
    "eval_every": "every this many steps (and after the last) log val_loss: the mean loss over "
                  "all tokens of --eval-batches held-out batches (0: never)",
    "eval_batches": "batches of --batch × --seq held-out tokens each evaluation reads (always "
                    "the first ones of the held-out split)",
    "lr": "AdamW's peak learning rate", "seed": "seed of the weights and the data",
    "warmup": "steps of linear warmup from lr/warmup to lr",
    "lr_schedule": "the learning rate after warmup, from lr to --min-lr at the last step "
                   "(wsd: constant, then linear over the last 20%% of the steps)",
    "min_lr": "the learning rate the schedule ends at (not with constant)",
    "weight_decay": "AdamW's weight decay, on parameters of 2 or more dimensions only (none on "
                    "norm weights and biases)",
    "clip_grad": "clip the gradient's global L2 norm (every element counted once) to this; 0: off",
    "peak_tflops": "peak per rank for MFU (default: H100 dense BF16 on GPUs, measured on CPUs)",
    "log": "write one JSON object per step to this file (under torchrun: --log-file)",
    "trace": "write a Perfetto/Chrome trace of the last step to this file",
    "compile": "torch.compile each transformer block (off by default; not with --tp, --cp, "
               "--experts or --zero 3)",
    "progress": "show a progress bar and a summary (--no-progress: quiet)",
    "save": "write checkpoints (torch.distributed.checkpoint) into this folder, one step-NNNNNN "
            "folder each, at the end",
    "save_every": "also save every this many steps (0: only at the end)",
    "keep": "keep this many newest complete step folders, deleting older ones",
    "resume": "continue from this folder's newest complete step (or from a step folder), on this "
              "or any other mesh",
}


# the enumerated options: argparse refuses anything else and --help lists them
CHOICES = {"schedule": list(SCHEDULES), "recompute": ["none", "selective", "full"],
           "precision": list(PRECISIONS), "cp_algorithm": list(ALGORITHMS),
           "cp_layout": list(LAYOUTS), "preset": list(MODEL_PRESETS),
           "lr_schedule": list(LR_SCHEDULES),
           "zero": [0, 1, 2, 3]}


METAVARS = {"data": "{text,course,random,PATH}"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m picolib.train", description=DESCRIPTION)
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to start (default: the product of the degrees); ignored under torchrun")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="collectives' backend (auto: NCCL with a GPU per rank, else gloo)")
    for f in fields(TrainConfig):
        if f.name == "model":         # a plan's shape: --plan FILE sets it
            continue
        flags = ["--" + f.name.replace("_", "-")]
        if f.name == "log":   # torchrun reads "--log" as an abbreviation of its own --log-dir
            flags.append("--log-file")
        if f.type in ("bool", bool):
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            p.add_argument(*flags, type=kind, default=f.default, help=HELP[f.name],
                           choices=CHOICES.get(f.name), metavar=METAVARS.get(f.name))
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="run this plan (picolib.planner.Plan.to_json, e.g. a plan_search result): "
                        "its model and layout; the options given beside it set the rest and "
                        "must agree with it")
    p.add_argument("--dry-run", action="store_true",
                   help="do not train: build this layout on meta tensors over a fake process "
                        "group of --world ranks and report each pipeline position's bytes "
                        "(held, saved, sent by kind); with --gpu NAME, whether it fits; "
                        "--json FILE writes them (python -m picolib.dry_run --help)")
    return p


def config_from_args(parser: argparse.ArgumentParser, argv, args: dict) -> TrainConfig:
    """The run a command line asks for: its options, or with --plan FILE the plan's model and
    layout (`TrainConfig.from_plan`) plus the options typed beside it. A plan the trainer
    cannot take, or an option that contradicts it: `parser.error` (one line, exit 2)."""
    path = args.pop("plan")
    if path is None:
        return TrainConfig(**args)
    unset = object()          # what argparse leaves alone: the options not on the command line
    typed = vars(parser.parse_args(argv, argparse.Namespace(**{k: unset for k in args})))
    try:
        with open(path) as f:
            plan = Plan.from_json(f.read())
        return TrainConfig.from_plan(plan, **{k: args[k] for k in args if typed.get(k) is not unset})
    except (OSError, ValueError) as e:
        parser.error(f"--plan {path}: {e}")

