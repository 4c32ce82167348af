"""Helpers shared by the test modules (imported, never collected)."""
from __future__ import annotations

import os


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def child_pids(parent: int | None = None) -> set[int]:
    """PIDs of the live (non-zombie) children of `parent` (this process by default)."""
    parent = os.getpid() if parent is None else parent
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields is not None and int(fields[1]) == parent and fields[0] != "Z":
                out.add(int(entry))
    return out


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def grad_model(model):
    """A copy of `model` whose weights are its gradients: sharding it shards the gradients."""
    import copy

    import torch
    g = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(g.parameters(), model.parameters(), strict=True):
            p.copy_(q.grad)
    return g


def with_biases(model, seed: int = 0, everywhere: bool = False):
    """`model` (a TinyLlama) with every block's attn.wq, wk, wv, wo (with `everywhere`, also
    mlp.w_gate, w_up, w_down and the lm_head) replaced by a bias=True nn.Linear: the same
    weights, random biases drawn from `seed` (the same on every rank)."""
    import torch
    import torch.nn as nn
    g = torch.Generator().manual_seed(seed)
    names = ["attn.wq", "attn.wk", "attn.wv", "attn.wo"]
    names += ["mlp.w_gate", "mlp.w_up", "mlp.w_down"] if everywhere else []
    places = [(block, name) for block in model.blocks for name in names]
    places += [(model, "lm_head")] if everywhere else []
    for owner, name in places:
        *path, attr = name.split(".")
        for step in path:
            owner = getattr(owner, step)
        old = getattr(owner, attr)
        new = nn.Linear(old.in_features, old.out_features, bias=True).to(old.weight)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(torch.randn(old.out_features, generator=g) * 0.1)
        setattr(owner, attr, new)
    return model
