"""Where a parameter lives (lessons 10-11): one description per parameter of its place on
the mesh, which gradient clipping (`picolib.clipping`), sharded checkpoints
(`picolib.checkpoint`) and the dry run all read, so none of them re-derives it.

For each parameter a rank holds, `placements(cfg, rank)` gives a `Placement`:
- `name`: its name in the single-process model (`blocks.5.attn.wq.weight`), `stage` and
  `local`: the pipeline stage that holds it and its name inside that stage's module
  (stage 1 of two calls block 5 `blocks.1`; expert 3 of four over ep=2 is local expert 1);
- `shape`: the whole tensor's shape; `offsets`, `sizes`: the box of the whole tensor this
  rank's tensor is — tensor parallelism cuts as `tensor_parallel.TP_PLAN` says, the table the
  transform builds its shards from (dim 0: column-parallel q, gate, up, k and v by KV head —
  a KV head held by tp/kv ranks when tp > kv heads — and the vocabulary of the embedding and
  the head; dim 1: row-parallel o, down; norms, routers and experts whole), and the experts an
  ep rank keeps are `expert_parallel.local_experts`, the rule `ExpertParallelMoE` keeps them by;
- `copies`: every global rank that holds this same box with the same values (data- and
  context-parallel replicas, the tp ranks that share a norm or a KV head, an expert's
  replicas over dp/ep, DualPipe's mirror pipeline rank); `replicas`: those of them the
  data-parallel wrapper reduces the gradient over (this rank's dp × cp ranks, an expert's edp
  ranks, with DualPipe both ranks of the pair times those); the copies are these
  replicas times the tp ranks that share the box, and `first` says whether this rank's
  replicas are the first of them (the one set that counts or writes a copied box).

It is a pure function of the configuration and the rank's mesh coordinates — no process
group, no tensor — so it can describe any rank of a cluster this machine cannot run
(`placements(cfg, rank)` for rank 639 of 640). `tests/lib/test_param_placement.py` checks it
against the transformed modules: every rank's tensor, put in its box, is the single-process
tensor.

What the data-parallel wrapper does inside a box (DDP keeps it whole on every replica; ZeRO
keeps one flat shard of a unit of parameters) the wrapper answers itself: `holdings()`, the
one method DDP and ZeRO both have (`picolib.flat.Holdings`), so nothing here or in their
readers looks inside them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from .parallel_layout import coordinates, rank_at, rank_stages

__all__ = ["Placement", "global_shapes", "placements", "boxes_of_range"]


@dataclass(frozen=True)
class Placement:
    name: str                      # in the single-process model
    stage: int                     # pipeline stage holding it (0 without pipeline)
    local: str                     # its name inside that stage's module
    shape: tuple[int, ...]         # the whole tensor
    offsets: tuple[int, ...]       # where this rank's box starts in it
    sizes: tuple[int, ...]         # the box (= the local tensor's shape)
    copies: tuple[int, ...]        # global ranks holding the same box, sorted
    replicas: tuple[int, ...]      # of those, the data-parallel replicas of this rank
    first: bool                    # this rank's replicas are the first set of copies

    @property
    def whole(self) -> bool:
        return self.sizes == self.shape


@lru_cache(maxsize=64)
def _shapes(model_cfg, experts: int, top_k: int) -> tuple:
    from .model import TinyLlama
    from .moe import apply_moe
    with torch.device("meta"):
        model = TinyLlama(model_cfg)
        if experts:
            apply_moe(model, n_experts=experts, top_k=top_k)
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def global_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the single-process model of a TrainConfig (its experts included)."""
    return dict(_shapes(cfg.model_config(), cfg.experts, cfg.top_k))


_EXPERT = re.compile(r"^(blocks\.\d+\.mlp\.experts\.)(\d+)(\..*)$")


def _tp_cut(cfg, name, t):
    """How tensor parallelism cuts parameter `name` on tp rank t (tensor_parallel.TP_PLAN)."""
    from .tensor_parallel import Cut, tp_cut
    role, kind = re.sub(r"^blocks\.\d+\.", "", name).rsplit(".", 1)     # "attn.wq", "weight"
    m = cfg.model_config()
    cut = tp_cut(role, cfg.tp, t, (m.n_heads, m.n_kv_heads))
    if kind == "bias" and cut.dim == 1:             # a row-parallel bias is added once, whole
        return Cut(None, 0, 1, tuple(range(cfg.tp)))
    return cut


def placements(cfg, rank: int) -> list[Placement]:
    """Every parameter global rank `rank` holds under the TrainConfig `cfg`, stage by stage
    in each stage module's parameter order."""
    from .expert_parallel import local_experts
    c = coordinates(cfg, rank)
    shapes = global_shapes(cfg)
    ep_rank = c["dp"] % cfg.ep
    # DualPipe: pipeline ranks r and p−1−r hold the same layers, one copy per direction
    pps = sorted({c["pp"], cfg.pp - 1 - c["pp"]}) if cfg.pp > 1 and cfg.schedule == "dualpipe" \
        else [c["pp"]]
    out = []
    for stage, layers, embed, head in rank_stages(cfg, cfg.model_config().n_layers, c["pp"]):
        block_of = {g: i for i, g in enumerate(layers)}
        for name, shape in shapes.items():
            m = re.match(r"^blocks\.(\d+)\.(.*)$", name)
            if m:
                if int(m[1]) not in block_of:
                    continue
                local = f"blocks.{block_of[int(m[1])]}.{m[2]}"
            elif name.startswith("embed."):
                if not embed:
                    continue
                local = name
            elif head:
                local = name
            else:
                continue
            expert = _EXPERT.match(local)
            dp_coords = range(cfg.dp)
            if expert and cfg.ep > 1:
                held, e = local_experts(cfg.experts, cfg.ep, ep_rank), int(expert[2])
                if e not in held:
                    continue
                local = f"{expert[1]}{e - held.start}{expert[3]}"
                dp_coords = range(ep_rank, cfg.dp, cfg.ep)
            dim, index, count, tps = _tp_cut(cfg, name, c["tp"])
            offsets, sizes = [0] * len(shape), list(shape)
            if dim is not None:
                sizes[dim] = shape[dim] // count
                offsets[dim] = index * sizes[dim]
            replicas = tuple(sorted(rank_at(cfg, pp=q, dp=d, cp=k, tp=c["tp"])
                                    for q in pps for d in dp_coords for k in range(cfg.cp)))
            copies = tuple(sorted(rank_at(cfg, pp=q, dp=d, cp=k, tp=t)
                                  for q in pps for d in dp_coords for k in range(cfg.cp) for t in tps))
            out.append(Placement(name, stage, local, tuple(shape), tuple(offsets), tuple(sizes),
                                 copies, replicas, c["tp"] == tps[0]))
    return out


def boxes_of_range(sizes: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """The elements [lo, hi) of a row-major tensor of shape `sizes`, flattened, as boxes:
    [(offsets, box sizes, start in the range)] — one for a 1-D tensor, at most three for a
    2-D one (the end of a first row, whole rows, the start of a last row)."""
    if hi <= lo:
        return []
    if len(sizes) == 1:
        return [((lo,), (hi - lo,), 0)]
    if len(sizes) != 2:
        raise ValueError(f"boxes of a range: 1-D or 2-D tensors only, not {sizes}")
    cols, out, at = sizes[1], [], lo
    while at < hi:
        row, col = divmod(at, cols)
        if col or hi - at < cols:                     # a part of one row
            n = min(cols - col, hi - at)
            out.append(((row, col), (1, n), at - lo))
        else:                                         # whole rows
            n = (hi - at) // cols * cols
            out.append(((row, 0), (n // cols, cols), at - lo))
        at += n
    return out
