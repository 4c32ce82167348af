"""The 5-D trainer (lesson 10): one command trains the tiny Llama on any combination of data
(DDP or ZeRO-1/2/3), tensor (+ sequence), pipeline, context and expert parallelism.

    python -m picolib.train --nproc 8 --dp 2 --pp 2 --tp 2 --sp --zero 1 --micro-batches 4
    torchrun --nproc-per-node 8 -m picolib.train --dp 2 --pp 2 --tp 2 ...     # a real cluster

Every configuration on the same `--seed` sees the same global batches from the same weights,
so its loss curve lies on the single-process one (`--nproc 1`, every degree 1): that is
how lesson 10 checks a configuration. The transforms run in the documented order
(docs/design.md): tensor (+ sequence) parallel, context parallel, pipeline stages, then DDP
or ZeRO over the ranks that hold the same weights (dp × cp).

Data (`--data`): the shipped paragraph (text, the default), the shipped corpus (course), random
tokens, or any UTF-8 text file or prepared token file (picolib.data); each rank reads only its
own rows (dp) and positions (cp) of a step's batch, and global batch number k is the same on
every layout. For course and files the last 10% is held out: `--eval-every N` logs `val_loss`,
the mean loss over every token of `--eval-batches K` held-out batches, computed forward-only on
every layout (the pipeline's last stage; summed over dp and cp by tokens).

Each step logs the global mean loss, the learning rate, tokens/s, MFU and HFU against a stated
peak (model FLOPs by picolib.plan_search.model_flops_per_token: 6 × active parameters without
the input embedding, plus causal attention), the memory of the busiest rank and the bytes it sent by collective and by kind (DP, TP,
PP, CP, EP);
`--log FILE` writes them as one JSON object per line, `--trace FILE` a Perfetto/Chrome trace
of the last step.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from . import checkpoint
from .cli import build_parser, config_from_args
from .clipping import clip_grad_norm_
from .comm import Ledger
from . import comm
from .compose import MODEL_PRESETS, TrainConfig, build, check_config, lr_factor, open_data
from .context_parallel import positions
from .data import global_mean_loss
from .memory import SavedActivations
from .mesh import Mesh
from .model import param_count, random_tokens
from .plan_search import model_flops_per_token
from .planner import MoEShape
from .rank import device
from .step import forward_backward, sent_by_kind
from .timeline import Timeline, gather, to_chrome_trace

__all__ = ["MODEL_PRESETS", "TrainConfig", "check_config", "config_from_args", "train", "main"]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")
KINDS = ("DP", "TP", "PP", "CP", "EP", "other")


# --------------------------------------------------------------------------- a step

def _columns(cfg: TrainConfig, mesh: Mesh):
    """The positions of each sequence this rank holds: all, or its context-parallel chunks."""
    return positions(cfg.cp_layout, mesh.coordinate("cp"), cfg.cp, cfg.seq) if cfg.cp > 1 else None


def _batch(cfg: TrainConfig, data, step: int, mesh: Mesh):
    """This rank's micro-batches of global batch number `step` of the data: it reads only its
    dp share's windows, and of them only its cp positions (picolib.data.TokenData)."""
    if data is None:
        tokens, targets = random_tokens(cfg.batch, cfg.seq, cfg.model_config().vocab_size,
                                        seed=cfg.seed * 100_003 + step)
        tokens, targets = (t.chunk(cfg.dp)[mesh.coordinate("dp")] for t in (tokens, targets))
        if cfg.cp > 1:
            tokens, targets = (t[:, _columns(cfg, mesh)] for t in (tokens, targets))
    else:
        tokens, targets = data.batch_for_rank(step, cfg.batch, cfg.seq, cfg.seed,
                                              mesh.coordinate("dp"), cfg.dp, _columns(cfg, mesh))
    # each micro-batch its own tensor (a copy), as on a GPU: a view would keep the rank's whole
    # batch alive in every micro-batch's saved tensors (and in their measured bytes)
    return [[m.to(mesh.device, copy=True) for m in t.chunk(cfg.micro_batches)] for t in (tokens, targets)]


# --------------------------------------------------------------------------- validation

@torch.no_grad()
def _evaluate(cfg, stages, sched, mesh, batches) -> float:
    """The mean loss over every token of the held-out `batches` (this rank's rows and
    positions of each): forward only, through the pipeline's stages in order; the last
    stage's ranks of tp coordinate 0 (tp ranks hold the same loss) add loss × tokens and
    tokens, which one sum over all ranks turns into the mean over tokens — the dp and cp
    ranks weighed by the tokens they held, not counted as ranks. The same on every rank."""
    loss_sum, count = 0.0, 0
    for tokens, targets in batches:
        with torch.autocast(mesh.device_mesh.device_type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            loss = _forward_loss(cfg, stages, sched, mesh, tokens, targets)
        if loss is not None and (cfg.tp == 1 or mesh.coordinate("tp") == 0):
            loss_sum += float(loss) * targets.numel()
            count += targets.numel()
    return global_mean_loss(loss_sum, count)


def _forward_loss(cfg, stages, sched, mesh, tokens, targets):
    """The loss of one batch, forward only (None off the last stage). With a pipeline each
    rank runs its stages in stage order, receiving each one's input from the previous
    stage's rank and sending its output on: a chain, so blocking sends cannot deadlock."""
    if sched is None:
        return stages[0].loss(tokens, targets)
    peers, x = mesh.peers("pp"), None
    me = mesh.coordinate("pp")
    for s in range(sched.n_stages):
        if s not in stages:
            x = None
            continue
        stage = stages[s]
        if sched.is_first(s):
            x = tokens
        elif x is None:                                    # the previous stage is elsewhere
            like = next(stage.parameters())
            x = torch.empty(stage.hidden_shape(*tokens.shape), dtype=like.dtype, device=like.device)
            comm.recv(x, peers[sched.stage_ranks[s - 1]])
        y = stage(x)
        if sched.is_last(s):
            return stage.loss_fn(y, targets)
        nxt = sched.stage_ranks[s + 1]
        if nxt != me:
            comm.send(y.to(next(stage.parameters()).dtype).contiguous(), peers[nxt])
            x = None
        else:
            x = y
    return None


def _train_step(cfg, stages, wrappers, optimizers, sched, mesh, tokens, targets, timeline):
    """One optimizer step: forward and backward, the gradients reduced and clipped, the
    update. Returns this rank's loss (None off the last stage) and the global gradient norm,
    both device tensors: nothing here waits for the device (a host sync) except the
    data-parallel wrappers' verdict on a NaN or inf gradient (`finish_gradient_sync`); the
    loop reads the logged values once, after the step."""
    loss = forward_backward(cfg, stages, wrappers, sched, mesh, tokens, targets, timeline)
    for w in wrappers.values():      # reduced gradients, then the global norm
        w.finish_gradient_sync()
    grad_norm = clip_grad_norm_(cfg, wrappers, max_norm=cfg.clip_grad)
    for opt in optimizers:
        opt.step()
    return loss, grad_norm


def _moe_shape(cfg: TrainConfig) -> MoEShape | None:
    """The trainer's experts as the planner describes them (each of the preset MLP's size)."""
    return MoEShape(cfg.experts, cfg.top_k, cfg.model_config().ffn_hidden) if cfg.experts else None


def _state_bytes(wrappers) -> int:
    """Parameters, gradients and optimizer state this rank holds: the wrappers' `memory()`
    (DDP or ZeRO alike, the data-parallel contract)."""
    return sum(sum(w.memory().values()) for w in wrappers.values())


def _peak_flops(cfg: TrainConfig, device: torch.device) -> tuple[float, str]:
    """The peak MFU is measured against: given, an H100's dense BF16 on a GPU, or this core's
    measured fp32 matmul rate on a CPU."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12, f"{cfg.peak_tflops:g} TFLOP/s (given)"
    if device.type == "cuda":
        return 989e12, "989 TFLOP/s (H100 SXM dense BF16)"
    a = torch.randn(256, 256)
    a @ a
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.1:
        a @ a
        n += 1
    rate = _max_over_ranks([2 * 256 ** 3 * n / (time.perf_counter() - t0)])[0]  # one peak for all
    return rate, f"{rate / 1e9:.1f} GFLOP/s per rank (fp32 matmul, one thread, the fastest rank)"


def _not_finite(step: int, what: str, cfg: TrainConfig) -> FloatingPointError:
    """What the trainer says when a step's gradient or loss is NaN or inf: it stops (every
    rank reaches the same verdict), and what the user can change."""
    return FloatingPointError(
        f"step {step} (numbered as in the log): {what}. The trainer stops here; this step's "
        f"update was not applied. Try a lower --lr (this run: {cfg.lr:g})"
        + (" or --precision fp32" if cfg.precision != "fp32" else "")
        + ", check the data (--data), and keep checkpoints (--save-every N) to --resume from "
          "before the step that diverged.")


def _gradient_detail(e: FloatingPointError) -> str:
    """The wrappers' own account (which collective, whose gradient) without their advice,
    which is for a loop the user writes."""
    m = re.match(r"step \d+: (.*?)(?:\. Nothing was updated.*)?$", str(e), re.S)
    return m[1] if m else str(e)


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# --------------------------------------------------------------------------- the loop

def train(cfg: TrainConfig, progress_to: str | None = None) -> list[dict]:
    """Train on this rank (inside `launch.run` or under torchrun); returns one record per step
    (the same on every rank): step, loss (global mean), seconds, tokens/s, MFU, HFU, the
    busiest rank's state and activation bytes, bytes sent per collective and per kind of
    parallelism (DP, TP, PP, CP, EP; each the busiest rank's), and grad_norm: the global L2
    norm of the gradient before clipping (`cfg.clip_grad`, picolib.clipping).

    With `cfg.progress`, rank 0 draws a progress bar and prints a summary; given
    `progress_to` (a file), it appends each step's record and the summary there as JSON lines
    instead, for the process that owns the terminal to draw (`main` does)."""
    check_config(cfg, dist.get_world_size(), read_data=False)   # main read the file through
    mesh = Mesh(device().type, device=device(),     # the rank's device, from here on the mesh's
                **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    stages, wrappers, optimizers, sched, _ = build(cfg, mesh)
    start, data_at = _resume(cfg, stages, wrappers, optimizers)
    # the learning rate of each step, on every wrapper's torch optimizer (all its groups)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda s: lr_factor(cfg, s + start))
                  for w in wrappers.values()]
    data, held_out = open_data(cfg, check=False)
    val = _val_batches(cfg, held_out, mesh) if cfg.eval_every else None
    peak, peak_text = _peak_flops(cfg, mesh.device)
    tokens_per_step = cfg.batch * cfg.seq
    model_flops, hardware_flops = _step_flops(cfg)
    rank0 = dist.get_rank() == 0
    bar, report, log = _outputs(cfg, start, progress_to) if rank0 else (None, None, None)
    records, kinds = [], {}
    try:
        for step in range(start, cfg.steps):
            tokens, targets = _batch(cfg, data, data_at + step, mesh)
            tl = Timeline() if cfg.trace and step == cfg.steps - 1 else None
            dist.barrier()
            t0 = time.perf_counter()
            with Ledger() as led, SavedActivations() as act:
                try:
                    loss, grad_norm = _train_step(cfg, stages, wrappers, optimizers, sched, mesh,
                                                  tokens, targets, tl)
                except FloatingPointError as e:      # raised on every rank alike
                    raise _not_finite(step, _gradient_detail(e), cfg) from None
                if mesh.device.type == "cuda":       # the step's time: until the device is done
                    torch.cuda.synchronize(mesh.device)
            seconds = time.perf_counter() - t0
            state = _state_bytes(wrappers)
            lr = schedulers[0].get_last_lr()[0]      # the rate this step used
            for opt in optimizers:
                opt.zero_grad()
            for s in schedulers:
                s.step()
            rec = _record(cfg, mesh, step, loss, grad_norm, lr, [seconds, state, act.peak], led, kinds,
                          tokens_per_step, model_flops, hardware_flops, peak)
            if val is not None and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
                rec["val_loss"] = _evaluate(cfg, stages, sched, mesh, val)   # after this update
            records.append(rec)
            for out in (log, report):
                if out:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
            if bar:
                bar.set_postfix(_postfix(rec))
                bar.update()
            if cfg.save and (step == cfg.steps - 1 or cfg.save_every and (step + 1) % cfg.save_every == 0):
                checkpoint.save(cfg.save, cfg, stages, wrappers, optimizers, step + 1, keep=cfg.keep,
                                data_position=data_at + step + 1)
            if tl is not None:
                _write_trace(tl, cfg.trace, rank0)
    finally:
        if bar:
            bar.close()
        if log:
            log.close()
        if report and not records:
            report.close()
    if rank0 and cfg.progress and records:
        summary = _summary(cfg, records[-1], peak_text)
        if report:
            report.write(json.dumps({"summary": summary}) + "\n")
            report.close()
        else:
            print(summary, flush=True)
    return records


def _resume(cfg: TrainConfig, stages, wrappers, optimizers) -> tuple[int, int]:
    """(the first step to run, where the data stands: step `step` reads global batch
    `data_at + step`), after loading `cfg.resume`'s latest checkpoint if given."""
    resumed = {"data_position": 0}
    start = checkpoint.load_into(checkpoint.latest(cfg.resume), cfg, stages, wrappers,
                                 optimizers, into=resumed) if cfg.resume else 0
    if cfg.save and dist.get_rank() == 0 and os.path.isdir(cfg.save):
        checkpoint.tidy(cfg.save)     # what a killed run's last save left behind
    return start, resumed["data_position"] - start


def _val_batches(cfg: TrainConfig, held_out, mesh) -> list:
    """This rank's rows and positions of the held-out batches, read once."""
    return [tuple(t.to(mesh.device) for t in b) for b in held_out.val_batches(
        cfg.eval_batches, cfg.batch, cfg.seq, mesh.coordinate("dp"), cfg.dp, _columns(cfg, mesh))]


def _step_flops(cfg: TrainConfig) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step: full recomputation runs each forward (a third
    of the model FLOPs) twice."""
    model_flops = model_flops_per_token(cfg.model_config(), cfg.seq, _moe_shape(cfg)) * cfg.batch * cfg.seq
    return model_flops, model_flops * (4 / 3 if cfg.recompute == "full" else 1)


def _write_trace(tl, path: str, rank0: bool) -> None:
    """Every rank's spans of the traced step, gathered; rank 0 writes them as a Chrome trace."""
    events = gather(tl)
    if rank0:
        to_chrome_trace(events, path)


def _summary(cfg: TrainConfig, last: dict, peak_text: str) -> str:
    """The line rank 0 prints after the run."""
    return (f"{param_count(cfg.model_config()):,} parameters; peak {peak_text}; last step: "
            f"loss {last['loss']:.4f}, " + (f"val_loss {last['val_loss']:.4f}, " if "val_loss" in last else "")
            + f"{last['tokens_per_s']:,.0f} tokens/s, MFU {last['mfu']:.3f}, HFU {last['hfu']:.3f}")


def _outputs(cfg: TrainConfig, start: int, progress_to: str | None):
    """Rank 0's (progress bar, progress file, log file), each None where not asked for."""
    bar = report = None
    if cfg.progress and progress_to:
        report = open(progress_to, "a")
        report.write(json.dumps({"start": start}) + "\n")
        report.flush()
    elif cfg.progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=start, desc=_describe(cfg), file=sys.stdout)
    return bar, report, open(cfg.log, "w") if cfg.log else None


def _record(cfg, mesh, step, loss, grad_norm, lr, measured, led, kinds, tokens_per_step,
            model_flops, hardware_flops, peak) -> dict:
    """One step's record, the same on every rank: the global mean loss (ranks without a loss,
    pipeline stages before the last, add nothing), and of `measured` (seconds, state bytes,
    activation bytes) and the bytes sent, the busiest rank's."""
    total = torch.zeros(2, dtype=torch.float64, device=mesh.device)
    if loss is not None:
        total = torch.stack([loss.double(), torch.ones_like(total[0])])
    dist.all_reduce(total)
    # the logged values, read once: the loss summed over ranks, its count, the norm
    loss_sum, count, grad_norm = torch.cat([total, grad_norm.view(1).double()]).tolist()
    if not math.isfinite(loss_sum):          # the same sum on every rank
        raise _not_finite(step, f"the loss is {loss_sum}", cfg)
    sent = {op: s["sent_bytes"] for op, s in led.summary().items()}
    by_kind = sent_by_kind(led, mesh, kinds)
    busiest = _max_over_ranks(measured + [sent.get(op, 0) for op in OPS] + [by_kind.get(k, 0) for k in KINDS])
    return {"step": step, "loss": loss_sum / count, "lr": lr, "grad_norm": grad_norm,
            "seconds": busiest[0],
            "tokens_per_s": tokens_per_step / busiest[0],
            "mfu": model_flops / (busiest[0] * cfg.world_size * peak),
            "hfu": hardware_flops / (busiest[0] * cfg.world_size * peak),
            "state_bytes": int(busiest[1]), "activation_bytes": int(busiest[2]),
            "sent_bytes": {op: int(b) for op, b in zip(OPS, busiest[3:3 + len(OPS)]) if b},
            "sent_bytes_by_kind": {k: int(b) for k, b in zip(KINDS, busiest[3 + len(OPS):]) if b}}


def _postfix(rec: dict) -> dict:
    out = {"loss": f"{rec['loss']:.4f}", "tok_s": f"{rec['tokens_per_s']:.0f}"}
    if "val_loss" in rec:
        out["val_loss"] = f"{rec['val_loss']:.4f}"
    return out


def _describe(cfg: TrainConfig) -> str:
    dims = [f"{d}{getattr(cfg, d)}" for d in ("dp", "pp", "cp", "tp") if getattr(cfg, d) > 1]
    extra = (["sp"] if cfg.sp else []) + ([f"zero{cfg.zero}"] if cfg.zero else []) + \
        ([f"{cfg.experts} experts top-{cfg.top_k} ep{cfg.ep}"] if cfg.experts else [])
    return "×".join(dims or ["1 rank"]) + (" " + " ".join(extra) if extra else "")


# --------------------------------------------------------------------------- command line

def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:           # the same build on meta tensors over a fake group
        from .dry_run import main as dry_run_main
        return dry_run_main([a for a in argv if a != "--dry-run"])
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    nproc, backend = args.pop("nproc"), args.pop("backend")
    if args.pop("dry_run"):           # an abbreviation of --dry-run (the full form is handed over above)
        parser.error("write --dry-run in full")
    if nproc is not None and nproc < 1:
        parser.error(f"--nproc must be at least 1, not {nproc}")
    cfg = config_from_args(parser, argv, args)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    nproc = int(os.environ["WORLD_SIZE"]) if under_torchrun else cfg.world_size if nproc is None else nproc
    try:
        check_config(cfg, nproc)
    except (ValueError, TypeError) as e:   # bad input: one line and exit 2, as argparse does
        parser.error(str(e))
    if not under_torchrun:
        _check_fits_this_machine(parser, cfg, backend, nproc)
    if under_torchrun:
        from .launch import init_from_env
        init_from_env(backend)
        return train(cfg)
    from . import train as this   # by reference, so the ranks import it
    from .launch import run
    timeout = max(120.0, 10.0 * cfg.steps)
    if not cfg.progress:
        return run(this.train, nproc, cfg, backend=backend, timeout=timeout)[0]
    with tempfile.TemporaryDirectory(prefix="picolib-train-") as folder, \
            _ProgressBar(os.path.join(folder, "progress.jsonl"), cfg) as bar:
        return run(this.train, nproc, cfg, backend=backend, timeout=timeout,
                   progress_to=bar.path)[0]


def _check_fits_this_machine(parser, cfg: TrainConfig, backend: str, nproc: int) -> None:
    """Ranks on the CPU share this machine's memory, and a step holds at least 16 bytes a
    parameter in all (fp32 weights and gradients, Adam's two moments: lesson 01), however the
    layout shards them. A preset beyond that (llama3-70b on a laptop) is refused before any
    rank allocates; the dry run counts its bytes without allocating them."""
    from .launch import resolve_backend
    from .model import param_count
    try:
        on_cpu = resolve_backend(backend, nproc) == "gloo"
    except ValueError:
        return                        # the launcher names what is wrong with the backend
    available = _available_bytes()
    need = 16 * param_count(cfg.model_config())
    if on_cpu and available is not None and need > available:
        model = f"the {cfg.preset} preset's" if cfg.model is None else "the plan's model's"
        parser.error(f"{model} training state is {need / 2**30:,.0f} GiB (16 bytes "
                     f"a parameter), more than the {available / 2**30:,.0f} GiB this machine has "
                     f"available; count its bytes without allocating them: add --dry-run")


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


class _ProgressBar:
    """The bar drawn by the process that owns the terminal (or the notebook: a widget), from
    the step records rank 0 appends to `path`; a thread reads them as they come, so the bar
    updates in place instead of arriving as one `[rank 0]` line per update."""

    def __init__(self, path: str, cfg: TrainConfig, every: float = 0.1):
        self.path, self.cfg, self.every = path, cfg, every
        self.bar, self.summary, self._done, self._offset = None, None, threading.Event(), 0
        open(path, "w").close()

    def __enter__(self):
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind, *_):
        self._done.set()
        self._thread.join()
        self._read()                      # what came after the thread's last look
        if self.bar is not None:
            self.bar.close()
        if kind is None and self.summary:
            print(self.summary, flush=True)

    def _follow(self):
        while not self._done.wait(self.every):
            self._read()

    def _read(self):
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            text = f.read()
        lines = text.split(b"\n")[:-1]             # whole lines only
        self._offset += sum(len(line) + 1 for line in lines)
        for line in lines:
            rec = json.loads(line)
            if "start" in rec:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=self.cfg.steps, initial=rec["start"],
                                desc=_describe(self.cfg), file=sys.stdout)
            elif "summary" in rec:
                self.summary = rec["summary"]
            elif self.bar is not None:
                self.bar.set_postfix(_postfix(rec))
                self.bar.update()


if __name__ == "__main__":
    main()
