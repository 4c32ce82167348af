"""Lesson 00, try it: what one ring collective costs for N ranks and a buffer of B bytes.

    from picolib.tryit import knobs
    from picolib.tryit.lesson00 import ring_cost
    knobs(ring_cost, n=(2, 16, 1), nbytes=[1e6, 1e3, 1e9])

Each step of a ring moves one chunk of B/N bytes from every rank to its right neighbour;
reduce-scatter and all-gather take N−1 steps, all-reduce 2(N−1). The α–β model prices a
step at α (latency) plus chunk/W (bandwidth)."""
from __future__ import annotations

RING_STEPS = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}   # × (N−1)


def ring_cost(n: int = 8, nbytes: float = 1e6, alpha_us: float = 5.0, bandwidth_gbs: float = 50.0,
              plot: bool = True) -> dict[str, dict[str, float]]:
    """Per collective: ring steps, bytes one rank sends, and α–β seconds (latency and
    bandwidth parts) for `n` ranks and a buffer of `nbytes` bytes, with α = `alpha_us` µs per
    step and W = `bandwidth_gbs` GB/s per link. Draws two bar charts when `plot`."""
    n, nbytes = int(n), float(nbytes)
    if n < 1 or nbytes < 0 or alpha_us < 0 or bandwidth_gbs <= 0:
        raise ValueError(f"need n ≥ 1, nbytes ≥ 0, alpha_us ≥ 0, bandwidth_gbs > 0; got "
                         f"{n}, {nbytes}, {alpha_us}, {bandwidth_gbs}")
    alpha, w, chunk = alpha_us * 1e-6, bandwidth_gbs * 1e9, nbytes / n
    out = {}
    for op, per in RING_STEPS.items():
        steps = per * (n - 1)
        sent = steps * chunk                      # one chunk per step
        out[op] = {"steps": steps, "sent_bytes": sent, "latency_s": steps * alpha,
                   "bandwidth_s": sent / w, "time_s": steps * alpha + sent / w}
    if plot:
        _draw(out, n, nbytes, alpha_us, bandwidth_gbs)
    return out


def _draw(out, n, nbytes, alpha_us, bandwidth_gbs):
    import matplotlib.pyplot as plt
    ops = list(out)
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(9, 2.8))
    from ..style import COLLECTIVES
    names = [o.replace("_", "-") for o in ops]
    ax_b.bar(names, [out[o]["sent_bytes"] / max(nbytes, 1) for o in ops], color=[COLLECTIVES[o] for o in ops])
    ax_b.set(ylabel="bytes sent per rank / B", title=f"N = {n}: traffic per rank", ylim=(0, 2.05))
    lat = [out[o]["latency_s"] * 1e6 for o in ops]
    bw = [out[o]["bandwidth_s"] * 1e6 for o in ops]
    ax_t.bar(names, lat, color="0.6", label=f"latency: steps × {alpha_us:g} µs")
    ax_t.bar(names, bw, bottom=lat, color="#4477AA", label=f"bandwidth: bytes / {bandwidth_gbs:g} GB/s")
    ax_t.set(ylabel="time (µs)", title=f"α–β time, B = {nbytes:.3g} bytes")
    ax_t.set_ylim(0, 1.35 * max(max(a + b for a, b in zip(lat, bw)), 1e-9))
    ax_t.legend(fontsize=9, loc="upper left")
    for ax in (ax_b, ax_t):
        ax.tick_params(axis="x", labelsize=9)
    fig.tight_layout()
    plt.show()
    return fig


# ---------------------------------------------------------------- the lesson's figures
# (drawing code lives here so the lesson's cells stay short; each helper draws into the
# axes it is given and never shows the figure)

def record_ring_steps(n_chunks: int | None = None) -> dict:
    """Run on every rank of a process group: picolib's own `comm.ring_all_reduce` on a
    tensor whose every element on rank r is 2**r, so any sum says which ranks it holds (its
    binary digits). Each ring step is recorded as it happens: which chunk this rank sends
    (found from the sent view's offset in the tensor), the value it carries, its bytes, and a
    snapshot of the whole tensor before the step. Returns {"rank", "n", "steps": [...],
    "final", "ledger_bytes"}."""
    import torch
    import torch.distributed as dist

    from .. import comm

    n, me = dist.get_world_size(), dist.get_rank()
    per = n_chunks or 1
    x = torch.full((n * per,), float(2 ** me))
    steps = []

    def recording(send_buf, right):
        steps.append({"chunk": send_buf.storage_offset() // per,
                      "value": int(send_buf[0].item()), "bytes": send_buf.numel() * send_buf.element_size(),
                      "to": right, "before": x.view(n, per)[:, 0].clone()})

    with comm.Ledger() as ledger:
        comm.ring_all_reduce(x, on_step=recording)
    return {"rank": me, "n": n, "steps": steps, "final": x.view(n, per)[:, 0].clone(),
            "ledger_bytes": ledger.measured_total("sent_bytes")}


def ranks_in(value: int) -> list[int]:
    """The ranks whose 2**r make up `value` (its binary digits)."""
    return [r for r in range(value.bit_length()) if value >> r & 1]


def draw_ring_steps(record: list[dict], axes) -> None:
    """One panel per moment of a ring all-reduce recorded by `record_ring_steps` (one entry
    per rank): the state of each rank's N chunks before every step and at the end, then
    which chunk each rank sent at each step. A cell names the ranks its partial sum holds
    (pink, darker as it fills) or says "all" (a finished sum, in the all-gather colour); the
    chunk a rank sends in the coming step is framed."""
    import matplotlib.colors as mcolors
    from ..style import COLLECTIVES

    n = record[0]["n"]
    n_steps = len(record[0]["steps"])
    rs, ag = mcolors.to_rgb(COLLECTIVES["reduce_scatter"]), mcolors.to_rgb(COLLECTIVES["all_gather"])
    axes = list(axes)
    for k, ax in zip(range(n_steps + 1), axes):
        final = k == n_steps
        for rec in record:
            r = rec["rank"]
            state = rec["final"] if final else rec["steps"][k]["before"]
            sent = None if final else rec["steps"][k]["chunk"]
            for c in range(n):
                who = ranks_in(int(state[c].item()))
                done = len(who) == n       # finished sums in the all-gather colour
                shade = len(who) / n
                face = ag if done else tuple(1 - shade * (1 - v) * 0.8 for v in rs)
                ax.add_patch(_rect((c, -r - 1), face, framed=c == sent))
                ax.text(c + 0.47, -r - 0.55, "all" if done else "+".join(map(str, who)),
                        ha="center", va="center", fontsize=9, color="white" if done else "black")
        ax.set_title("end: every chunk summed" if final else
                     f"before reduce-scatter step {k + 1}" if k < n - 1 else
                     f"before all-gather step {k - n + 2}", fontsize=10)
        _grid_axes(ax, n, n, [f"chunk {c}" for c in range(n)])
    if len(axes) > n_steps + 1:             # the last panel: which chunk each rank sent when
        ax = axes[n_steps + 1]
        for rec in record:
            for k, step in enumerate(rec["steps"]):
                face = COLLECTIVES["reduce_scatter"] if k < n - 1 else COLLECTIVES["all_gather"]
                ax.add_patch(_rect((k, -rec["rank"] - 1), face))
                ax.text(k + 0.47, -rec["rank"] - 0.55, f"c{step['chunk']}", ha="center",
                        va="center", fontsize=9, color="white")
        ax.set_title(f"chunk sent to the right, per step", fontsize=10)
        _grid_axes(ax, n, n_steps, [f"{'RS' if k < n - 1 else 'AG'}{k % (n - 1) + 1}"
                                    for k in range(n_steps)])
        for extra in axes[n_steps + 2:]:
            extra.set_visible(False)


def _grid_axes(panel, rows, cols, col_labels):
    panel.set_xlim(0, cols); panel.set_ylim(-rows, 0)
    panel.set_xticks([c + 0.47 for c in range(cols)], col_labels)
    panel.set_yticks([-r - 0.55 for r in range(rows)], [f"rank {r}" for r in range(rows)])
    panel.tick_params(length=0)
    for s in panel.spines.values():
        s.set_visible(False)


def _rect(xy, face, framed=False):
    import matplotlib.pyplot as plt
    return plt.Rectangle(xy, 0.95, 0.9, facecolor=face, edgecolor="black" if framed else face,
                         linewidth=2.5 if framed else 0)


def draw_collectives(xs, after, axes) -> None:
    """The collectives figure: one panel per state (before, then after each collective), one
    row per rank; a value's colour is the rank it came from (tens digit), grey a sum."""
    from ..style import rank_color

    panels = [("before (every collective)", xs, None)] + [
        (f"after {op.replace('_', '-')}", outs, list(range(len(outs))) if op == "reduce_scatter" else None)
        for op, outs in after.items()]
    for ax, (title, rows, at) in zip(axes, panels):
        for r, row in enumerate(rows):
            for j, v in enumerate(row.tolist(), start=at[r] if at else 0):
                src = int(v) // 10
                ax.add_patch(_rect((j, -r - 1), rank_color(src) if v < 40 else "#DDDDDD"))
                dark = v < 40 and src in (0, 3)
                ax.text(j + 0.47, -r - 0.55, f"{v:g}", ha="center", va="center", fontsize=9,
                        color="white" if dark else "black")
        ax.set_xlim(0, 4); ax.set_ylim(-len(rows), 0); ax.set_title(title, fontsize=10)
        ax.set_yticks([-r - 0.55 for r in range(len(rows))], [f"rank {r}" for r in range(len(rows))])
        ax.set_xticks([]); ax.tick_params(length=0)
        for s in ax.spines.values():
            s.set_visible(False)


def draw_traffic(ax, traffic: dict | None = None, nbytes: int = 32768) -> None:
    """Bytes each rank sent (counted on picolib's rings, one point per rank and N:
    `traffic[N]` is `run`'s list of per-rank results, bytes by op in item 3) against the ring
    formulas, in units of B; dashed: in-network reduction (B once per GPU). Without
    `traffic`, the formulas only."""
    from ..comm import ring_sent_bytes
    from ..style import COLLECTIVES

    ns = list(range(2, 9))
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        wide = op == "reduce_scatter"             # under the all-gather line: draw it wider
        ax.plot(ns, [ring_sent_bytes(op, nbytes, n) / nbytes for n in ns], color=COLLECTIVES[op],
                lw=6 if wide else 1.8, alpha=0.45 if wide else 1,
                label=f"{op.replace('_', '-')}: formula")
        pts = [(n, r[3][op] / nbytes) for n, res in (traffic or {}).items() for r in res]
        if pts:
            ax.plot(*zip(*pts), "o", color=COLLECTIVES[op], mfc="none",
                    ms=10 if op == "all_gather" else 6, label=f"{op.replace('_', '-')}: counted")
    ax.plot(ns, [1.0] * len(ns), "k--", label="all-reduce, in-network\nreduction (computed)")
    ax.set_xlabel("ranks N"); ax.set_ylabel("bytes sent per rank / B")
    ax.set_title("Bytes one rank sends: counted on picolib's rings vs the formulas")
    ax.set_ylim(0, 2.1); ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))


def traffic_table(traffic: dict, nbytes: int) -> str:
    """The bytes one rank (rank 0) sent, one row per N: `traffic[N]` is `run`'s list of per-rank
    results with bytes by op in item 3, as in `draw_traffic`. Columns: picolib's rings counted,
    reduce-scatter + all-gather, and the ledger's formula for gloo's own all-reduce."""
    rows = [f"bytes one rank sent, B = {nbytes // 2**10} KiB",
            " N | reduce-scatter | all-gather | all-reduce | RS+AG  | formula AR"]
    for n, res in traffic.items():
        s = res[0][3]
        rows.append(f"{n:2d} | {s['reduce_scatter']:14d} | {s['all_gather']:10d} | {s['all_reduce']:10d} "
                    f"| {s['reduce_scatter'] + s['all_gather']:6d} | {s['native all_reduce (formula)']}")
    return "\n".join(rows)


def time_ring_all_reduce(sizes, repeats: int = 7) -> dict:
    """Run on every rank: seconds of picolib's `comm.ring_all_reduce` on float32 buffers of
    each size in `sizes` (elements), the fastest of `repeats` runs after a warm-up (the
    machine is shared: the minimum is the run least disturbed by other processes)."""
    import time

    import torch

    from .. import comm

    best = {}
    for numel in sizes:
        x = torch.ones(numel)
        comm.ring_all_reduce(x)                   # warm-up: connections, allocations
        ts = []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            comm.ring_all_reduce(x)
            ts.append(time.perf_counter() - t0)
        best[numel] = min(ts)
    return best


def fit_alpha_beta(seconds: dict[int, float], n: int = 2) -> tuple[float, float]:
    """α (seconds per ring step) and 1/β (seconds per byte) fitted to ring all-reduce times on
    `n` ranks: `seconds[numel]` for a float32 buffer of `numel` elements, modelled as
    τ = 2(N−1)·α + (bytes one rank sends)/β. Least squares on relative errors, so the small
    buffers (where α shows) weigh as much as the large ones (where β shows); α is held ≥ 0, since
    on a noisy machine a free fit can return a negative latency."""
    import torch

    from ..comm import ring_sent_bytes

    if n < 2 or len(seconds) < 2:
        raise ValueError(f"need n ≥ 2 and at least two buffer sizes; got n={n}, {len(seconds)} size(s)")
    sent = torch.tensor([float(ring_sent_bytes("all_reduce", 4 * numel, n)) for numel in seconds],
                        dtype=torch.float64)
    tau = torch.tensor(list(seconds.values()), dtype=torch.float64)
    a = torch.stack([torch.ones_like(sent), sent], dim=1) / tau[:, None]
    intercept, per_byte = torch.linalg.lstsq(a, torch.ones_like(tau)).solution.tolist()
    if intercept < 0:                                   # the best fit with α = 0
        intercept, per_byte = 0.0, float((sent / tau).sum() / (sent / tau).square().sum())
    return intercept / (2 * (n - 1)), per_byte


# ---------------------------------------------------------------- §7: a group that spans nodes

def nic_bytes(ledger, per_node: int) -> int:
    """Bytes this rank's ring sends went to a rank in another node, i.e. through its NIC:
    in each ring record of `ledger` (picolib's rings, `ranks` = the ring's global ranks in
    order) this rank sends everything to its right neighbour."""
    import torch.distributed as dist

    me, sent = dist.get_rank(), 0
    for rec in ledger.records:
        if rec.meta.get("algorithm") == "ring" and len(rec.ranks) > 1:
            right = rec.ranks[(rec.ranks.index(me) + 1) % len(rec.ranks)]
            sent += rec.sent_bytes if right // per_node != me // per_node else 0
    return sent


def nic_traffic(hierarchical, per_node: int, numel: int) -> dict:
    """Run on every rank of a world of whole nodes of `per_node` ranks: an all-reduce of this
    rank's buffer three ways — `hierarchical(x, per_node)` (the lesson's), one flat ring over
    the world in rank order, and one ring per GPU position across the nodes (a group with one
    GPU per node, each rank all-reducing its own buffer in its own group). Returns this rank's
    buffer and, per way, (result, {op: bytes this rank sent}, bytes through this rank's NIC)."""
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..comm import Ledger

    me, n = dist.get_rank(), dist.get_world_size()
    across = [dist.new_group(list(range(j, n, per_node))) for j in range(per_node)][me % per_node]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(me))
    ways = {"hierarchical": lambda t: hierarchical(t, per_node), "flat ring": comm.ring_all_reduce,
            "one GPU per node": lambda t: comm.ring_all_reduce(t, group=across)}
    out = {}
    for way, fn in ways.items():
        with Ledger() as led:
            y = fn(x.clone())
        assert all(rec.measured for rec in led.records)
        sent = {}
        for rec in led.records:
            sent[rec.op] = sent.get(rec.op, 0) + rec.sent_bytes
        out[way] = (y, sent, nic_bytes(led, per_node))
    return x, out


def draw_nic_traffic(ax, traffic: list, per_node: int, nbytes: int, seen: dict) -> None:
    """Bars: the bytes each GPU of node 0 sent through its own NIC (in units of B), one group
    per way of `nic_traffic` (`traffic`: `run`'s per-rank results); above each group, the
    per-GPU bandwidth `seen[way]` (bytes/s) its cross-node part runs at."""
    from ..style import RANKS

    ways = list(traffic[0])
    width = 0.8 / per_node
    top = max(r[w][2] for r in traffic for w in ways) / nbytes
    for k, way in enumerate(ways):
        nic = [traffic[g][way][2] / nbytes for g in range(per_node)]
        for g, v in enumerate(nic):
            ax.bar(k + (g - (per_node - 1) / 2) * width, v, width * 0.9, color=RANKS[g],
                   label=f"GPU {g}'s NIC" if k == 0 else None)
        ax.text(k, top * 1.08, f"busiest NIC: {max(nic):.2f} B\nthe all-reduce sees {seen[way] / 1e9:.0f} GB/s",
                ha="center", va="bottom", fontsize=9)
    under = {"hierarchical": f"hierarchical\n(one buffer, split over {per_node} NICs)",
             "flat ring": "flat ring over all ranks\n(one buffer; one NIC crosses)",
             "one GPU per node": f"one GPU per node\n({per_node} groups, each its own buffer)"}
    ax.set_xticks(range(len(ways)), [under.get(w, w) for w in ways])
    ax.set_ylim(0, top * 1.5)
    ax.set(ylabel="bytes through the NIC / B",
           title=f"All-reduce of B = {nbytes / 2**10:g} KiB on 2 nodes × {per_node} GPUs: what each NIC of node 0 "
                 "sends (bytes measured)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))


# ---------------------------------------------------------------- three ways a run goes wrong
# (each runs on every rank of a group; `three_failures` runs them)

def raises_on_rank_2():
    import torch.distributed as dist
    if dist.get_rank() == 2:
        raise ValueError("rank 2 refuses")


def rank_1_skips_the_all_reduce():
    import time

    import torch
    import torch.distributed as dist

    from .. import comm
    if dist.get_rank() != 1:
        time.sleep(0.5)                 # some work first, then the all-reduce rank 1 never joins
        comm.all_reduce(torch.ones(4))


def rank_3_is_killed():
    import os
    import signal

    import torch
    import torch.distributed as dist

    from .. import comm
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)   # what the out-of-memory killer does
    comm.all_reduce(torch.ones(1))


def three_failures(timeout: float = 3.0) -> dict[str, BaseException]:
    """Run three broken programs with `launch.run` and return what each raised, by case: rank 2
    of 4 raises (`raises_on_rank_2`); rank 1 of 2 skips an all-reduce its peer waits in, stopped
    after `timeout` seconds (`rank_1_skips_the_all_reduce`); rank 3 of 4 is killed by SIGKILL
    (`rank_3_is_killed`). A case that raises nothing is an error here."""
    from ..launch import run

    cases = {"rank 2 raises": (raises_on_rank_2, 4, 30),
             "rank 1 skips an all-reduce": (rank_1_skips_the_all_reduce, 2, timeout),
             "rank 3 is killed": (rank_3_is_killed, 4, 30)}
    raised = {}
    for case, (fn, n, limit) in cases.items():
        try:
            run(fn, n, timeout=limit)
        except Exception as e:          # noqa: BLE001 — what the case raised is the result
            raised[case] = e
        else:
            raise AssertionError(f"{case}: the run finished without an error")
    return raised
