"""Lessons 10 and 10b's plumbing. `memory_budget(dp, tp, pp, zero, micro_batches, preset, budget_mib)`
draws each pipeline rank's bytes from the planner's exact mode against a budget (checked against
the trainer's measured bytes in tests/lessons/test_tryit_10.py); `lr_schedule` draws
`picolib.compose.lr_factor`, the trainer's schedule; the rest reads and draws 10/10b's runs.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..compose import TrainConfig, check_config
from ..flat import unique_bytes
from ..model import LlamaConfig, TinyLlama, random_tokens
from ..planner import Parallelism, memory
from ..memory import rank_bars

__all__ = ["memory_budget", "lr_schedule", "zero_under_micro_batches", "plot_loss_curves", "layout_table",
           "plot_bytes_by_kind", "norms_on_ranks", "plot_train_val", "samples", "known_words",
           "held_out_loss", "one_thread", "plain_share"]


def zero_under_micro_batches(variants, ms=(1, 2, 4), n_layers: int = 8, rows: int = 2, seq: int = 32):
    """On each rank of a data-parallel group (call it through `picolib.launch.run`): for each
    (name, stage, reduce_every_micro_batch) of `variants` and each m of `ms`, one ZeRO step of
    m micro-batches of `rows` sequences, as a pipeline stage runs them (the last backward
    syncs). Returns {(name, m): {"peak_grad_bytes", "sent", "weights"}}: the most gradient
    bytes this rank held — the .grads, the reduced shards, and the flat buffers of
    reduce-scatters in flight — sampled after every parameter's gradient lands and after
    every backward (*measured* on the tensors' storages); the bytes sent by collective, from
    the ledger (gloo's calls: counted by the ring formula, not measured); the weights after
    one SGD step at lr 1 (the reduced gradient subtracted).
    """
    from ..zero import ZeRO
    r, out = dist.get_rank(), {}
    for (name, stage, every), m in ((v, m) for v in variants for m in ms):
        model = TinyLlama(LlamaConfig(n_layers=n_layers))
        # SGD at lr 1: the update is the reduced gradient itself, so the two ways of reducing
        # (summed in another order) agree to fp32 rounding, and a wrong scale would show. Adam's
        # first step, lr·g/(|g| + eps), would turn the rounding of a gradient that nearly cancels
        # into a visible share of lr: 2.5e-6 at lr 1e-3 under torch 2.6, more than 1e-6 under 2.11
        # (measured; which elements cancel depends on each release's summation order)
        z = ZeRO(model, stage, optimizer="sgd", lr=1.0, reduce_every_micro_batch=every)
        peak = [0]

        def sample(*_):
            held = [p.grad for p in model.parameters() if p.grad is not None]
            held += [u.grad for u in z.units] + [u.grad_full for u in z.units if u.grad_full is not None]
            held += z.in_flight()
            peak[0] = max(peak[0], unique_bytes(held))

        for p in model.parameters():           # after ZeRO's own hook on the same gradient
            p.register_post_accumulate_grad_hook(sample)
        x, y = random_tokens(rows * m, seq, 256, seed=10 + r)
        with Ledger() as led:
            for i in range(m):
                z.set_requires_gradient_sync(i == m - 1)
                (model.loss(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) / m).backward()
                sample()
            z.step()
        sent = {op: led.total("sent_bytes", op=op) for op in ("reduce_scatter", "all_gather")}
        out[name, m] = dict(peak_grad_bytes=peak[0], sent=sent,
                            weights=torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out


def norms_on_ranks(cfg) -> dict:
    """Lesson 10b §2, on each rank of `cfg`'s mesh (call it through `picolib.launch.run`): one
    forward and backward of this rank's share of the trainer's first batch (no update), the
    gradients reduced by the data-parallel wrappers, then the gradient norm three ways:
    - "local": `torch.nn.utils.clip_grad_norm_` over this rank's parameters (max_norm = inf,
      so it only measures) — what a single-process clipping call sees on this rank;
    - "squares": the sum of squares behind it, and "shared": the part of it in tensors other
      tp ranks hold too (norm weights, KV heads copied over tp), each weighted by
      1 − 1/(tp ranks sharing the box) — what a sum over tp counts too often; read from
      `picolib.param_placement.placements`, not from `picolib.clipping`;
    - "global": `picolib.clipping.clip_grad_norm_(max_norm=0)`, every element counted once.
    Returns {"rank", "coords", "local", "squares", "shared", "global"} (floats)."""
    from ..clipping import clip_grad_norm_
    from ..compose import build, open_data
    from ..mesh import Mesh
    from ..parallel_layout import coordinates
    from ..param_placement import placements
    from ..pipeline_parallel import run_schedule
    from ..rank import device

    rank = dist.get_rank()
    mesh = Mesh(device().type, **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    stages, wrappers, _, sched, _ = build(cfg, mesh)
    rows = open_data(cfg, check=False)[0].batch_for_rank(0, cfg.batch, cfg.seq, cfg.seed,
                                                         mesh.coordinate("dp"), cfg.dp)
    x, y = ([m.to(device()) for m in t.chunk(cfg.micro_batches)] for t in rows)   # step 0's
    if sched is not None:
        run_schedule(sched, stages, x, y, group_ranks=mesh.peers("pp"), data_parallel=wrappers)
    else:
        for i, (a, b) in enumerate(zip(x, y)):
            with wrappers[0].no_sync() if i < len(x) - 1 else contextlib.nullcontext():
                (stages[0].loss(a, b) / len(x)).backward()
    for w in wrappers.values():
        w.finish_gradient_sync()
    place = {(p.stage, p.local): p for p in placements(cfg, rank)}
    params, squares, shared = [], 0.0, 0.0
    for s, module in stages.items():
        for name, p in module.named_parameters():
            if p.grad is None:
                continue
            params.append(p)
            sq = p.grad.double().pow(2).sum().item()
            where = place[s, name]
            sharing = len(where.copies) // len(where.replicas)          # tp ranks with this box
            squares += sq
            shared += sq * (1 - 1 / sharing)
    local = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf")).item()
    norm = clip_grad_norm_(cfg, wrappers, max_norm=0).item()
    return dict(rank=rank, coords=coordinates(cfg, rank), local=local, squares=squares,
                shared=shared, **{"global": norm})


def memory_budget(dp: int = 2, tp: int = 2, pp: int = 2, zero: int = 1, micro_batches: int = 4,
                  preset: str = "small", budget_mib: float = 4.0, cp: int = 1, sp: bool = False,
                  micro_batch_size: int = 1, seq: int = 64, plot: bool = True, ax=None) -> dict:
    """Per pipeline rank {"params", "grads", "optimizer", "activations", "total"} bytes
    (`ranks`) of the trainer's configuration; `busiest`: the pipeline rank with the largest
    total; `state_bytes`: the most parameter + gradient + optimizer bytes on one rank (what
    the trainer logs as state_bytes); `fits`: the busiest total ≤ budget_mib·2²⁰ bytes (memory in binary units, MiB).
    ZeRO-2/3 with m > 1 micro-batches count the whole gradient they accumulate until the
    step's last backward (the trainer logs state_bytes after the step, when it is freed).
    A configuration the trainer refuses raises its ValueError, naming the numbers."""
    MiB = 2 ** 20
    cfg = TrainConfig(dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, zero=zero, micro_batches=micro_batches,
                      batch=dp * micro_batches * micro_batch_size, seq=seq, preset=preset)
    check_config(cfg)
    if budget_mib <= 0:
        raise ValueError(f"budget_mib must be positive, not {budget_mib}")
    par = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, zero=zero, micro_batches=micro_batches,
                      micro_batch_size=micro_batch_size, seq=seq, precision="fp32",
                      activations="picolib", flash=False, schedule=cfg.schedule)
    mcfg = cfg.model_config()
    ranks = [memory(mcfg, par, pp_rank=r) for r in range(pp)]
    busiest = max(range(pp), key=lambda r: ranks[r]["total"])
    peak = ranks[busiest]["total"]
    out = {"config": cfg, "ranks": ranks, "busiest": busiest, "peak": peak,
           "state_bytes": max(r["params"] + r["grads"] + r["optimizer"] for r in ranks),
           "fits": peak <= budget_mib * MiB}
    if plot:
        dims = "×".join(f"{d}{getattr(cfg, d)}" for d in ("dp", "cp", "tp", "pp")
                        if getattr(cfg, d) > 1) or "1 rank"
        rank_bars(ranks, MiB, "MiB", budget_mib, f"budget {budget_mib:g} MiB",
                  f"{preset}: {dims}, {'ZeRO-' + str(zero) if zero else 'DDP'}, m={micro_batches}"
                  f"{', sp' if sp else ''} (computed by the planner)", ax)
    b = ranks[busiest]
    print(f"busiest rank: pipeline rank {busiest} of {pp} — parameters {b['params'] / MiB:.3f} MiB, "
          f"gradients {b['grads'] / MiB:.3f} MiB, optimizer {b['optimizer'] / MiB:.3f} MiB, "
          f"activations {b['activations'] / MiB:.3f} MiB; {peak / MiB:.3f} MiB of {budget_mib:g} MiB: "
          f"{'fits' if out['fits'] else 'does NOT fit'}", flush=True)
    return out


def lr_schedule(schedule: str = "cosine", warmup: int = 20, min_lr: float = 3e-4, steps: int = 200,
                lr: float = 3e-3, plot: bool = True, ax=None) -> dict:
    """The learning rate of each of `steps` steps under `--lr-schedule schedule --warmup warmup
    --min-lr min_lr --lr lr` (`lrs`, a list), as the trainer's scheduler sets it
    (`picolib.compose.lr_factor` × lr), and the first and last step at the peak (`peak`);
    draws it and prints where the rate starts, peaks and ends.
    Settings the trainer refuses raise its ValueError."""
    from ..compose import lr_factor
    cfg = TrainConfig(steps=steps, lr=lr, warmup=warmup, lr_schedule=schedule, min_lr=min_lr)
    check_config(cfg)
    lrs = [lr * lr_factor(cfg, i) for i in range(steps)]
    top = lrs.index(max(lrs))
    held = max(i for i, x in enumerate(lrs) if x == lrs[top])
    if plot:
        import matplotlib.pyplot as plt
        created = ax is None
        if created:
            _, ax = plt.subplots(figsize=(7.6, 3.0))
        ax.plot(range(steps), lrs, color="black", lw=1.5)
        if warmup:
            ax.axvline(warmup - 0.5, color="#EE7733", ls="--", lw=1, label=f"end of warmup ({warmup} steps)")
            ax.legend(fontsize=9, frameon=False, loc="lower center")
        ax.set(xlabel="step", ylabel="learning rate", ylim=(0, lr * 1.08),
               title=f"--lr-schedule {schedule} --warmup {warmup} --min-lr {min_lr:g} (lr {lr:g})")
        ax.title.set_fontsize(10)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.grid(alpha=0.3)
        if created:
            ax.figure.tight_layout()
            plt.show()
    print(f"step 0: {lrs[0]:.2e}; the peak {lrs[top]:.2e} from step {top} to step {held}; "
          f"the last step ({steps - 1}): {lrs[-1]:.2e}", flush=True)
    return {"lrs": lrs, "peak": (top, held)}


# ----------------------------------------------------------- lesson 10's figures and its table

def plot_loss_curves(reference, runs: dict, bound: float = 2e-5):
    """Lesson 10 §2: every layout's loss curve over one process's (left) and |Δloss| per step
    (right) on a symmetric-log axis, where an exact 0 sits at 0 (not at a fake floor), with
    the asserted bound drawn as a line. Shows the figure; returns it."""
    import matplotlib.pyplot as plt

    from ..style import rank_color

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
    ax.plot([r["loss"] for r in reference], "k-", lw=5, alpha=0.25, label="one process")
    worst = 0.0
    for i, (name, recs) in enumerate(runs.items()):
        gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(recs, reference)]
        worst = max(worst, *gaps)
        ax.plot([r["loss"] for r in recs], lw=1.2, color=rank_color(i), label=name)
        dx.plot(gaps, "o-", ms=4, lw=1, color=rank_color(i), label=name)
    dx.axhline(bound, color="black", ls="--", lw=1)
    dx.text(0, bound * 1.3, f"asserted bound {bound:g}", fontsize=9, va="bottom")
    dx.set_yscale("symlog", linthresh=1e-7, linscale=0.5)
    dx.set_ylim(0, bound * 4)
    ax.set(xlabel="step", ylabel="loss", title="eight ranks, five layouts, one curve")
    dx.set(xlabel="step", ylabel="|loss − one process| (0 = exactly equal)",
           title=f"the difference (largest {worst:.1e})")
    dx.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.legend(fontsize=9, loc="upper right", frameon=False)
    plt.show()
    return fig


def layout_table(reference, runs: dict, grid: dict, micro_batches: int) -> dict:
    """Lesson 10 §3: {layout: {"state", "act", "sent", "bubble"}} from the trainer's last
    record of each run (the busiest rank): state and activation bytes (measured by the
    trainer), bytes sent by kind (counted from the calls the ledger recorded, the ring
    formula applied to each), and the pipeline bubble, simulated with unit costs and checked
    against (p − 1)/(v·m)."""
    from ..pipeline_schedules import bubble_formula, make_schedule
    from ..pipeline_simulator import simulate
    from ..timeline import bubble_ratio

    def bubble(opts):
        p, m = opts.get("pp", 1), micro_batches
        if p == 1:
            return 0.0
        v = 2 if opts.get("schedule") == "interleaved" else 1
        simulated = bubble_ratio(simulate(make_schedule(opts.get("schedule", "1f1b"), p, m, v),
                                          {"F": 1, "B": 2, "W": 0}))
        if abs(simulated - bubble_formula(p, m, v)) > 1e-9:
            raise AssertionError(f"{opts}: simulated bubble {simulated} ≠ (p−1)/(v·m)")
        return simulated

    table = {}
    for name, recs in [("one process", reference)] + list(runs.items()):
        last = recs[-1]
        table[name] = dict(state=last["state_bytes"], act=last["activation_bytes"],
                           sent=dict(last["sent_bytes_by_kind"]), bubble=bubble(grid.get(name, {})))
    return table


def plot_bytes_by_kind(table: dict, kinds=("DP", "TP", "PP", "CP", "EP")):
    """Lesson 10 §3: per layout, the busiest rank's bytes sent per step, stacked by kind of
    parallelism (colours of `picolib.style.PARALLELISM`), beside the memory it holds, both in
    MiB. Shows the figure; returns it."""
    import matplotlib.pyplot as plt

    from ..style import MEMORY, PARALLELISM

    names = list(table)
    MiB = 2 ** 20
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(13, 4.4), layout="constrained",
                                 gridspec_kw={"width_ratios": [3, 2]})
    y = range(len(names))
    left = [0.0] * len(names)
    for k in kinds:
        w = [table[n]["sent"].get(k, 0) / MiB for n in names]
        if any(w):
            ax.barh(y, w, left=left, color=PARALLELISM[k], label=k, edgecolor="white")
            left = [a + b for a, b in zip(left, w)]
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:.2f}", va="center", fontsize=9)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.18)
    ax.set(xlabel="bytes sent per step by the busiest rank (MiB) — counted from the calls made",
           title="traffic by kind of parallelism")
    ax.legend(fontsize=9, loc="lower right", frameon=False)
    state = [table[n]["state"] / MiB for n in names]
    act = [table[n]["act"] / MiB for n in names]
    mx.barh(y, state, color=MEMORY["params"], label="state (params + grads + AdamW)")
    mx.barh(y, act, left=state, color=MEMORY["activations"], label="activations (peak)")
    mx.set_yticks(list(y), [""] * len(names))
    mx.invert_yaxis()
    mx.set_xlim(0, max(a + b for a, b in zip(state, act)) * 1.05)
    mx.set(xlabel="memory held by the busiest rank (MiB) — measured", title="what each rank holds")
    mx.legend(fontsize=9, loc="lower right", frameon=False)
    plt.show()
    return fig



# ----------------------------------------------------------- lesson 10b §3: a longer run

def plot_train_val(records: list[dict], title: str):
    """Lesson 10b §3: the training loss of every step and the held-out loss where it was
    evaluated (top), the learning rate each step used (bottom), against the step. Shows the
    figure; returns it."""
    import matplotlib.pyplot as plt

    from ..style import rank_color

    steps = [r["step"] for r in records]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, (ax, lx) = plt.subplots(2, 1, figsize=(9, 5.6), sharex=True, layout="constrained",
                                 gridspec_kw={"height_ratios": [3, 1.3]})
    ax.plot(steps, [r["loss"] for r in records], lw=1, color=rank_color(0), alpha=0.8,
            label="training loss (this step's batch)")
    ax.plot(*zip(*val), "o-", ms=5, lw=1.5, color="#EE7733",
            label="validation loss (held-out text, every token)")
    ax.set(ylabel="loss (nats per byte)", title=title)
    ax.legend(fontsize=9, frameon=False)
    ax.grid(alpha=0.3)
    lx.plot(steps, [r["lr"] for r in records], color="black", lw=1.5)
    lx.set(xlabel="step", ylabel="learning rate", title="the rate each step used: warmup, then cosine")
    lx.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    lx.grid(alpha=0.3)
    plt.show()
    return fig


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside (restored after): one token's forward of these models is too
    small for a second thread to help, and on a loaded machine a second one costs many times
    the work (measured: 64 ms a token on two threads against 4 ms on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def samples(model, prompts: list[str], tokens: int = 60, temperature: float = 0.8,
            top_k: int = 20, seed: int = 0) -> list[str]:
    """Lesson 10b §3: each prompt continued by `tokens` bytes sampled from `model`
    (`picolib.generate.generate`, K/V cache), as text (undecodable bytes show as �)."""
    from ..generate import generate

    out = []
    with one_thread():
        for i, p in enumerate(prompts):
            ids = generate(model, list(p.encode()), tokens, temperature, top_k, seed=seed + i)
            out.append(bytes(ids).decode("utf-8", errors="replace"))
    return out


@torch.no_grad()
def held_out_loss(model, cfg) -> float:
    """The mean loss per token of `model` (one process) over the held-out batches the trainer
    evaluates for `cfg` (its data's validation split, the first cfg.eval_batches batches of
    cfg.batch × cfg.seq tokens): what the trainer logs as val_loss, computed here again."""
    from ..data import TokenData

    batches = TokenData(cfg.data, "val").val_batches(cfg.eval_batches, cfg.batch, cfg.seq)
    with one_thread():
        return sum(model.loss(x, y).item() for x, y in batches) / len(batches)   # equal sizes


def known_words(texts: list[str], corpus) -> float:
    """The share of the words (runs of 3 or more ASCII letters, lower-cased) in `texts` that
    occur as words in `corpus` (a string or bytes): how much of a sample is real vocabulary."""
    import re

    if isinstance(corpus, (bytes, bytearray)):
        corpus = corpus.decode("utf-8", errors="replace")
    vocabulary = set(re.findall(r"[a-z]{3,}", corpus.lower()))
    words = [w for t in texts for w in re.findall(r"[a-z]{3,}", t.lower())]
    return sum(w in vocabulary for w in words) / max(len(words), 1)


def plain_share(texts: list[str]) -> float:
    """The share of the characters of `texts` that are plain ASCII text (printable, or a
    newline); a byte that is not UTF-8 counts as one � character."""
    chars = "".join(texts)
    return sum(c.isascii() and (c.isprintable() or c == "\n") for c in chars) / max(len(chars), 1)
