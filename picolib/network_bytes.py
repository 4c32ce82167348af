"""Which network level each byte of a training step crosses, for an order of the mesh (lesson 10).

What: `level_bytes(cfg, par, order, hw)` numbers the GPUs of a dense 5-D configuration
row-major over `order` (outermost dimension first, as `picolib.mesh` and PyTorch's
`DeviceMesh` number them), puts GPU g in node g // 8, leaf unit g // 256, ... (the levels
of `hw`), and returns the bytes per step that cross each level, by kind of parallelism,
summed over all GPUs.
Why: the order of the mesh decides which groups are neighbours. Megatron-LM (and picolib)
puts pp outermost; the Llama 3 report orders its 4-D mesh [TP, CP, PP, DP] from innermost,
DP (FSDP) outermost, because DP's traffic overlaps the backward and tolerates latency while
the pipeline's sends sit on its critical path. The bytes per level are the first half of
that trade; lesson 10 weighs them.

The wire, as modelled here:
- each rank's bytes of a kind are `picolib.planner.traffic` (the ring formulas);
- a ring collective (dp — over dp·cp ranks, as ZeRO and DDP run —, tp, cp) sends all of a
  rank's bytes to its successor in its group's ring: the group's ranks in rank order, the
  last one sending to the first (a topology-aware library may build better rings);
- a pipeline stage sends activations to the next stage's rank and gradients to the
  previous one's (stage s lives on pipeline rank s mod pp, so interleaving wraps around);
- a hop crosses the lowest level whose unit holds both GPUs ("node": NVLink); a hop between
  units of the top level counts as the top level.
Expert parallelism and DualPipe's two-way stage layout are not modelled (ValueError).
"""
from __future__ import annotations

from .hardware import hardware
from .parallel_layout import coordinates, rank_at
from .model import LlamaConfig
from .planner import MoEShape, Parallelism, traffic

__all__ = ["DIMS", "GROUPS", "level_bytes", "hop_level"]

DIMS = ("pp", "dp", "cp", "tp")
GROUPS = {"dp": ("dp", "cp"), "tp": ("tp",), "cp": ("cp",), "pp": ("pp",)}   # kind → its dims


def hop_level(a: int, b: int, hw) -> str:
    """The name of the lowest network level whose unit holds GPUs a and b."""
    levels = hardware(hw).levels
    return next((lv.name for lv in levels if a // lv.gpus == b // lv.gpus), levels[-1].name)


def level_bytes(cfg: LlamaConfig, par: Parallelism, order=DIMS, hw="H100-SXM",
                moe: MoEShape | None = None) -> dict:
    """{kind: {level: bytes}} for kinds "dp", "tp", "pp", "cp" and "total": the bytes one step
    sends across each network level of `hw`, summed over all GPUs, with the GPUs numbered
    row-major over `order` (a permutation of pp, dp, cp, tp; outermost first)."""
    hw = hardware(hw)
    if sorted(order) != sorted(DIMS):
        raise ValueError(f"order must be a permutation of {DIMS}, not {order!r}")
    if par.ep > 1 or moe is not None:
        raise ValueError("level_bytes models dense models: expert parallelism is not placed")
    if par.schedule.startswith("dualpipe") and par.pp > 1:
        raise ValueError("DualPipe places two stages per rank from both ends: not modelled")
    size = {d: getattr(par, d) for d in DIMS}
    stride = {d: rank_at(par, order, **{e: int(e == d) for e in DIMS}) for d in DIMS}
    names = [lv.name for lv in hw.levels]
    out = {kind: dict.fromkeys(names, 0) for kind in (*GROUPS, "total")}
    sent = [traffic(cfg, par, r) for r in range(par.pp)]      # bytes per rank, by pipeline rank
    n_stages = par.pp * par.v
    for rank in range(par.n_gpus):
        coord = coordinates(par, rank, order)
        sends = []                                            # (kind, peer, bytes)
        for kind in ("dp", "tp", "cp"):
            if sent[coord["pp"]][kind]:
                sends.append((kind, _ring_successor(rank, coord, GROUPS[kind], order, size, stride),
                              sent[coord["pp"]][kind]))
        if par.pp > 1:   # split this rank's pipeline bytes by the stages it holds
            mine = range(coord["pp"], n_stages, par.pp)
            fwd = sum(1 for st in mine if st < n_stages - 1)
            bwd = sum(1 for st in mine if st > 0)
            for step, count in ((1, fwd), (-1, bwd)):
                peer = rank + ((coord["pp"] + step) % par.pp - coord["pp"]) * stride["pp"]
                if count:
                    sends.append(("pp", peer, sent[coord["pp"]]["pp"] * count / (fwd + bwd)))
        for kind, peer, nbytes in sends:
            level = hop_level(rank, peer, hw)
            out[kind][level] += nbytes
            out["total"][level] += nbytes
    return out


def _ring_successor(rank, coord, dims, order, size, stride) -> int:
    """The next rank of `rank`'s group along `dims` in rank order (the last wraps to the
    first): count up the group's coordinates, its innermost dimension fastest."""
    nxt = dict(coord)
    for d in sorted(dims, key=order.index, reverse=True):
        nxt[d] = (coord[d] + 1) % size[d]
        if nxt[d]:                    # no carry
            break
    return rank + sum((nxt[d] - coord[d]) * stride[d] for d in dims)
