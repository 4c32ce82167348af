"""Checks for lesson 09 (mixture of experts, expert parallelism).

- `check_top_k_capacity(fn)`: `fn(scores, k, cap)` → (choice (T, k), keep (T, k) bool): the
  k highest scores per token, and which assignments fit `cap` slots per expert (first
  choices of every token before second choices, earlier tokens first; `cap=None`: all).
- `check_sort_by_expert(fn)`: `fn(choice, n_experts)` → (order, counts, inverse): the flat
  assignments (t·k + j) in expert order (token order within an expert), the assignments per
  expert, and the permutation that undoes `order`.
- `check_split_sizes(fn)`: `fn(counts, group=None)` on every rank of an EP group, counts (E,)
  the rows this rank sends to each expert → (send, recv) lists of ep ints: rows to and from
  each rank, with one `comm.all_to_all` (run on 2 and 4 ranks).
- `check_moe_critical_batch(fn)`: `fn(dense_tokens, n_experts, top_k, bandwidth_gain)` →
  tokens per GPU above which a MoE's data-parallel all-reduce hides behind its compute.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..moe import keep_mask, sort_by_expert
from ._core import (SUBGROUPS, call_student, compare, explain, fits, members, my_group,
                    on_world_not_group, report, run_student, world_calls)

__all__ = ["check_top_k_capacity", "check_sort_by_expert", "check_split_sizes",
           "check_moe_critical_batch"]


def _scores(t, e, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=g).softmax(-1)


def _token_major(choice, e, cap):
    """The common slip's mask: slots filled token by token (a token's second choice before the
    next token's first)."""
    t, k = choice.shape
    keep, seen = torch.zeros(t, k, dtype=torch.bool), torch.zeros(e, dtype=torch.long)
    for i in range(t):
        for j in range(k):
            keep[i, j] = cap is None or seen[choice[i, j]] < cap
            seen[choice[i, j]] += 1
    return keep


def _keep_slips(choice, e, cap, first_cap) -> dict:
    """Each known slip's keep mask in one case (the right mask where the slip changes nothing,
    e.g. with no capacity), its diagnosis worded with the first wrong case's cap."""
    with_cap = lambda c: keep_mask(choice, e, c if cap else None)
    return {
        "token by token: every token's first choice must come before any token's second choice":
            _token_major(choice, e, cap),
        f"capacity off by one: an expert kept {first_cap + 1} assignments, not cap = {first_cap} "
        "(keep while the count before this one is < cap)": with_cap(cap and cap + 1),
        f"capacity off by one: an expert kept {first_cap - 1} assignments, not cap = {first_cap} "
        "(keep while the count before this one is < cap)": with_cap(cap and cap - 1),
        "nothing dropped: an expert holds at most cap assignments": with_cap(None),
    }


def check_top_k_capacity(fn) -> None:
    """Several (T, E, k, cap), with and without drops, against picolib.moe.keep_mask. A wrong
    keep mask is named when one slip alone gives it in every case."""
    problems, checks, masks, first = [], 0, [], None
    for t, e, k, cap, seed in ((12, 4, 1, 2, 0), (12, 4, 2, 5, 1), (20, 6, 2, 4, 2), (9, 3, 3, 7, 3),
                               (10, 5, 2, None, 4)):
        scores = _scores(t, e, seed)
        choice = scores.topk(k, dim=-1).indices
        keep = keep_mask(choice, e, cap)
        got = call_student(fn, scores.clone(), k, cap)
        what = f"T={t} E={e} k={k} cap={cap}"
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            problems.append(f"{what}: return (choice, keep), got {type(got).__name__}")
            continue
        checks += 2
        problems += compare(f"{what}: choice", got[0], choice)
        wrong = compare(f"{what}: keep", got[1].long() if isinstance(got[1], torch.Tensor) else got[1],
                        keep.long())
        if isinstance(got[1], torch.Tensor) and got[1].shape == keep.shape:
            masks.append(((choice, e, cap), got[1].bool()))
        if wrong and first is None:
            first = (len(problems), cap)
        problems += wrong
    if first is not None and len(masks) == checks // 2 and first[1]:
        names = list(_keep_slips(*masks[0][0][:2], first[1], first[1]))
        hint = explain([name for i, name in enumerate(names) if all(
            torch.equal(got, list(_keep_slips(choice, e, cap, first[1]).values())[i])
            for (choice, e, cap), got in masks)])
        if hint:
            problems[first[0]] += f" — {hint}"
    report("top-k routing with capacity", problems, checks)


def check_sort_by_expert(fn) -> None:
    """Stable sort of the assignments by expert, the counts, and the inverse permutation."""
    problems, checks = [], 0
    for t, e, k, seed in ((6, 4, 1, 0), (10, 5, 2, 1), (16, 8, 3, 2), (7, 3, 2, 3), (1, 4, 2, 4)):
        choice = _scores(t, e, seed).topk(k, dim=-1).indices    # T·k uneven over E; one token
        order, counts = sort_by_expert(choice, torch.ones_like(choice, dtype=torch.bool), e)
        inverse = torch.argsort(order)
        got = call_student(fn, choice.clone(), e)
        what = f"T={t} E={e} k={k}"
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            problems.append(f"{what}: return (order, counts, inverse)")
            continue
        checks += 3
        wrong = compare(f"{what}: order", got[0], order)
        if wrong and isinstance(got[0], torch.Tensor) and got[0].shape == order.shape and \
                torch.equal(choice.reshape(-1)[got[0]], choice.reshape(-1)[order]):
            wrong = [wrong[0] + " — grouped by expert, but not in token order within an expert "
                                "(use a stable sort)"]
        problems += wrong
        wrong = compare(f"{what}: counts", got[1], counts)
        if wrong and isinstance(got[1], torch.Tensor) and got[1].dim() == 1 and \
                len(got[1]) < e and torch.equal(got[1], counts[:len(got[1])]):
            wrong = [wrong[0] + f" — {e - len(got[1])} expert(s) with no token are missing: "
                                "count all E experts (bincount's minlength)"]
        problems += wrong
        wrong = compare(f"{what}: inverse", got[2], inverse)
        if wrong and isinstance(got[2], torch.Tensor) and torch.equal(got[2], order):
            wrong = [wrong[0] + " — that is `order` itself: the inverse puts row order[i] back at i"]
        problems += wrong
    report("the permutation by expert and its inverse", problems, checks)


def _split_worker(fn, all_counts, split=False):
    group = my_group(split)
    team = members(dist.get_rank())[0] if split else 0
    with Ledger() as led:
        got = call_student(fn, all_counts[team][dist.get_rank(group)].clone(), group=group)
    return got, {k: v["calls"] for k, v in led.summary().items()}, world_calls(led) if split else []


def check_split_sizes(fn, timeout: float | None = None) -> None:
    """Each rank's rows to and from every rank, from the per-expert counts (different on every
    rank): on 2 ranks with 3 experts each, 4 ranks with 2 each, and 4 ranks split into two EP
    groups of 2 with 4 experts each, each group with its own counts."""
    problems, checks = [], 0
    name = getattr(fn, "__name__", "your function")
    for n, e, split in ((2, 6, False), (4, 8, False), (4, 8, True)):
        ep = 2 if split else n
        g = torch.Generator().manual_seed(n + 10 * split)
        counts = [torch.randint(0, 6, (ep, e), generator=g) for _ in range(n if split else 1)]
        for c in counts:
            c[0, : e // ep] = 0                          # rank 0 sends nothing to rank 0's experts
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"ep={ep}"
        for r, (got, calls, world) in enumerate(run_student(_split_worker, n, fn, counts, split,
                                                            name=name, timeout=timeout)):
            team = members(r)[0] if split else 0
            gr = members(r).index(r) if split else r
            rows = counts[team].view(ep, ep, e // ep).sum(-1)  # rows[i, j]: rank i → rank j
            checks += 2
            if world:
                problems.append(f"{label} rank {r}: " + on_world_not_group(f"the group of your {world[0]}"))
                continue
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                problems.append(f"{label} rank {r}: return (send, recv)")
                continue
            as_list = [[int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)] for x in got]
            problems += compare(f"{label} rank {r}: send", as_list[0], rows[gr].tolist())
            wrong = compare(f"{label} rank {r}: recv", as_list[1], rows[:, gr].tolist())
            if wrong and as_list[1] == rows[gr].tolist():
                wrong = [wrong[0] + " — that is what this rank sends: recv comes from the others' counts"]
            problems += wrong
            if calls != {"all_to_all": 1}:
                problems.append(f"{label} rank {r}: picolib.comm calls {calls}, expected one all_to_all")
        if problems:
            break
    report("all-to-all split sizes", problems, checks)


_MOE_SLIPS = {
    "the bandwidth gain is left out: it divides the tokens needed": lambda d, e, k, g: d * e / k,
    "the bandwidth gain multiplies: a gain in bandwidth divides the tokens needed":
        lambda d, e, k, g: d * e / k * g,
    "k is left out: a MoE all-reduces E experts' weights for k experts' FLOPs per token, so the "
    "dense count grows by E/k": lambda d, e, k, g: d * e / g,
    "E/k, not k/E: a MoE all-reduces E experts' weights for k experts' FLOPs per token":
        lambda d, e, k, g: d * k / e / g,
    "E is left out: the dense count grows by E/k (E experts' weights, k experts' FLOPs)":
        lambda d, e, k, g: d / k / g,
}


def check_moe_critical_batch(fn) -> None:
    """dense critical tokens × E / k ÷ the bandwidth gain; DeepSeek-V3's 4,944 and two more. A
    slip is named when it alone reproduces every answer (k equals the gain in two cases)."""
    problems, answers = [], []
    for dense, e, k, gain in ((1236, 256, 8, 8), (1099, 64, 2, 1), (1236, 128, 4, 4)):
        got = call_student(fn, dense, e, k, gain)
        answers.append(((dense, e, k, gain), got))
        problems += compare(f"dense={dense} E={e} k={k} gain={gain}", got, float(dense * e / k / gain),
                            atol=0.5, rtol=0)
    if problems:
        close = lambda got, value: abs(float(got) - value) <= 1e-6 * abs(value)
        hint = explain([why for why, rule in _MOE_SLIPS.items() if fits(rule, answers, close)])
        problems = [f"{problems[0]} — {hint}"] if hint else problems
    report("MoE critical batch", problems, 3)
