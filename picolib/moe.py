"""Mixture of experts: a router sends each token to k of E SwiGLU experts (lesson 09).

A MoE layer replaces a block's SwiGLU MLP (`block.mlp`). A dense MLP runs every token
through one FFN; a MoE layer holds E of them and a *router* picks k per token, so the
parameters grow E× while the FLOPs per token grow only k× (with experts of the dense
size). For token x:

    scores  = softmax(x W_rᵀ)          (Switch, GShard, Mixtral)   or   sigmoid(x W_rᵀ) (DeepSeek-V3)
    choice  = top-k of (scores + bias)  the bias only steers the choice (auxiliary-loss-free balancing)
    gates   = scores at the choice      normalised to sum 1 with `normalize` (default: sigmoid only)
    y       = Σ_j gates_j · expert_{choice_j}(x)  [+ shared_expert(x)]

The core opens the file (lesson 09 shows it): the `Router` (scores, top-k, gates),
`sort_by_expert` and `run_experts`; `MoE.dispatch_combine` puts them together in one process.
Pieces, each a plain function a lesson can call:
- `capacity(T, E, k, cf)`: ceil(cf · T·k / E) slots per expert for a group of T tokens;
  `keep_mask` drops the assignments past an expert's capacity, first choices of every
  token before second choices, earlier tokens first (GShard's priority); `capacity_factor
  = None` is dropless;
- `sort_by_expert`: the permutation that lines the kept assignments up expert by expert
  (the order expert parallelism sends them in, `picolib.expert_parallel`) and the counts;
- `balancing_loss`: Switch/GShard's E · Σ_e f_e · P_e (f: fraction of assignments to e,
  P: mean score of e), 1 when the load is even;
- `MoE.update_bias`: DeepSeek-V3's auxiliary-loss-free balancing, b_e += rate ·
  sign(mean load − load_e) after each step.

On meta tensors (the dry run, lesson 11) the router's choice has no values, so which expert
each token goes to is ASSUMED: a *balanced* routing, each expert receiving assignments/E of
the assignments (`balanced_counts`; the first experts one more when it does not divide).
`keep_mask` keeps every assignment (a capacity, whose drops depend on the values, is
refused), `sort_by_expert` returns the balanced counts (on the CPU: their sizes split the
rows), `expert_counts` a meta tensor.

Token groups: capacity and the balancing statistics are computed per *group* of tokens
(GShard's groups): the flattened batch is cut into `token_groups` equal groups along the
batch. Under expert and data parallelism each rank's micro-batch is one group, so one
process with `token_groups` = the number of data-parallel ranks is the exact reference
(same tokens dropped, same aux loss: the mean over groups).

`apply_moe(model, n_experts=, top_k=, ...)` turns every block's MLP of a TinyLlama into a
MoE layer in place and makes the model's loss part add `aux_weight` · Σ aux losses
(`MoELoss`); weights come from the model's seed alone. Under pipeline parallelism a stage's
aux losses never reach the last stage's loss: `aux_loss_in_backward(model, scale)` makes
each layer's backward add the aux loss's gradient itself instead (`AuxLossGradient`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .model import SwiGLU, TinyLlama, init_tensor

__all__ = ["ROUTERS", "check_moe", "capacity", "keep_mask", "balanced_counts", "sort_by_expert",
           "expert_counts", "run_experts",
           "balancing_loss", "Routing", "Expert", "Router", "MoE", "MoELoss", "AuxLossGradient",
           "aux_loss_in_backward", "moe_layers", "apply_moe"]

ROUTERS = ("softmax", "sigmoid")


# ------------------------------------------------------------------ the core: route, sort, run

class Router(nn.Module):
    """Scores, top-k choice and gates for (T, h) tokens (module docstring). `expert_bias`
    (a buffer, not trained by gradients) shifts the choice only."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, score: str = "softmax",
                 normalize: bool | None = None):
        super().__init__()
        check_moe(n_experts, top_k, router=score)
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.normalize = score == "sigmoid" if normalize is None else normalize
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x):
        logits = F.linear(x, self.weight).float()                    # (T, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, choice)                              # (T, k)
        if self.normalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return scores, choice, gates.to(x.dtype)


def sort_by_expert(choice: torch.Tensor, keep: torch.Tensor, n_experts: int):
    """The kept assignments (flat index t·k + j: token t's j-th choice) in expert order,
    token order within an expert, and how many each expert gets."""
    if choice.is_meta:
        return _balanced_order(choice, n_experts)
    flat = choice.reshape(-1)                                 # (T·k,) expert ids
    kept = keep.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    return order, torch.bincount(flat[kept], minlength=n_experts)


def run_experts(experts, x_sorted: torch.Tensor, counts) -> torch.Tensor:
    """Expert i on the i-th block of `counts[i]` rows (every expert runs, on zero rows too:
    each then has a gradient, zero, which data parallelism expects)."""
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    chunks = x_sorted.split(counts)
    return torch.cat([expert(c) for expert, c in zip(experts, chunks, strict=True)])


# ------------------------------------------------------------------ capacity, balance, checks

def check_moe(n_experts: int, top_k: int, capacity_factor: float | None = None,
              router: str = "softmax", ep: int = 1) -> None:
    """Raise a ValueError naming the numbers when the MoE cannot be built (before any
    process talks to another)."""
    for name, v in (("n_experts", n_experts), ("top_k", top_k), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, not {v!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} is larger than n_experts={n_experts}")
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} does not divide by the ep size {ep} "
                         "(each EP rank holds n_experts/ep whole experts)")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: dropless), not {capacity_factor!r}")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; known: {list(ROUTERS)}")


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert for a group of `tokens`: ceil(cf · tokens · k / E); None = dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def keep_mask(choice: torch.Tensor, n_experts: int, cap: int | None) -> torch.Tensor:
    """(T, k) bool: which assignments fit their expert's `cap` slots. Priority: every
    token's first choice before any second choice; within a rank, earlier tokens first.
    On meta: dropless only, every assignment kept (a CPU tensor: counted as a real one)."""
    if choice.is_meta:
        if cap is not None:
            raise NotImplementedError("the dry run cannot drop tokens past an expert's capacity: "
                                      "which ones overflow depends on the router's values")
        return torch.ones(choice.shape, dtype=torch.bool)
    if cap is None:
        return torch.ones_like(choice, dtype=torch.bool)
    queue = choice.t().reshape(-1)                        # first choices of all tokens, then second
    seen = F.one_hot(queue, n_experts).cumsum(0)          # running count per expert
    position = seen.gather(1, queue[:, None]).squeeze(1) - 1
    return (position < cap).view(choice.shape[1], choice.shape[0]).t()


def balanced_counts(assignments: int, n_experts: int) -> list[int]:
    """The routing assumed on meta tensors: each expert receives assignments/n_experts of the
    (token, choice) assignments — tokens·top_k/n_experts — the first `assignments mod
    n_experts` experts one more when it does not divide."""
    base, extra = divmod(assignments, n_experts)
    return [base + (e < extra) for e in range(n_experts)]


def _balanced_order(choice, n_experts: int):
    """sort_by_expert on meta tensors: every assignment, in order, and the `balanced_counts`
    (module docstring)."""
    return (torch.arange(choice.numel(), device=choice.device),
            torch.tensor(balanced_counts(choice.numel(), n_experts)))


def expert_counts(choice: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) how many of the assignments `choice` chose each expert (a meta tensor on meta)."""
    if choice.is_meta:
        return choice.new_empty(n_experts)
    return torch.bincount(choice.reshape(-1), minlength=n_experts)


def balancing_loss(scores: torch.Tensor, choice: torch.Tensor, n_experts: int,
                   group=None) -> torch.Tensor:
    """Switch/GShard load-balancing loss E · Σ_e f_e · P_e: f_e the fraction of the
    assignments (before drops) that chose e, P_e the mean of e's score (normalised to
    sum 1 per token). Only P carries a gradient; 1 when both are uniform. `group`: the
    ranks holding the rest of this token group (context parallelism cuts its sequences):
    f and P are taken over all of them; P's all-reduce passes each rank the gradient of its
    own tokens only, so the caller weights the loss by the group's size (the replicas'
    average divides by it)."""
    if group is None:
        f = expert_counts(choice, n_experts).to(scores.dtype) / choice.numel()
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        return n_experts * (f * p).sum()
    from . import comm
    from .mappings import reduce_from_region
    counts = expert_counts(choice, n_experts).to(scores.dtype)
    comm.all_reduce(counts, group=group)
    tokens = choice.shape[0] * dist.get_world_size(group)
    p = reduce_from_region((scores / scores.sum(-1, keepdim=True)).sum(0), group) / tokens
    return n_experts * (counts / (tokens * choice.shape[1]) * p).sum()


class Routing(NamedTuple):
    """What the router decided for T tokens: scores (T, E), choice (T, k) expert ids,
    gates (T, k) weights, keep (T, k) bool (False: dropped past capacity)."""
    scores: torch.Tensor
    choice: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor


# ------------------------------------------------------------------ the modules

class Expert(SwiGLU):
    """One expert: a SwiGLU with its own inner size."""

    def __init__(self, hidden: int, ffn_hidden: int):
        nn.Module.__init__(self)
        self.w_gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w_up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w_down = nn.Linear(ffn_hidden, hidden, bias=False)


class MoE(nn.Module):
    """MoE(hidden, n_experts, top_k, expert_hidden, router="softmax", capacity_factor=None,
    shared_hidden=0, token_groups=1, normalize=None, seed=0): (..., h) → (..., h).

    After a forward: `aux_loss` (the balancing loss, mean over token groups), `load`
    (assignments routed to each expert, (E,), before drops), `dropped` (assignments past
    capacity). `shared_hidden` > 0 adds a shared expert every token goes through
    (DeepSeek-V3). Expert parallelism replaces `dispatch_combine` (picolib.expert_parallel)."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, expert_hidden: int,
                 router: str = "softmax", capacity_factor: float | None = None,
                 shared_hidden: int = 0, token_groups: int = 1, normalize: bool | None = None,
                 seed: int = 0):
        super().__init__()
        check_moe(n_experts, top_k, capacity_factor, router)
        if isinstance(token_groups, bool) or not isinstance(token_groups, int) or token_groups < 1:
            raise ValueError(f"token_groups must be a positive int, not {token_groups!r}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.token_groups = token_groups
        self.router = Router(hidden, n_experts, top_k, router, normalize)
        self.experts = nn.ModuleList(Expert(hidden, expert_hidden) for _ in range(n_experts))
        self.shared = Expert(hidden, shared_hidden) if shared_hidden else None
        self.aux_loss = self.load = self.dropped = None
        self.aux_weight = 0.0     # > 0: the backward adds the aux loss (aux_loss_in_backward)
        self.stats_group = None   # the ranks sharing each token group (aux_loss_in_backward)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int):
        """Normal(0, 0.02) weights from a private generator, as TinyLlama's (`init_tensor`);
        `seed` is kept: a rank building only its experts replays this stream."""
        self.seed = seed
        if next(self.parameters()).is_meta:     # nothing to draw
            return
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, g))

    def route(self, x) -> Routing:
        """The router's decision for the tokens of one group, x (..., h) flattened to (T, h)."""
        x = x.reshape(-1, x.shape[-1])
        scores, choice, gates = self.router(x)
        cap = capacity(x.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        return Routing(scores, choice, gates, keep_mask(choice, self.n_experts, cap))

    def dispatch_combine(self, x, routing: Routing):
        """Σ_j gate_j · expert_j(x) over the kept assignments, every expert in this process."""
        order, counts = sort_by_expert(routing.choice, routing.keep, self.n_experts)
        y = run_experts(self.experts, x[order // self.top_k], counts)
        gates = routing.gates.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // self.top_k, y * gates)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] % self.token_groups:
            raise ValueError(f"{tokens.shape[0]} tokens do not divide into token_groups="
                             f"{self.token_groups}")
        outs, aux, load, dropped = [], [], 0, 0
        for group in tokens.chunk(self.token_groups):
            routing = self.route(group)
            outs.append(self.dispatch_combine(group, routing))
            aux.append(balancing_loss(routing.scores, routing.choice, self.n_experts, self.stats_group))
            load = load + expert_counts(routing.choice, self.n_experts)
            dropped += int((~routing.keep).sum())
        self.aux_loss, self.load, self.dropped = torch.stack(aux).mean(), load, dropped
        out = torch.cat(outs)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.aux_weight:
            out = AuxLossGradient.apply(out, self.aux_loss, self.aux_weight)
        return out.view(x.shape)

    @torch.no_grad()
    def update_bias(self, rate: float, group=None) -> torch.Tensor:
        """DeepSeek-V3's auxiliary-loss-free balancing: after a step, raise the bias of
        the experts that got fewer assignments than the mean, lower it for the others, by
        `rate`. `group`: sum the load over these ranks first (every rank the same bias).
        Returns the load used."""
        load = self.load.to(self.router.expert_bias.dtype).clone()
        if group is not None:
            from . import comm
            comm.all_reduce(load, group=group)
        self.router.expert_bias += rate * torch.sign(load.mean() - load)
        return load


# ------------------------------------------------------------------ the model part and the transform

class MoELoss(nn.Module):
    """The model's loss part plus `aux_weight` · Σ the MoE layers' aux losses: how the
    balancing loss reaches `model.loss` without changing the model's forward. The layers
    are held in a plain tuple (not submodules: their parameters belong to the blocks)."""

    def __init__(self, inner: nn.Module, layers, aux_weight: float):
        super().__init__()
        self.inner, self.aux_weight, self.layers = inner, aux_weight, tuple(layers)

    def forward(self, logits, targets):
        loss = self.inner(logits, targets)
        if self.aux_weight:
            loss = loss + self.aux_weight * sum(m.aux_loss for m in self.layers)
        return loss


class AuxLossGradient(torch.autograd.Function):
    """The identity on a MoE layer's output, whose backward also gives the layer's aux loss
    the gradient `weight`: the same gradients as adding weight · aux_loss to the final loss,
    where the final loss is out of reach (on another pipeline stage)."""

    @staticmethod
    def forward(ctx, out, aux_loss, weight: float):
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.weight), None


def aux_loss_in_backward(model: nn.Module, scale: float = 1.0, group=None) -> None:
    """Stop adding the balancing loss to `model.loss`; each MoE layer's backward adds its
    gradient instead, with weight aux_weight · `scale` (`scale`: what the caller multiplies
    each loss by, e.g. 1/m over m micro-batches). Needed before cutting the model into
    pipeline stages; the reported loss is then the language-model loss alone. `group`: the
    context-parallel ranks, which hold parts of the same sequences: each token group's
    statistics are summed over them (`balancing_loss`)."""
    loss = model.loss_fn
    if not isinstance(loss, MoELoss):
        raise ValueError("aux_loss_in_backward needs a model made MoE by apply_moe or "
                         "apply_expert_parallel")
    for m in loss.layers:
        m.aux_weight = loss.aux_weight * scale * (dist.get_world_size(group) if group else 1)
        m.stats_group = group
    loss.aux_weight = 0.0


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model`, in block order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def build_moe_layers(model: TinyLlama, n_experts: int, top_k: int, expert_hidden=None,
                     router="softmax", capacity_factor=None, shared_hidden=0, token_groups=1,
                     normalize=None) -> list[MoE]:
    """One full MoE per block, seeded by the model's seed and the block's index (so every
    rank and the single-process reference build the same weights)."""
    cfg = model.cfg
    return [MoE(cfg.hidden, n_experts, top_k, expert_hidden or cfg.ffn_hidden, router,
                capacity_factor, shared_hidden, token_groups, normalize,
                seed=cfg.seed * 1_000_003 + 7919 * (layer + 1))
            for layer in model.layers]


def install(model: TinyLlama, layers, aux_weight: float) -> TinyLlama:
    """Put `layers` in the blocks' MLP slots and wrap the loss part (refuses a model that
    has experts already)."""
    if moe_layers(model):
        raise ValueError("this model has MoE layers already")
    for block, layer in zip(model.blocks, layers, strict=True):
        dense = next(block.mlp.parameters(), None)   # the experts live where the MLP did
        block.mlp = layer if dense is None else layer.to(dense.device)
    if model.loss_fn is not None:
        model.loss_fn = MoELoss(model.loss_fn, layers, aux_weight)
    return model


def apply_moe(model: TinyLlama, *, n_experts: int, top_k: int, expert_hidden: int | None = None,
              router: str = "softmax", capacity_factor: float | None = None,
              shared_hidden: int = 0, token_groups: int = 1, normalize: bool | None = None,
              aux_weight: float = 0.01) -> TinyLlama:
    """Every block's MLP becomes a MoE layer holding all experts (the single-process
    reference of expert parallelism), in place; `model.loss` adds the balancing loss.
    `expert_hidden` defaults to the dense FFN size."""
    check_moe(n_experts, top_k, capacity_factor, router)
    layers = build_moe_layers(model, n_experts, top_k, expert_hidden, router, capacity_factor,
                              shared_hidden, token_groups, normalize)
    return install(model, layers, aux_weight)
