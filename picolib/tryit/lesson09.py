"""Lesson 09's plumbing: the bytes one rank sends to dispatch and combine evenly routed tokens
with the all-to-all and the all-gather dispatcher (`dispatch_bytes`, checked against a `Ledger` on
real ranks in tests/lessons/test_tryit_09.py), and who is in a rank's EP and DP groups.
"""
from __future__ import annotations

__all__ = ["SHAPE", "dispatch_bytes", "dispatch_bytes_bars", "ep_groups_answered"]

SHAPE = {"tokens": 4096, "hidden": 4096, "n_experts": 64, "bytes_per_element": 2}  # bf16


def dispatch_bytes(ep: int, top_k: int, dispatcher: str = "alltoall",
                   tokens: int = SHAPE["tokens"], hidden: int = SHAPE["hidden"],
                   n_experts: int = SHAPE["n_experts"],
                   bytes_per_element: int = SHAPE["bytes_per_element"]) -> int:
    """Bytes one of `ep` ranks sends in one forward for `tokens` tokens of its own.

    all-to-all: the counts ((ep−1)·E/ep int64), dispatch and combine (k·T·(ep−1)/ep rows of
    h each way); all-gather: tokens and the reduce-scatter of the sums ((ep−1)·T rows each),
    plus the gates (k floats), choices (k int64) and keep flags (k bytes) of every token."""
    if n_experts % ep or top_k > n_experts or (top_k * tokens) % ep:
        raise ValueError(f"need ep={ep} dividing n_experts={n_experts} and top_k·tokens="
                         f"{top_k * tokens}, and top_k={top_k} ≤ n_experts")
    b = bytes_per_element
    if dispatcher == "alltoall":
        return (ep - 1) * (n_experts // ep) * 8 + 2 * top_k * tokens * (ep - 1) // ep * hidden * b
    if dispatcher == "allgather":
        return (ep - 1) * tokens * (2 * hidden * b + top_k * (b + 8 + 1))
    raise ValueError(f"unknown dispatcher {dispatcher!r}; known: ['alltoall', 'allgather']")


def dispatch_bytes_bars(ep: int = 8, top_k: int = 1, ax=None) -> dict:
    """Bars of MiB sent per rank per forward at k = 1…8 for both dispatchers (SHAPE sizes),
    the chosen k outlined; prints and returns the chosen numbers."""
    import matplotlib.pyplot as plt

    from ..style import COLLECTIVES

    ks = list(range(1, 9))
    if top_k not in ks:
        raise ValueError(f"top_k must be one of {ks}, not {top_k!r}")
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
    for j, (name, label) in enumerate((("alltoall", "all-to-all"), ("allgather", "all-gather"))):
        xs = [k + 0.38 * j for k in ks]
        color = COLLECTIVES["all_to_all" if name == "alltoall" else "all_gather"]
        bars = ax.bar(xs, [dispatch_bytes(ep, k, name) / 2**20 for k in ks], width=0.36,
                      color=color, label=label)
        bars[top_k - 1].set_edgecolor("black")
        bars[top_k - 1].set_linewidth(2.5)
    ax.set_xticks([k + 0.19 for k in ks], [f"k={k}" for k in ks])
    ax.set_xlabel("top-k (the chosen k outlined in black)")
    ax.set_ylabel("MiB sent per rank (forward)")
    ax.set_title(f"ep = {ep}: {SHAPE['tokens']} tokens per rank, h = {SHAPE['hidden']}, "
                 f"{SHAPE['n_experts']} experts, bf16, even routing (computed)", fontsize=10)
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # off the bars
    if created:
        plt.show()
    a2a, ag = dispatch_bytes(ep, top_k, "alltoall"), dispatch_bytes(ep, top_k, "allgather")
    print(f"ep={ep}, top-{top_k}: all-to-all {a2a / 2**20:,.1f} MiB, all-gather {ag / 2**20:,.1f} MiB "
          f"per rank per forward (all-gather / all-to-all = {ag / a2a:.2f})")
    return {"alltoall": a2a, "allgather": ag, "ratio": ag / a2a}


def ep_groups_answered(dp: int = 4, ep: int = 2):
    """On every rank of a `Mesh(dp=dp)`: (mesh.describe(), {"ep": ranks, "edp": ranks}), each
    list the ranks that answered an all-gather over this rank's group, in group order — how
    lesson 09 §3 checks its drawing of the ep and edp groups."""
    import torch
    import torch.distributed as dist

    from ..mesh import Mesh

    mesh = Mesh(dp=dp)
    answered = {}
    for name, g in zip(("ep", "edp"), mesh.expert_groups(ep)):
        got = [torch.zeros(1) for _ in range(dist.get_world_size(g))]
        dist.all_gather(got, torch.tensor([float(dist.get_rank())]), group=g)
        answered[name] = [int(t) for t in got]
    return mesh.describe(), answered
