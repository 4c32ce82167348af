"""The ranks as a named grid: which ranks share a pipeline stage, a data shard, a slice of
the sequence, a slice of every weight (lesson 10 puts all of them together).

With dp = 2 and tp = 2 on 4 ranks the grid is

             tp=0  tp=1
    dp=0  [  0,    1  ]      rank 1 holds tp slice 1 of data shard 0;
    dp=1  [  2,    3  ]      ranks 0 and 2 hold the same slice of different data

Each technique talks to the ranks along its own dimension — TP all-reduces over a row,
DP over a column — so each needs a process group per row (or column). A `Mesh` makes
them all once, named, and hands a technique the group of its dimension: it is passed
explicitly, never global. The dimensions run outermost to innermost pp, dp, cp, tp, so
the ranks of one TP group are neighbours (on a cluster: one node, the fastest links).

Underneath is PyTorch's `DeviceMesh` (`init_device_mesh`), the API production code uses:
it lays the ranks out in a tensor of that shape and calls `new_group` for every row of
every dimension. A group over several dimensions (say dp and cp together, over which a
loss is averaged) is a flattened view of the grid; the first request for one is a
collective call that every rank makes.

Expert parallelism (lesson 09) is not a fifth axis: it views dp as two, (dp/ep, ep). With
dp = 4, ep = 2 the dp coordinates 0 1 | 2 3 form two ep blocks. The ranks of one block
share a layer's experts, E/ep each (`group("ep")`); the ranks at the same place in every
block — over cp too — hold the same experts, and average their gradients (`group("edp")`,
expert data parallel). `expert_groups(ep)` makes that view once; `layout()` then lists
every group this rank belongs to, ep and edp included. No other file calls `new_group`.

DualPipe (lesson 07) is not an axis either: it keeps every stage twice, on pipeline ranks
r and p−1−r (one copy per direction). `pairs()` views pp as (p/2 pairs, 2): `group("pair")`
is this rank and its mirror; `group("pair", "dp", "cp")` every rank that holds a copy of
this rank's weights, the group the data-parallel wrapper reduces their gradients over.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .torch_compat import flatten, unflatten

__all__ = ["DIMS", "EXPERT_DIMS", "PAIR_DIM", "Mesh", "check_mesh", "dim_group"]

DIMS = ("pp", "dp", "cp", "tp")  # outermost → innermost
EXPERT_DIMS = ("ep", "edp")      # views of dp (and cp), made by Mesh.expert_groups
PAIR_DIM = "pair"                # a view of pp (DualPipe's mirror ranks), made by Mesh.pairs


def check_mesh(world_size: int, **sizes: int) -> dict[str, int]:
    """Validate degrees before any process starts: known names, positive ints, product ==
    world size. Returns every dimension's size (1 where not given)."""
    unknown = set(sizes) - set(DIMS)
    if unknown:
        raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}; known: {list(DIMS)}")
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, not {n!r}")
    full = {name: sizes.get(name, 1) for name in DIMS}
    if math.prod(full.values()) != world_size:
        product = " × ".join(f"{k}={v}" for k, v in full.items() if v > 1) or "1"
        raise ValueError(f"the mesh {product} has {math.prod(full.values())} ranks, but the "
                         f"world has {world_size}")
    return full


class Mesh:
    """Named dimensions over all ranks: `Mesh(dp=2, tp=2)` (unnamed dimensions have size 1).

        mesh.size("tp")          # 2
        mesh.coordinate("dp")    # this rank's index along dp
        mesh.group("tp")         # the ProcessGroup of this rank's TP row
        mesh.group("dp", "cp")   # the ranks that share everything but dp and cp
        mesh.peers("pp")         # global ranks along pp through this rank, in order
        mesh.spanned([0, 1, 3])  # the dimensions along which these global ranks differ
        mesh.expert_groups(2)    # dp as (dp/2, ep=2): the ep and edp groups (lesson 09)
        mesh.pairs()             # pp as (pp/2, pair=2): DualPipe's mirror ranks (lesson 07)
        mesh.group("pair", "dp") # then: every holder of this rank's weights
        print(mesh.describe())   # every group this rank talks over
    """

    def __init__(self, device_type: str = "cpu", *, device: str | torch.device | None = None,
                 **sizes: int):
        """`device_type`: the DeviceMesh's ("cpu", or "cuda" under NCCL). `device`: where this
        rank's tensors live, handed to whatever builds or moves them (`mesh.device`); by
        default the current GPU for "cuda", else the CPU (the dry run passes "meta")."""
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: build it inside a rank")
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                      else torch.device(device_type))
        self.device = torch.device(device)
        self.sizes = check_mesh(dist.get_world_size(), **sizes)
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, tuple(self.sizes.values()), mesh_dim_names=DIMS)
        self._flat: dict[tuple[str, ...], DeviceMesh] = {}
        self.ep: int | None = None    # set by expert_groups
        self._expert: dict[str, dist.ProcessGroup] = {}
        self._pairs: DeviceMesh | None = None   # set by pairs()

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.sizes.items() if v > 1) or "one rank"
        return f"Mesh({shown})" + (f" with ep={self.ep}" if self.ep is not None else "")

    def _check(self, names) -> tuple[str, ...]:
        if not names:
            raise ValueError("name at least one dimension")
        for n in names:
            if n in EXPERT_DIMS:
                raise ValueError(f"{n!r} is a view of dp: call mesh.expert_groups(ep) first, "
                                 f"then mesh.group({n!r}) alone")
            if n not in DIMS:
                raise ValueError(f"unknown mesh dimension {n!r}; known: {list(DIMS)}")
        return tuple(sorted(set(names), key=DIMS.index))  # the grid's order, once each

    def size(self, *names: str) -> int:
        """Ranks along these dimensions together (all of them when none is named)."""
        return math.prod(self.sizes[n] for n in self._check(names)) if names else \
            math.prod(self.sizes.values())

    def coordinate(self, name: str) -> int:
        """This rank's index along one dimension."""
        (name,) = self._check((name,))
        return self.device_mesh.get_local_rank(name)

    def group(self, *names: str) -> dist.ProcessGroup:
        """The group of the ranks that differ from this one only along `names`; or, after
        `expert_groups`, group("ep") / group("edp")."""
        if len(names) == 1 and names[0] in self._expert:
            return self._expert[names[0]]
        if PAIR_DIM in names:
            return self._pair_group(names)
        names = self._check(names)
        if len(names) == 1:
            return self.device_mesh.get_group(names[0])
        if names not in self._flat:  # collective: every rank asks for it, in the same order
            self._flat[names] = flatten(self.device_mesh[names], "_".join(names))
        return self._flat[names].get_group()

    def peers(self, name: str) -> list[int]:
        """Global ranks along `name` through this rank, ordered by their coordinate."""
        return dist.get_process_group_ranks(self.group(name))

    def expert_groups(self, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(ep group, edp group) of this rank: dp viewed as (dp/ep, ep) on the DeviceMesh.
        ep: `ep` consecutive dp coordinates, which split each MoE layer's experts; edp: the
        ranks at the same place of every ep block and every cp coordinate, which hold the same
        experts. Collective the first time (every rank calls it); one ep per mesh."""
        dp = self.sizes["dp"]
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"ep must be a positive int, not {ep!r}")
        if dp % ep:
            raise ValueError(f"the ep size {ep} must divide dp={dp} (EP groups are made of dp ranks)")
        if self.ep is not None and ep != self.ep:
            raise ValueError(f"this mesh's experts are laid out over ep={self.ep} already")
        if self.ep is None:
            view = _split_dp(self.device_mesh, ep)      # (pp, ep_block, ep, cp, tp)
            self._expert = {"ep": view.get_group("ep"),
                            "edp": flatten(view["ep_block", "cp"], "edp").get_group()}
            self.ep = ep
        return self._expert["ep"], self._expert["edp"]

    def pairs(self) -> dist.ProcessGroup:
        """DualPipe's pairs: pp viewed as (pp/2 pairs, pair=2), pipeline rank r paired with
        p−1−r (the two ranks that hold the same layers, one copy per direction). Returns
        group("pair"); afterwards "pair" combines with dp, cp, tp in `group`. Collective the
        first time (every rank calls it); needs an even pp."""
        if self._pairs is None:
            p = self.sizes["pp"]
            if p % 2:
                raise ValueError(f"DualPipe pairs pipeline rank r with p−1−r: pp={p} must be even")
            grid = self.device_mesh.mesh                    # (pp, dp, cp, tp) of global ranks
            order = list(range(p // 2)) + list(range(p - 1, p // 2 - 1, -1))
            view = grid[order].reshape(2, p // 2, *grid.shape[1:]).transpose(0, 1)
            self._pairs = DeviceMesh(self.device_mesh.device_type, view.contiguous(),
                                     mesh_dim_names=("pairs", PAIR_DIM, *DIMS[1:]))
        return self._pairs.get_group(PAIR_DIM)

    def _pair_group(self, names) -> dist.ProcessGroup:
        if self._pairs is None:
            raise ValueError("'pair' is a view of pp: call mesh.pairs() first")
        others = [n for n in names if n != PAIR_DIM]
        rest = self._check(others) if others else ()
        if "pp" in rest:
            raise ValueError("'pair' is part of pp: name pair or pp, not both")
        key = (PAIR_DIM, *rest)
        if not rest:
            return self._pairs.get_group(PAIR_DIM)
        if key not in self._flat:   # collective: every rank asks for it, in the same order
            self._flat[key] = flatten(self._pairs[key], "_".join(key))
        return self._flat[key].get_group()

    def layout(self) -> dict[str, list[int]]:
        """Every group this rank talks over, as global ranks in group order: pp, dp, cp, tp,
        the multi-dimension groups asked for so far ("dp+cp"), ep, edp and pair once made."""
        out = {n: self.peers(n) for n in DIMS}
        if self._pairs is not None:
            out[PAIR_DIM] = dist.get_process_group_ranks(self._pairs.get_group(PAIR_DIM))
        out.update({"+".join(names): dist.get_process_group_ranks(m.get_group())
                    for names, m in self._flat.items()})
        out.update({n: dist.get_process_group_ranks(g) for n, g in self._expert.items()})
        return out

    def describe(self) -> str:
        """`layout()` as text, under this rank's coordinates."""
        where = " ".join(f"{n}={self.coordinate(n)}" for n in DIMS)
        if self.ep is not None:
            where += f" ep={dist.get_rank(self._expert['ep'])}"
        lines = [f"rank {dist.get_rank()} of {self!r}: {where}"]
        lines += [f"  {name:<6} {ranks}" for name, ranks in self.layout().items()]
        return "\n".join(lines)


    def spanned(self, ranks) -> tuple[str, ...]:
        """The dimensions along which the global `ranks` differ: ("tp",) for a TP group,
        ("dp", "cp") for the replicas of a dp × cp run, ("pp",) for two neighbouring stages."""
        grid = self.device_mesh.mesh
        coords = [(grid == r).nonzero()[0].tolist() for r in ranks]
        return tuple(d for i, d in enumerate(DIMS) if len({c[i] for c in coords}) > 1)


def _split_dp(device_mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The grid with dp unflattened into (ep_block, ep): PyTorch's own (`torch_compat.unflatten`,
    recent torch) reuses the mesh's backend; before it, a second DeviceMesh over the same ranks
    reshaped."""
    dp = device_mesh.size(DIMS.index("dp"))
    names = ("pp", "ep_block", "ep", "cp", "tp")
    split = unflatten(device_mesh, "dp", DIMS.index("dp"), (dp // ep, ep), names[1:3])
    if split is not None:
        return split
    grid = device_mesh.mesh
    shape = (grid.shape[0], dp // ep, ep, *grid.shape[2:])
    return DeviceMesh(device_mesh.device_type, grid.reshape(shape), mesh_dim_names=names)


def dim_group(mesh_or_group, name: str):
    """The process group of dimension `name`: from a Mesh, its group; a process group (or
    None, all ranks) is returned as it is. Lets a transform take either."""
    return mesh_or_group.group(name) if isinstance(mesh_or_group, Mesh) else mesh_or_group
