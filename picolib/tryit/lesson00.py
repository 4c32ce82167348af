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
    ax_b.bar(ops, [out[o]["sent_bytes"] / max(nbytes, 1) for o in ops], color=["C1", "C2", "C0"])
    ax_b.set(ylabel="bytes sent per rank / B", title=f"N = {n}: traffic per rank", ylim=(0, 2.05))
    lat = [out[o]["latency_s"] * 1e6 for o in ops]
    bw = [out[o]["bandwidth_s"] * 1e6 for o in ops]
    ax_t.bar(ops, lat, color="0.6", label=f"latency: steps × {alpha_us:g} µs")
    ax_t.bar(ops, bw, bottom=lat, color="C0", label=f"bandwidth: bytes / {bandwidth_gbs:g} GB/s")
    ax_t.set(ylabel="µs", title=f"α–β time, B = {nbytes:.3g} bytes")
    ax_t.legend(fontsize=9)
    for ax in (ax_b, ax_t):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    plt.show()
    return fig
