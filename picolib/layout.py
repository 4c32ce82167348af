"""Where a parameter lives (lessons 10-11): one description per parameter of its place on
the mesh, which gradient clipping (`picolib.clipping`), sharded checkpoints
(`picolib.checkpoint`) and the dry run all read, so none of them re-derives it.

For each parameter a rank holds, `placements(cfg, rank)` gives a `Placement`:
- `name`: its name in the single-process model (`blocks.5.attn.wq.weight`), `stage` and
  `local`: the pipeline stage that holds it and its name inside that stage's module
  (stage 1 of two calls block 5 `blocks.1`; expert 3 of four over ep=2 is local expert 1);
- `shape`: the whole tensor's shape; `offsets`, `sizes`: the box of the whole tensor this
  rank's tensor is — tensor parallelism cuts along dim 0 (column-parallel q, k, v, gate, up,
  the vocabulary of the embedding and the head) or dim 1 (row-parallel o, down); a KV head
  is held by tp/kv ranks when tp > kv heads; norms, routers and experts are whole;
- `copies`: every global rank that holds this same box with the same values (data- and
  context-parallel replicas, the tp ranks that share a norm or a KV head, an expert's
  replicas over dp/ep, DualPipe's mirror pipeline rank); `replicas`: those of them the
  data-parallel wrapper reduces the gradient over (this rank's dp × cp ranks, an expert's edp
  ranks, with DualPipe both ranks of the pair times those); the copies are these
  replicas times the tp ranks that share the box, and `first` says whether this rank's
  replicas are the first of them (the one set that counts or writes a copied box).

It is a pure function of the configuration and the rank's mesh coordinates — no process
group, no tensor — so it can describe any rank of a cluster this machine cannot run
(`placements(cfg, rank)` for rank 639 of 640). `tests/lib/test_layout.py` checks it against the
transformed modules: every rank's tensor, put in its box, is the single-process tensor.

What the data-parallel wrapper does inside a box (DDP keeps it whole on every replica; ZeRO
keeps one flat shard of a unit of parameters) is read through `holdings`, the one function
here that looks inside the wrappers: per parameter, the element range of its flattened
local tensor that this rank holds (the optimizer updates) and the part of it this rank
answers for (disjoint over the replicas: each element once), with views of the master
values, the reduced gradient and the optimizer state.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from .parallel_layout import coordinates, rank_at

__all__ = ["Placement", "global_shapes", "stage_layers",
           "placements", "boxes_of_range", "Held", "Holdings", "holdings"]


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


def stage_layers(cfg, pp: int) -> list[tuple[int, range, bool, bool]]:
    """[(stage, its blocks, embeds?, has the head?)] of the pipeline rank `pp`."""
    n_layers = cfg.model_config().n_layers
    if cfg.pp == 1:
        return [(0, range(n_layers), True, True)]
    from .parallel_layout import stage_ranges
    sched = cfg.make_schedule()
    out = []
    for stages, _ in sched.pipes:          # DualPipe: each of its two pipelines cuts the model
        parts = stage_ranges(n_layers, len(stages))
        out += [(s, parts[i], i == 0, i == len(stages) - 1) for i, s in enumerate(stages)
                if sched.stage_ranks[s] == pp]
    return sorted(out, key=lambda x: x[0])


_ROW = re.compile(r"(attn\.wo|mlp\.w_down)\.weight$")              # cut along dim 1
_COLUMN = re.compile(r"(^embed|^lm_head|attn\.wq|mlp\.w_gate|mlp\.w_up)\.weight$")  # dim 0
_KV = re.compile(r"attn\.w[kv]\.weight$")
_EXPERT = re.compile(r"^(blocks\.\d+\.mlp\.experts\.)(\d+)(\..*)$")


def _tp_box(cfg, name, shape, t):
    """(dim or None, index, count, tp coordinates sharing the box) of tp rank t."""
    T = cfg.tp
    if T == 1 or _EXPERT.match(name) or not (_ROW.search(name) or _COLUMN.search(name) or _KV.search(name)):
        return None, 0, 1, tuple(range(T))          # whole on every tp rank
    if _KV.search(name):
        from .tensor_parallel import kv_heads_per_rank
        m = cfg.model_config()
        _, rep = kv_heads_per_rank(m.n_heads, m.n_kv_heads, T)
        slot = t // rep
        return 0, slot, T // rep, tuple(range(slot * rep, (slot + 1) * rep))
    return (1 if _ROW.search(name) else 0), t, T, (t,)


def placements(cfg, rank: int) -> list[Placement]:
    """Every parameter global rank `rank` holds under the TrainConfig `cfg`, stage by stage
    in each stage module's parameter order."""
    c = coordinates(cfg, rank)
    shapes = global_shapes(cfg)
    per_ep = cfg.experts // cfg.ep if cfg.experts else 0
    ep_rank = c["dp"] % cfg.ep
    # DualPipe: pipeline ranks r and p−1−r hold the same layers, one copy per direction
    pps = sorted({c["pp"], cfg.pp - 1 - c["pp"]}) if cfg.pp > 1 and cfg.schedule == "dualpipe" \
        else [c["pp"]]
    out = []
    for stage, layers, embed, head in stage_layers(cfg, c["pp"]):
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
                e = int(expert[2])
                if e // per_ep != ep_rank:
                    continue
                local = f"{expert[1]}{e - ep_rank * per_ep}{expert[3]}"
                dp_coords = range(ep_rank, cfg.dp, cfg.ep)
            dim, index, count, tps = _tp_box(cfg, name, shape, c["tp"])
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


# --------------------------------------------------------------------------- inside the wrappers

@dataclass
class Held:
    """One parameter on this rank: the elements [lo, hi) of its flattened local tensor that
    this rank holds (its optimizer updates them), [own_lo, own_hi) ⊆ [lo, hi) the ones it
    answers for (each element of the box on exactly one of the replicas), and flat views of
    the held range: fp32 master `value`, reduced `grad` (None before a backward) and the
    optimizer `state` {exp_avg, exp_avg_sq}."""
    name: str
    lo: int
    hi: int
    own_lo: int
    own_hi: int
    value: torch.Tensor
    grad: torch.Tensor | None
    state: dict = field(default_factory=dict)


class Holdings:
    """What one data-parallel wrapper (DDP with its torch.optim optimizer, or ZeRO) holds:
    `items` (one `Held` per parameter), the optimizer's `step`, and `after_load()`, which
    makes the wrapper's other copies agree with values written into the `Held` views."""

    def __init__(self, items, get_step, set_step, after_load):
        self.items, self._get, self._set, self.after_load = items, get_step, set_step, after_load

    @property
    def step(self) -> int:
        return self._get()

    @step.setter
    def step(self, n: int):
        self._set(n)


STATE = ("exp_avg", "exp_avg_sq")


def _own(n: int, r: int, lo: int, hi: int) -> tuple[int, int]:
    from .flat import shard_bounds
    a, b = shard_bounds(hi - lo, n, r)
    return lo + min(a, hi - lo), lo + min(b, hi - lo)


def _fresh_state(optimizer, p) -> dict:
    """`optimizer.state[p]`, created as AdamW's first step would (zeros, step 0) if absent,
    so a checkpoint can be loaded into it."""
    st = optimizer.state[p]
    if "exp_avg" not in st:
        st.update(step=torch.tensor(0.0), **{k: torch.zeros_like(p) for k in STATE})
    return st


def holdings(wrapper, optimizer=None, create_state: bool = True) -> Holdings:
    """The one reader of DDP's and ZeRO's internals (see the module docstring). The
    optimizer is the wrapper's own (`wrapper.optimizer`, the data-parallel contract);
    `optimizer` is only for a DDP that does not own one. With `create_state` the optimizer's
    state is created (zeros, step 0, as its first step would) where it does not exist yet,
    so a checkpoint can be loaded into it; without, such a `Held` has no state."""
    optimizer = getattr(wrapper, "optimizer", None) or optimizer
    if hasattr(wrapper, "units"):                                   # ZeRO
        from .flat import shard_bounds
        items, pieces = [], []
        for u, group in zip(wrapper.units, wrapper._groups):
            lo, hi = shard_bounds(u.numel, dist.get_world_size(group), dist.get_rank(group))
            grad = u.master.grad if u.master.grad is not None else u.grad   # what the optimizer reads
            states = []
            for _, pa, pb, piece in u.pieces:    # each a view of the master: what the optimizer steps
                st = _fresh_state(optimizer, piece) if create_state else optimizer.state.get(piece, {})
                states.append((pa, pb, st))
                pieces.append(piece)
            at = 0
            for name, p in zip(u.names, u.params):
                a, b = max(lo, at), min(hi, at + p.numel())
                if a < b:                         # a parameter lies inside one piece (one group)
                    sa, sb = a - lo, b - lo
                    pa, _, st = next(x for x in states if x[0] <= sa and sb <= x[1])
                    items.append(Held(name, a - at, b - at, a - at, b - at, u.master.detach()[sa:sb],
                                      grad[sa:sb], {k: st[k][sa - pa:sb - pa] for k in STATE if k in st}))
                else:
                    items.append(Held(name, 0, 0, 0, 0, u.master.detach()[:0], grad[:0], {}))
                at += p.numel()

        def set_step(n):
            wrapper.steps = n
            for piece in pieces:
                if piece in optimizer.state:
                    optimizer.state[piece]["step"] = torch.tensor(float(n))

        def after_load():
            from . import comm
            with torch.no_grad():
                for u, group in zip(wrapper.units, wrapper._groups):
                    if u.shard.data_ptr() != u.master.data_ptr():
                        u.shard.copy_(u.master)
                    if wrapper.stage < 3:
                        comm.all_gather(u.full, u.shard, group=group)
        return Holdings(items, lambda: wrapper.steps, set_step, after_load)

    groups = {id(p): b.group for b in wrapper.buckets for p in b.params}     # DDP
    items, params = [], []
    for name, p in wrapper.module.named_parameters():
        if not p.requires_grad:
            continue
        g = groups.get(id(p)) or wrapper.group
        st = _fresh_state(optimizer, p) if create_state else optimizer.state.get(p, {})
        own = _own(dist.get_world_size(g), dist.get_rank(g), 0, p.numel())
        items.append(Held(name, 0, p.numel(), *own, p.detach().view(-1),
                          None if p.grad is None else p.grad.view(-1),
                          {k: st[k].view(-1) for k in STATE if k in st}))
        params.append(p)

    def set_step(n):
        for p in params:
            optimizer.state[p]["step"] = torch.tensor(float(n))
    return Holdings(items, lambda: int(optimizer.state.get(params[0], {}).get("step", 0)) if params else 0,
                    set_step, lambda: None)
