"""Lesson 02's plumbing: DDP's bucket plan (`bucket_plan`, checked against a real `DDP` in
tests/lessons/test_tryit_02.py), the one-process reference, the tables and figures of §2-§3.
Try it: `knobs(buckets, cap_kib=[64, 16, 1024], n_layers=[4, 1, 8])`.
"""
from __future__ import annotations

from ..data_parallel import assign_buckets
from ..model import LlamaConfig, TinyLlama

__all__ = ["bucket_plan", "buckets", "through_root_vs_ring", "emulate_backward", "rows", "max_diff",
           "single_process", "print_calls", "plot_calls", "last_step", "bucket_label", "plot_overlap",
           "collective_order", "overlap_summary"]


def bucket_plan(cap_kib: int, n_layers: int, base: LlamaConfig | None = None) -> dict:
    """{"sizes": gradient bytes in backward order, "buckets": bytes per bucket,
    "calls": all-reduces per step (one per bucket), "tensors": all-reduces of naive DP
    (one per gradient tensor), "names": parameter names per bucket}."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be at least 1, not {n_layers}")
    cfg = (base or LlamaConfig()).replace(n_layers=int(n_layers))
    named = [(n, p) for n, p in TinyLlama(cfg).named_parameters()][::-1]   # backward order
    sizes = [p.numel() * p.element_size() for _, p in named]
    groups = assign_buckets(sizes, int(cap_kib * 1024))
    return {"sizes": sizes, "buckets": [sum(sizes[i] for i in g) for g in groups],
            "calls": len(groups), "tensors": len(sizes),
            "names": [[named[i][0] for i in g] for g in groups]}


def buckets(cap_kib: int = 64, n_layers: int = 4, ax=None) -> dict:
    """Draw the buckets of one backward (bytes per bucket, in the order they are
    all-reduced, the cap as a dashed line) and return `bucket_plan(cap_kib, n_layers)`.
    The axis is logarithmic and every bar carries its size: a bucket of one norm's
    gradient (0.25 KiB) next to one of the head's (64 KiB) stays visible."""
    import matplotlib.pyplot as plt
    from ..style import MEMORY, fmt_bytes
    plan = bucket_plan(cap_kib, n_layers)
    created = ax is None
    if created:
        ax = plt.subplots(figsize=(min(12.0, max(6.5, 0.5 * plan["calls"] + 3)), 3.4),
                          layout="constrained")[1]
    kib = [b / 1024 for b in plan["buckets"]]
    floor = 0.1                                   # the log axis starts at 0.1 KiB
    ax.bar(range(len(kib)), [k - floor for k in kib], bottom=floor, color=MEMORY["grads"],
           label="bucket (gradient bytes)")
    if len(kib) <= 20:                            # sizes written on the bars while they fit
        for i, b in enumerate(plan["buckets"]):
            ax.text(i, kib[i] * 1.15, fmt_bytes(b).replace(".0 ", " "), ha="center", va="bottom",
                    fontsize=9, rotation=90 if len(kib) > 8 else 0,
                    bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))
    ax.axhline(cap_kib, color="k", ls="--", lw=1, label=f"cap {cap_kib} KiB")
    ax.set_yscale("log")
    ax.set_ylim(floor, max(max(kib), cap_kib) * 12)
    ax.set(xlabel="bucket, in the order of its all-reduce (output head first)",
           ylabel="bucket size (KiB, log scale)",
           title=f"{n_layers} layer(s), cap {cap_kib} KiB: {plan['calls']} all-reduces per step "
                 f"instead of {plan['tensors']}")
    ax.set_xticks(range(len(kib)))
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    if created:
        plt.show()
    print(f"{plan['calls']} buckets of {[round(k, 2) for k in kib]} KiB "
          f"(a bucket above the dashed cap holds one tensor larger than the cap)")
    return plan


# --------------------------------------------------------------------------- checking it
# Helpers the lesson's "checking it" cells run on ranks; not part of the try-it knob.

def torch_ddp_grads(cap_bytes: int, gradient_as_bucket_view: bool, n_layers: int = 4) -> dict:
    """On a rank: the tiny Llama under *PyTorch's* DistributedDataParallel, two backward
    passes (DDP rebuilds its buckets after the first, in the order gradients arrived).
    Returns the sorted bytes of the distinct storages behind the `.grad`s, their total, the
    bytes of the reducer's buckets as DDP's own logging data reports them, and "spread": the
    largest difference between the ranks' gradients after a forward through the wrapper and
    after one that bypasses it (`ddp.module`: PyTorch's hooks are armed by its forward)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from ..model import random_tokens
    cfg = LlamaConfig().replace(n_layers=int(n_layers))
    model = TinyLlama(cfg)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_bytes / 2**20,
                                  gradient_as_bucket_view=gradient_as_bucket_view)
    x, y = random_tokens(2, 8, cfg.vocab_size, seed=dist.get_rank())

    def spread():       # the largest difference between the ranks' gradients
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        hi, lo = g.clone(), g.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        return (hi - lo).max().item()

    for _ in range(2):
        logits = ddp(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in model.parameters()}
    logged = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    through = spread()
    model.zero_grad()
    model.loss(x, y).backward()            # the forward bypasses the wrapper: ddp.module(x)
    return {"storages": sorted(storages.values()), "grad_bytes": sum(storages.values()),
            "bucket_bytes": sum(int(b) for b in str(logged).split(",") if b.strip()),
            "spread": {"through ddp(x)": through, "bypassing it": spread()}}


def through_root_vs_ring(numel: int) -> dict:
    """On a rank: average a gradient buffer of `numel` fp32 values two ways and return the
    bytes this rank sent and received in each.

    - "root": what `nn.DataParallel` does with gradients (one process, GPU 0 the root):
      every other rank sends its buffer to rank 0, rank 0 sums and sends the result back
      to each (point-to-point sends; the Ledger records each with its tensor's bytes);
    - "ring": picolib's ring all-reduce (bytes sent, counted by the ring: measured=True)."""
    import torch
    import torch.distributed as dist
    from .. import comm
    from ..comm import Ledger
    rank, n = dist.get_rank(), dist.get_world_size()
    grad = torch.full((numel,), float(rank + 1))
    out = {}
    with Ledger() as led:
        if rank == 0:
            total, part = grad.clone(), torch.empty(numel)
            for src in range(1, n):
                comm.recv(part, src)
                total += part
            for dst in range(1, n):
                comm.send(total, dst)
        else:
            comm.send(grad, 0)
            total = torch.empty(numel)
            comm.recv(total, 0)
    out["root"] = {"sent": led.total("nbytes", "send"), "received": led.total("nbytes", "recv"),
                   "result": total[0].item()}
    ring = grad.clone()
    with Ledger() as led:
        comm.ring_all_reduce(ring)
    assert all(r.measured for r in led.records)
    sent = led.total("sent_bytes")
    out["ring"] = {"sent": sent, "result": ring[0].item()}
    return out


def emulate_backward(model, timeline, seconds: float) -> None:
    """Lesson 02's overlap figure: make the backward of the output head and of each block
    last at least `seconds` (a sleep when it begins) and record it on `timeline` as a "B"
    span labelled head, B0, B1, … (emulated=True). Hooks stay on the model."""
    import time
    started = {}

    def before(name):                      # backward of this module begins: emulate its cost
        def hook(module, grad_output):
            started[name] = time.perf_counter()
            time.sleep(seconds)
        return hook

    def after(name):                       # gradient w.r.t. its input is ready: span ends
        def hook(module, grad_input, grad_output):
            timeline.add("B", started[name], time.perf_counter(), label=name)["emulated"] = True
        return hook

    for name, module in [("head", model.lm_head)] + [(f"B{i}", b) for i, b in enumerate(model.blocks)]:
        module.register_full_backward_pre_hook(before(name))
        module.register_full_backward_hook(after(name))


# --------------------------------------------------------------------------- the lesson's plumbing
# Slicing batches, comparing weights, printing and drawing: what the lesson's cells call so
# that what they show is the data parallelism itself.

def rows(tokens, targets, pieces: int, i: int):
    """Slice `i` of `pieces` equal slices of a batch (rows of `tokens` and `targets`)."""
    n = tokens.shape[0]
    if pieces < 1 or n % pieces or not 0 <= i < pieces:
        raise ValueError(f"cannot take slice {i} of {pieces} equal slices of {n} rows")
    k = n // pieces
    return tokens[i * k:(i + 1) * k], targets[i * k:(i + 1) * k]


def max_diff(a, b) -> float:
    """The largest absolute difference between two lists of tensors (weights of two runs)."""
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} tensors against {len(b)}")
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def single_process(cfg: LlamaConfig, batch_fn, steps: int, lr: float) -> list:
    """The reference: one process trains a tiny Llama with SGD on the whole batch
    `batch_fn(step)` (tokens, targets) for `steps` steps; returns its weights."""
    import torch
    model = TinyLlama(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        model.loss(*batch_fn(step)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def print_calls(counts: dict, sizes: list) -> None:
    """Section 2's table: for naive DP and each bucket cap in `counts` ({"naive" or cap:
    (all-reduces, buffer bytes, bytes sent per rank)}), the buckets `assign_buckets` plans for
    the gradient `sizes`, and what the Ledger counted."""
    print(f"{'bucket cap':>12} {'buckets':>8} {'all-reduces':>12} {'bytes':>9} {'sent/rank (ring formula)':>25}")
    for cap, (calls, nbytes, sent) in counts.items():
        planned = "—" if cap == "naive" else len(assign_buckets(sizes, cap))
        label = "naive DP" if cap == "naive" else f"{cap:,}"
        print(f"{label:>12} {planned:>8} {calls:>12} {nbytes:>9,} {sent:>25,}")


def plot_calls(counts: dict, caps: list, ax=None):
    """Section 2's figure: all-reduce calls per step against the bucket cap (log axis), naive
    DP's one call per tensor as a dashed line. Returns the Axes (the caller shows it)."""
    import matplotlib.pyplot as plt
    from ..style import COLLECTIVES
    if ax is None:
        ax = plt.subplots(figsize=(6.5, 3.2), layout="constrained")[1]
    ax.plot(caps, [counts[c][0] for c in caps], "o-", color=COLLECTIVES["all_reduce"],
            label="DDP: one per bucket")
    ax.axhline(counts["naive"][0], color="grey", ls="--", label="naive DP: one per tensor")
    ax.set_xscale("log")
    ax.set(xlabel="bucket_cap_bytes (bytes, log scale)", ylabel="all-reduce calls per step",
           title="bucketing: the same 4Ψ bytes, fewer calls", ylim=(0, counts["naive"][0] * 1.15))
    ax.legend(loc="lower left")
    return ax


def last_step(events: list) -> list:
    """One rank's timeline events from its last forward ("F") on: the step a figure shows."""
    starts = [e["start"] for e in events if e["name"] == "F"]
    if not starts:
        raise ValueError("no forward span (\"F\") among the events")
    return [e for e in events if e["start"] >= max(starts)]


def bucket_label(names: list[str]) -> str:
    """A bucket named by the parts of the model it holds, in backward's order, as the
    backward spans are: "head·B3" (lm_head, the final norm, block 3), "B0·emb"."""
    def part(name):
        first = name.split(".")[0]
        return {"lm_head": "head", "norm": "head", "embed": "emb"}.get(first) or f"B{name.split('.')[1]}"
    return "·".join(dict.fromkeys(part(n) for n in names))


def plot_overlap(timelines: dict, costs: dict, names: list[list[str]]):
    """Section 3's figure: one Gantt panel per run in `timelines` ({overlap: events of the
    ranks}), on one time axis, the emulated costs in the titles. An all-reduce is labelled
    by the blocks its bucket holds (`names`: the parameter names per bucket; "head·B3" drawn
    on two lines) and drawn from
    the moment the last rank issued it; a black tick marks where this rank issued it, a
    dotted line the time it waited for the other rank or for the link, and a hatched "wait"
    box on the compute row the time from the end of backward to the last all-reduce's end,
    when the rank can do nothing but wait. Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle
    from ..timeline import merge, plot_gantt
    labels = [bucket_label(n) for n in names]
    merged = {}
    for overlap, events in timelines.items():
        t0 = min(e["start"] for e in events)
        merged[overlap] = [dict(e, meta={**e["meta"], "label": "", "issued": e["meta"]["issued"] - t0})
                           if e["name"] == "all_reduce" else e for e in merge(events)]
    longest = max(max(e["end"] for e in ev) for ev in merged.values())
    fig, axes = plt.subplots(len(merged), 1, figsize=(12, 3.4 * len(merged)), layout="constrained",
                             squeeze=False)
    for ax, (overlap, events) in zip(axes[:, 0], merged.items()):
        plot_gantt(events, ax=ax, unit="ms", xmax=longest,
                   title=f"DDP, overlap={overlap} (emulated costs: B {costs['B'] * 1e3:.0f} ms/block, "
                         f"all-reduce {costs['all_reduce'] * 1e3:.0f} ms/bucket)")
        rows = {t.get_text(): y for t, y in zip(ax.get_yticklabels(), ax.get_yticks())}
        for rank in sorted({e["rank"] for e in events}):
            comms = [e for e in events if e["rank"] == rank and e["name"] == "all_reduce"]
            y = rows[f"rank {rank} · comm"]
            for e in comms:                       # the bucket's blocks; issue tick; the wait
                ax.text((e["start"] + e["end"]) / 2 * 1e3, y, labels[e["meta"]["bucket"]].replace("·", "\n"),
                        ha="center", va="center", fontsize=9, linespacing=0.9, color="white",
                        clip_on=True)
                ax.plot([e["meta"]["issued"] * 1e3] * 2, [y - 0.25, y + 0.25], color="black", lw=1.5)
                ax.plot([e["meta"]["issued"] * 1e3, e["start"] * 1e3], [y, y], color="black",
                        lw=1, ls=":", zorder=0.5)        # behind the bars it waits for
            b_end = max(e["end"] for e in events if e["rank"] == rank and e["name"] == "B")
            last = max(e["end"] for e in comms)
            if last > b_end:
                y = rows[f"rank {rank}"]
                ax.add_patch(Rectangle((b_end * 1e3, y - 0.4), (last - b_end) * 1e3, 0.8,
                                       facecolor="white", edgecolor="grey", hatch="///", lw=0.8))
        handles = ax.get_legend().legend_handles + [
            Line2D([], [], color="black", lw=1.5, marker="|", ls="", markersize=10, label="issued here"),
            Line2D([], [], color="black", lw=1, ls=":", label="waits (the other rank, the link)"),
            Patch(facecolor="white", edgecolor="grey", hatch="///", label="wait (exposed comm)")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=9)
    return fig


def collective_order(events: list) -> list[str]:
    """Each all-reduce that ends on some rank before every rank has issued it, or starts
    before that: an all-reduce cannot (its sum needs every rank's buffer). [] when none."""
    wrong = []
    for b in sorted({e["meta"]["bucket"] for e in events if e["name"] == "all_reduce"}):
        spans = [e for e in events if e["name"] == "all_reduce" and e["meta"]["bucket"] == b]
        last = max(e["meta"]["issued"] for e in spans)
        wrong += [f"bucket {b}, rank {e['rank']}: {'ends' if e['end'] < last else 'starts'} "
                  f"before the last rank issued it" for e in spans
                  if e["start"] < last or e["end"] < last]
    return wrong


def overlap_summary(events: list, rank: int) -> dict:
    """Section 3's measurements on one rank's step: all-reduces issued before its backward
    ended, the exposed communication (from the end of the last rank's backward, when the last
    bucket can be issued, to the end of this rank's last all-reduce), the all-reduce time
    hidden under its backward, and the step, in ms."""
    from ..timeline import overlap_time
    mine = [e for e in events if e["rank"] == rank]
    b_end = max(e["end"] for e in mine if e["name"] == "B")
    last_b_end = max(e["end"] for e in events if e["name"] == "B")
    comms = [e for e in mine if e["name"] == "all_reduce"]
    if not comms:
        raise ValueError(f"rank {rank} has no all_reduce span")
    return {"issued under backward": sum(e["meta"]["issued"] < b_end for e in comms),
            "exposed comm (ms)": 1e3 * (max(e["end"] for e in comms) - last_b_end),
            "comm hidden by backward (ms)": 1e3 * overlap_time(mine, rank, "B", "all_reduce"),
            "step (ms)": 1e3 * (max(e["end"] for e in mine) - min(e["start"] for e in mine))}
