"""Expert parallelism (EP): each rank of an `ep` group holds E/ep whole experts, and the
tokens travel to their experts and back (lesson 09).

The router runs where the tokens are (every rank, the same replicated router). Then, in
`dispatch_combine`, the core that opens this file (Fig. 8a of the MoE-parallelism surveys,
GShard; lesson 09 shows it):

    1. sort:      line this rank's kept assignments up by expert (destination rank order);
    2. exchange:  all-to-all of the counts: rank j learns how many rows each rank sends
                  to each of its experts (the split sizes of the next two collectives);
    3. dispatch:  all-to-all of the rows (uneven splits);
    4. experts:   regroup what arrived (source-major) expert by expert, run the local experts,
                  put the rows back in arrival order;
    5. combine:   all-to-all back (the splits swapped);
    6. un-permute: weight each row by its gate and scatter-add it into its token.

`all_to_all` below is an autograd function whose backward is the all-to-all with the
splits swapped, so the backward of dispatch is a combine and vice versa. The alternative
dispatcher (`dispatcher="allgather"`, Megatron's all-gather token dispatcher) all-gathers
every rank's tokens and routing, lets each rank compute its experts' share for all of
them, and reduce-scatters the sums back: (ep−1)·T·h per rank each way, against about
k·(ep−1)/ep·T·h for the all-to-all.

Where EP lives on the mesh: the ep group is a sub-group of the **data-parallel** ranks
(consecutive dp coordinates, ep of them; ep must divide dp) — the mesh views dp as
(dp/ep, ep) and hands out both groups (`Mesh.expert_groups`, `mesh.group("ep")`). Non-expert weights are
replicated on every dp rank as before; an expert's weights are replicated on the dp/ep
ranks with the same position in their ep group (expert-data-parallel, "edp"). So DDP sums
the experts' gradients over edp only, and still divides by dp: the expert on one rank
received the tokens of all ep ranks of its group (`expert_gradient_groups` gives DDP that
mapping). Under tensor parallelism the attention is split over tp and the MoE runs whole
on every tp rank of an EP rank (the ep groups of different tp coordinates are disjoint).
Under context parallelism each cp coordinate has its own ep groups, and the cp ranks hold
the same experts: edp spans cp too, and DDP/ZeRO divide by dp × cp like the rest.

Token groups: each rank's micro-batch is one group for capacity and the balancing loss
(picolib.moe), so the reference is one process with `token_groups` = dp.

`apply_expert_parallel(model, mesh, n_experts=, top_k=, ep=None, ...)` installs it in
place (after tensor parallelism, before pipeline stages and data parallelism).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .mappings import all_gather_to_region, gather_along, reduce_scatter_to_region
from .mesh import Mesh
from .moe import (MoE, Routing, build_moe_layers, check_moe, install, moe_layers, run_experts,
                  sort_by_expert)

__all__ = ["DISPATCHERS", "dispatch_combine", "run_local_experts", "all_to_all", "exchange_counts",
           "group_by_local_expert", "local_experts",
           "ExpertParallelMoE", "expert_groups", "apply_expert_parallel",
           "expert_gradient_groups", "all_to_all_bytes"]

DISPATCHERS = ("alltoall", "allgather")


# ------------------------------------------------------------------ the core: dispatch and combine

def dispatch_combine(x, routing: Routing, experts, top_k: int, group=None):
    """The all-to-all dispatcher: each kept assignment's row travels to the rank holding its
    expert (`experts`: this rank's E/ep), runs there, and comes back weighted by its gate."""
    ep = dist.get_world_size(group)
    order, counts = sort_by_expert(routing.choice, routing.keep, len(experts) * ep)  # 1. sort
    recv_counts = exchange_counts(counts, group, balanced=routing.choice.is_meta)  # 2. splits
    send, recv = counts.view(ep, -1).sum(1).tolist(), recv_counts.sum(1).tolist()
    arrived = all_to_all(x[order // top_k], recv, send, group)                     # 3. dispatch
    y = run_local_experts(experts, arrived, recv_counts)                           # 4. experts
    back = all_to_all(y, send, recv, group)                                        # 5. combine
    gates = routing.gates.reshape(-1)[order, None]                                 # 6. unsort
    return torch.zeros_like(x).index_add(0, order // top_k, back * gates)


def run_local_experts(experts, arrived, recv_counts):
    """Rows arrive source by source; regroup them expert by expert, run each local expert
    on its block, and put the results back in arrival order."""
    perm = group_by_local_expert(recv_counts).to(arrived.device)
    y = run_experts(experts, arrived[perm], recv_counts.sum(0))
    return torch.empty_like(y).index_copy(0, perm, y)


# ------------------------------------------------------------------ the all-to-all and its pieces

def all_to_all(x, recv_splits: list[int], send_splits: list[int], group=None):
    """Send `send_splits[j]` rows of `x` to rank j, receive `recv_splits[j]` from rank j."""
    return _AllToAll.apply(x, list(recv_splits), list(send_splits), group)


class _AllToAll(torch.autograd.Function):
    """Forward: rows [sum(send[:j]), sum(send[:j+1])) go to rank j; backward: the same with
    the splits swapped (the gradient of a dispatch is a combine)."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), group=group, output_split_sizes=recv_splits,
                        input_split_sizes=send_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), send_splits, recv_splits, ctx.group), None, None, None


def exchange_counts(counts: torch.Tensor, group=None, balanced: bool = False) -> torch.Tensor:
    """counts (E,): rows this rank sends to each expert → (ep, E/ep): rows each rank sends to
    each of this rank's experts (one small all-to-all). `balanced` (meta tensors, the dry
    run): every rank is assumed to send as this one (picolib.moe's balanced routing)."""
    ep = dist.get_world_size(group)
    out = torch.empty_like(counts)
    comm.all_to_all(out, counts.contiguous(), group=group)
    if balanced:
        return counts.view(ep, -1)[dist.get_rank(group)].expand(ep, -1)
    return out.view(ep, counts.numel() // ep)


def group_by_local_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive source-major ((source 0: expert 0, 1, ...), (source 1: ...)); the
    permutation that makes them expert-major (all of expert 0, then expert 1, ...)."""
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    ep, local = recv_counts.shape
    at = recv_counts.device
    pieces = [torch.arange(int(starts[s * local + e]), int(starts[s * local + e] + flat[s * local + e]),
                           device=at)
              for e in range(local) for s in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=at)


def local_experts(n_experts: int, ep: int, rank: int) -> range:
    """The experts rank `rank` of an ep group keeps: [r·E/ep, (r+1)·E/ep)."""
    n_local = n_experts // ep
    return range(rank * n_local, (rank + 1) * n_local)


class ExpertParallelMoE(MoE):
    """A MoE layer whose experts are spread over `group`: this rank keeps experts
    [r·E/ep, (r+1)·E/ep) of `moe` (shared modules, not copies); the router and the shared
    expert stay replicated. `replica_group`: the ranks holding the same experts (edp), or
    None when there are none. Each rank's tokens are one token group."""

    def __init__(self, moe: MoE, group=None, dispatcher: str = "alltoall", replica_group=None):
        torch.nn.Module.__init__(self)
        ep, r = dist.get_world_size(group), dist.get_rank(group)
        check_moe(moe.n_experts, moe.top_k, moe.capacity_factor, moe.router.score, ep)
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {dispatcher!r}; known: {list(DISPATCHERS)}")
        self.n_experts, self.top_k, self.capacity_factor = moe.n_experts, moe.top_k, moe.capacity_factor
        self.token_groups, self.group, self.dispatcher = 1, group, dispatcher
        self.replica_group, self.ep, self.ep_rank = replica_group, ep, r
        self.n_local = moe.n_experts // ep
        self.router, self.shared = moe.router, moe.shared
        held = local_experts(moe.n_experts, ep, r)
        self.experts = torch.nn.ModuleList(moe.experts[held.start:held.stop])
        self.aux_loss = self.load = self.dropped = None
        self.aux_weight = 0.0     # > 0: the backward adds the aux loss (aux_loss_in_backward)
        self.stats_group = None   # the ranks sharing each token group (aux_loss_in_backward)

    def dispatch_combine(self, x, routing: Routing):
        if self.dispatcher == "allgather":
            return self._allgather(x, routing)
        return dispatch_combine(x, routing, self.experts, self.top_k, self.group)

    def _allgather(self, x, routing: Routing):
        """All-gather tokens, gates, choices; compute this rank's experts' share for every
        token of the group; reduce-scatter the sums (autograd: conjugate operators)."""
        k, first = self.top_k, self.ep_rank * self.n_local
        x_all = all_gather_to_region(x, 0, self.group)
        gates_all = all_gather_to_region(routing.gates, 0, self.group)
        choice_all = gather_along(routing.choice, 0, self.group)
        keep_all = gather_along(routing.keep.to(torch.uint8), 0, self.group).bool()
        mine = keep_all & (choice_all >= first) & (choice_all < first + self.n_local)
        order, counts = sort_by_expert(choice_all, mine, self.n_experts)
        y = run_experts(self.experts, x_all[order // k], counts[first:first + self.n_local])
        y = y * gates_all.reshape(-1)[order, None]
        partial = torch.zeros_like(x_all).index_add(0, order // k, y)
        return reduce_scatter_to_region(partial, 0, self.group)


def all_to_all_bytes(routings, n_experts: int, hidden: int,
                     bytes_per_element: int = 4) -> list[dict[str, int]]:
    """Bytes each rank of an EP group sends in one forward of the all-to-all dispatcher,
    from the group's routings (rank order): the counts (E/ep int64 to each other rank),
    dispatch (its kept rows bound for other ranks' experts), combine (the rows other ranks
    sent it, going back). What `comm.Ledger` measures; backward sends the same again."""
    ep = len(routings)
    n_local = n_experts // ep
    rows = torch.stack([torch.bincount(r.choice[r.keep] // n_local, minlength=ep)
                        for r in routings])           # rows[i, j]: rank i → rank j
    row = hidden * bytes_per_element
    return [{"counts": (ep - 1) * n_local * 8,
             "dispatch": int(rows[i].sum() - rows[i, i]) * row,
             "combine": int(rows[:, i].sum() - rows[i, i]) * row} for i in range(ep)]


def expert_groups(mesh: Mesh, ep: int):
    """(ep group, edp group) of this rank, from the mesh (`Mesh.expert_groups`: dp viewed as
    (dp/ep, ep) blocks; edp spans cp too). Every rank must call it (it makes process groups)."""
    return mesh.expert_groups(ep)


def apply_expert_parallel(model, mesh, *, n_experts: int, top_k: int, ep: int | None = None,
                          expert_hidden: int | None = None, router: str = "softmax",
                          capacity_factor: float | None = None, shared_hidden: int = 0,
                          normalize: bool | None = None, dispatcher: str = "alltoall",
                          aux_weight: float = 0.01):
    """Every block's MLP becomes an `ExpertParallelMoE`, in place; `model.loss` adds the
    balancing loss. `mesh`: a Mesh (EP over `ep` of its dp ranks, default all of them; the
    remaining dp/ep copies of each expert form its edp group) or a process group (EP over
    all of it, no expert replicas). Bad sizes raise before any collective."""
    check_moe(n_experts, top_k, capacity_factor, router, ep or 1)
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {dispatcher!r}; known: {list(DISPATCHERS)}")
    if isinstance(mesh, Mesh):
        ep = ep or mesh.size("dp")
        check_moe(n_experts, top_k, capacity_factor, router, ep)
        if mesh.size("dp") % ep:
            raise ValueError(f"the ep size {ep} must divide dp={mesh.size('dp')} "
                             "(EP groups are made of dp ranks)")
        if moe_layers(model):
            raise ValueError("this model has MoE layers already")
        group, replicas = expert_groups(mesh, ep)
    else:
        size = dist.get_world_size(mesh)
        if ep is not None and ep != size:
            raise ValueError(f"ep={ep} but the group has {size} ranks")
        check_moe(n_experts, top_k, capacity_factor, router, size)
        group, replicas = mesh, None
    layers = build_moe_layers(model, n_experts, top_k, expert_hidden, router, capacity_factor,
                              shared_hidden, 1, normalize)
    layers = [ExpertParallelMoE(m, group, dispatcher, replicas) for m in layers]
    return install(model, layers, aux_weight)


def expert_gradient_groups(model) -> dict:
    """{expert parameter: its edp group} for `DDP(model, mesh.group("dp"), groups=...)`:
    DDP sums these over edp (and divides by dp like the rest). Needs a model made expert-
    parallel over a Mesh."""
    out = {}
    for m in moe_layers(model):
        if not isinstance(m, ExpertParallelMoE) or m.replica_group is None:
            raise ValueError("expert gradient groups need apply_expert_parallel over a Mesh")
        out.update({p: m.replica_group for p in m.experts.parameters()})
    return out
