"""Lesson 02's "try it": how the bucket cap and the depth of the model set DDP's buckets.

    from picolib.tryit import knobs
    from picolib.tryit.lesson02 import buckets
    knobs(buckets, cap_kib=(16, 512, 16), n_layers=(1, 8, 1))

`bucket_plan` is the arithmetic (no ranks, no plot): the gradient sizes of a tiny Llama
with `n_layers` blocks, in the order backward produces them, packed by
`picolib.data_parallel.assign_buckets`. tests/test_tryit_02.py checks it against the
buckets and the all-reduce calls of a real `DDP` on two ranks.
"""
from __future__ import annotations

from ..data_parallel import assign_buckets
from ..model import LlamaConfig, TinyLlama

__all__ = ["bucket_plan", "buckets"]


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
    all-reduced, the cap as a dashed line) and return `bucket_plan(cap_kib, n_layers)`."""
    import matplotlib.pyplot as plt
    plan = bucket_plan(cap_kib, n_layers)
    ax = ax or plt.subplots(figsize=(7, 3), layout="constrained")[1]
    kib = [b / 1024 for b in plan["buckets"]]
    ax.bar(range(len(kib)), kib, color="#2a9d8f")
    ax.axhline(cap_kib, color="grey", ls="--", lw=1, label=f"cap {cap_kib} KiB")
    ax.set(xlabel="bucket (order of its all-reduce: output head first)", ylabel="KiB",
           title=f"{n_layers} layer(s), cap {cap_kib} KiB: {plan['calls']} all-reduces per step "
                 f"instead of {plan['tensors']}")
    ax.set_xticks(range(len(kib)))
    ax.legend(fontsize=8)
    plt.show()
    print(f"{plan['calls']} buckets of {[round(k, 1) for k in kib]} KiB "
          f"(a bucket above the dashed cap holds one tensor larger than the cap)")
    return plan
