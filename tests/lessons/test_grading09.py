"""Lesson 09 checks: each passes the right answer and fails plausible wrong ones."""
import re
import contextlib
import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading._core import ExerciseFailed
from picolib.grading.lesson09 import (check_moe_critical_batch, check_sort_by_expert,
                                      check_split_sizes, check_top_k_capacity)
from picolib.moe import keep_mask


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def top_k_capacity(scores, k, cap):
    choice = scores.topk(k, dim=-1).indices
    return choice, keep_mask(choice, scores.shape[1], cap)


def token_by_token(scores, k, cap):
    choice = scores.topk(k, dim=-1).indices
    keep = torch.ones_like(choice, dtype=torch.bool)
    seen = torch.zeros(scores.shape[1], dtype=torch.long)
    for t in range(choice.shape[0]):
        for j in range(k):
            keep[t, j] = cap is None or seen[choice[t, j]] < cap
            seen[choice[t, j]] += 1
    return choice, keep


def test_check_top_k_capacity():
    check_top_k_capacity(top_k_capacity)
    with fails("every token's first choice must come before"):
        check_top_k_capacity(token_by_token)
    with fails("nothing dropped"):
        check_top_k_capacity(lambda s, k, cap: top_k_capacity(s, k, None))
    with pytest.raises(ExerciseFailed):                       # lowest scores instead of highest
        check_top_k_capacity(lambda s, k, cap: top_k_capacity(-s, k, cap))


def sort_by_expert(choice, n_experts):
    flat = choice.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return order, torch.bincount(flat, minlength=n_experts), inverse


def test_check_sort_by_expert():
    check_sort_by_expert(sort_by_expert)
    with fails("that is `order` itself"):
        check_sort_by_expert(lambda c, e: (*sort_by_expert(c, e)[:2], sort_by_expert(c, e)[0]))
    with fails("stable sort"):   # reversed within each expert
        def unstable(c, e):
            order, counts, _ = sort_by_expert(c, e)
            flat = c.reshape(-1)
            order = torch.cat([order[flat[order] == x].flip(0) for x in range(e)])
            return order, counts, torch.argsort(order)
        check_sort_by_expert(unstable)
    with fails("bincount's minlength"):                      # counts without empty experts
        check_sort_by_expert(lambda c, e: (sort_by_expert(c, e)[0], torch.bincount(c.reshape(-1)),
                                           sort_by_expert(c, e)[2]))

    def by_hand(c, e):                  # a right answer written differently: buckets, then cat
        flat = c.reshape(-1).tolist()
        order = torch.tensor([i for x in range(e) for i, y in enumerate(flat) if y == x])
        counts = torch.tensor([flat.count(x) for x in range(e)])
        inverse = torch.zeros_like(order)
        inverse[order] = torch.arange(len(order))
        return order, counts, inverse
    check_sort_by_expert(by_hand)


def split_sizes(counts, group=None):
    ep = dist.get_world_size(group)
    recv = torch.empty_like(counts)
    comm.all_to_all(recv, counts, group=group)
    return counts.view(ep, -1).sum(1).tolist(), recv.view(ep, -1).sum(1).tolist()


def send_twice(counts, group=None):
    send, _ = split_sizes(counts, group)
    return send, send


def gathered(counts, group=None):
    ep = dist.get_world_size(group)
    everything = torch.empty(ep * counts.numel(), dtype=counts.dtype)
    comm.all_gather(everything, counts, group=group)
    me = dist.get_rank(group)
    rows = everything.view(ep, ep, -1).sum(-1)
    return rows[me].tolist(), rows[:, me].tolist()


def test_check_split_sizes():
    check_split_sizes(split_sizes)
    with fails("recv comes from the others' counts"):
        check_split_sizes(send_twice)
    with fails("expected one all_to_all"):   # right values, all-gather
        check_split_sizes(gathered)


def test_check_moe_critical_batch():
    check_moe_critical_batch(lambda d, e, k, g: d * e / k / g)
    with fails("the bandwidth gain is left out: it divides the tokens needed"):
        check_moe_critical_batch(lambda d, e, k, g: d * e / k)
    with fails("k is left out") as info:                  # k = gain in two of the cases
        check_moe_critical_batch(lambda d, e, k, g: d * e / g)
    assert "gain" not in info.value.problems[0].split(" — ")[1], info.value.details
    with fails("not k/E"):
        check_moe_critical_batch(lambda d, e, k, g: d * k / e / g)
    check_moe_critical_batch(lambda d, e, k, g: d / (k / e) / g)   # right, written differently


# ---------------------------------------------------------------- issue 37: each mistake named
from picolib.moe import keep_mask  # noqa: E402


def capacity_plus_one(scores, k, cap):
    choice = scores.topk(k, dim=-1).indices
    return choice, keep_mask(choice, scores.shape[1], None if cap is None else cap + 1)


def capacity_by_rank_of_choice(scores, k, cap):
    """Right, written differently: loop over choice ranks, then tokens, counting per expert."""
    choice = scores.topk(k, dim=-1).indices
    keep = torch.ones_like(choice, dtype=torch.bool)
    used = [0] * scores.shape[1]
    for j in range(k):
        for t in range(choice.shape[0]):
            e = int(choice[t, j])
            keep[t, j] = cap is None or used[e] < cap
            used[e] += 1
    return choice, keep


def split_sizes_by_gather(counts, group=None):
    """Right, written differently: all_to_all of the per-rank sums (ep numbers, not E)."""
    ep = dist.get_world_size(group)
    send = counts.view(ep, -1).sum(1)
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send.contiguous(), group=group)
    return send.tolist(), recv.tolist()


def test_capacity_and_split_sizes_name_each_mistake():
    check_top_k_capacity(capacity_by_rank_of_choice)
    with fails(r"capacity off by one: an expert kept 3 assignments, not cap = 2"):
        check_top_k_capacity(capacity_plus_one)
    with fails(r"capacity off by one: an expert kept 1 assignments, not cap = 2"):
        check_top_k_capacity(lambda s, k, cap: (s.topk(k, -1).indices, keep_mask(
            s.topk(k, -1).indices, s.shape[1], None if cap is None else cap - 1)))
    check_split_sizes(split_sizes_by_gather)
    with fails(r"group of 2 in \[\[0, 2\], \[1, 3\]\] rank 0: the group of your all_to_all is that "
               "of all 4 ranks"):
        check_split_sizes(lambda c, group=None: split_sizes(c, None))


def capacity_shared_by_all_experts(scores, k, cap):
    """Wrong, and no known slip: one capacity for all experts together (E·cap slots)."""
    choice = scores.topk(k, dim=-1).indices
    if cap is None:
        return choice, torch.ones_like(choice, dtype=torch.bool)
    order = torch.arange(choice.numel()).view(k, -1).t()           # rank of each assignment, first choices first
    return choice, order < cap * scores.shape[1]


def test_top_k_capacity_names_only_a_slip_that_fits_every_case():
    with fails(r"keep: \d+ of \d+ elements wrong, the first at \[\d+, \d+\]: got 1, expected 0") as info:
        check_top_k_capacity(capacity_shared_by_all_experts)
    assert " — " not in info.value.details, info.value.details
    with fails("token by token") as info:
        check_top_k_capacity(token_by_token)
    assert "off by one" not in info.value.details and "nothing dropped" not in info.value.details


from picolib.grading.lesson09 import _MOE_SLIPS  # noqa: E402


@pytest.mark.parametrize("name", list(_MOE_SLIPS))
def test_each_moe_slip_is_named_alone(name):
    with pytest.raises(ExerciseFailed) as info:
        check_moe_critical_batch(_MOE_SLIPS[name])
    (line,) = info.value.problems
    assert line.endswith(name), line


# ---------------------------------------------------------------- issue 60: sizes the checks used to skip
def split_sizes_for_two_local_experts(counts, group=None):
    """Wrong: pairs the counts, as if every rank held 2 experts (it did in every case before)."""
    recv = torch.empty_like(counts)
    comm.all_to_all(recv, counts, group=group)
    return counts.view(-1, 2).sum(1).tolist(), recv.view(-1, 2).sum(1).tolist()


def split_sizes_by_loops(counts, group=None):
    """Right, written differently: the per-expert counts exchanged, then summed rank by rank."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    recv = torch.empty_like(counts)
    comm.all_to_all(recv, counts, group=group)
    return ([int(counts[j * local:(j + 1) * local].sum()) for j in range(ep)],
            [int(recv[j * local:(j + 1) * local].sum()) for j in range(ep)])


def test_split_sizes_at_uneven_expert_counts():
    check_split_sizes(split_sizes_by_loops)
    with fails(r"ep=2 rank 0: send"):
        check_split_sizes(split_sizes_for_two_local_experts)


def test_sort_by_expert_with_one_token_and_uneven_assignments():
    def by_count(c, e):                 # right, written differently: counts first, then offsets
        flat = c.reshape(-1)
        counts = torch.stack([(flat == x).sum() for x in range(e)])
        order = torch.cat([(flat == x).nonzero().flatten() for x in range(e)])
        return order, counts, torch.argsort(order)
    check_sort_by_expert(by_count)
    with fails(r"T=1 E=4 k=2: order"):  # wrong: assumes at least one token per expert slot row
        check_sort_by_expert(lambda c, e: (c.reshape(-1).sort(descending=True).indices if c.shape[0] == 1
                                           else sort_by_expert(c, e)[0], *sort_by_expert(c, e)[1:]))
