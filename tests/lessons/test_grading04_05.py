"""Lesson 04 and 05 checks: each passes a right answer and fails wrong ones."""
import re
import contextlib
import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.grading import _core as grading_core
from picolib.grading import (ExerciseFailed, check_conjugate_pair, check_shards,
                             check_vocab_parallel_loss)
from picolib.mappings import _CopyToRegion, _ReduceFromRegion
from picolib.vocab_parallel import vocab_parallel_cross_entropy


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def column_shard(w, rank, world):
    if w.shape[0] % world:
        raise ValueError(f"{w.shape[0]} rows do not divide by {world}")
    return w.chunk(world, 0)[rank]


def row_shard(w, rank, world):
    if w.shape[1] % world:
        raise ValueError(f"{w.shape[1]} columns do not divide by {world}")
    return w.chunk(world, 1)[rank]


def test_check_shards():
    check_shards(column_shard, row_shard)
    with pytest.raises(ExerciseFailed):   # roles swapped: slices the input features
        check_shards(row_shard, column_shard)
    with fails("strided rows"):           # strided instead of contiguous slices
        check_shards(lambda w, r, n: column_shard(w, r, n) if w.shape[0] % n else w[r::n], row_shard)


def _checked_split(w, r, n, dim):
    """Right, written differently: torch.tensor_split after an explicit divisibility check."""
    if w.shape[dim] % n:
        raise ValueError(f"{w.shape[dim]} features do not split over {n} ranks")
    return torch.tensor_split(w, n, dim=dim)[r]


@pytest.mark.parametrize("col, row, pattern", [
    (lambda w, r, n: _checked_split(w, r, n, 1), lambda w, r, n: _checked_split(w, r, n, 1),
     "column_shard.*you sliced the columns"),
    (lambda w, r, n: _checked_split(w, r, n, 0), lambda w, r, n: _checked_split(w, r, n, 1).t(),
     "row_shard.*the shard is transposed"),
    (lambda w, r, n: _checked_split(w, n - 1 - r, n, 0),
     lambda w, r, n: _checked_split(w, r, n, 1), "column_shard.*the ranks in reverse order"),
    (lambda w, r, n: torch.tensor_split(w, n, 0)[r], lambda w, r, n: _checked_split(w, r, n, 1),
     "column_shard: W \\(6, 4\\) over 4 ranks should raise a ValueError"),
    (lambda w, r, n: _checked_split(w, r, n, 0),
     lambda w, r, n: (torch.tensor_split(w, n, 1)[r] if w.shape[1] % n == 0 else
                      (_ for _ in ()).throw(AssertionError("does not divide"))),
     "row_shard: .*raised AssertionError, not the ValueError"),
    (lambda w, r, n: _checked_split(w, r, n, 0),
     lambda w, r, n: (torch.tensor_split(w, n, 1)[r] if w.shape[1] % n == 0 else
                      (_ for _ in ()).throw(ValueError("does not divide"))),
     "the ValueError should name both numbers"),
], ids=["column slices columns", "row transposed", "reversed ranks", "no ValueError",
        "AssertionError", "numbers not named"])
def test_check_shards_mistakes(col, row, pattern):
    check_shards(lambda w, r, n: _checked_split(w, r, n, 0), lambda w, r, n: _checked_split(w, r, n, 1))
    with fails(pattern):
        check_shards(col, row)


class IdentityBoth(torch.autograd.Function):
    """Wrong: forgets the all-reduce."""
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceBoth(torch.autograd.Function):
    """Wrong: all-reduces in both directions (double counts the gradient)."""
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad, None


def test_check_conjugate_pair():
    check_conjugate_pair(_CopyToRegion, _ReduceFromRegion)
    with fails("f backward: this rank's value passed through unchanged"):
        check_conjugate_pair(IdentityBoth, _ReduceFromRegion)
    with fails("g backward: summed over the ranks"):
        check_conjugate_pair(_CopyToRegion, ReduceBoth)
    with fails("f forward: summed over the ranks"):   # f and g swapped
        check_conjugate_pair(_ReduceFromRegion, _CopyToRegion)


def gathering_loss(local, targets, vocab_start, group=None):
    """Right value, but gathers every logit: the check must refuse it."""
    full = comm_gather_last(local)
    return torch.nn.functional.cross_entropy(full.flatten(0, 1), targets.flatten())


def comm_gather_last(x):
    from picolib.tensor_parallel import gather_from_tp
    return gather_from_tp(x)


def local_only_loss(local, targets, vocab_start, group=None):
    """Wrong: softmax over this rank's slice only."""
    idx = (targets - vocab_start).clamp(0, local.shape[-1] - 1)
    return torch.nn.functional.cross_entropy(local.flatten(0, 1), idx.flatten())


def per_token_loss(local, targets, vocab_start, group=None):
    """Wrong: per-token losses (b, s) where the mean is expected; backward would raise."""
    return vocab_parallel_cross_entropy(local, targets, vocab_start, group) * torch.ones(targets.shape)


def test_check_vocab_parallel_loss():
    check_vocab_parallel_loss(vocab_parallel_cross_entropy)
    with fails("instead of gathering logits"):
        check_vocab_parallel_loss(gathering_loss)
    with pytest.raises(ExerciseFailed):
        check_vocab_parallel_loss(local_only_loss)
    with fails(r"shape \(3, 6\), expected a scalar") as e:
        check_vocab_parallel_loss(per_token_loss)
    assert "Traceback" not in e.value.details


from picolib.grading.lesson04 import check_parallel_head  # noqa: E402
from picolib.tensor_parallel import copy_to_tp, gather_from_tp  # noqa: E402


def head(hidden, weight_shard, group=None):
    return torch.nn.functional.linear(copy_to_tp(hidden, group), weight_shard)


def test_check_parallel_head():
    check_parallel_head(head)
    with fails("the whole vocabulary") as e:   # gathered logits
        check_parallel_head(lambda h, w, group=None: gather_from_tp(head(h, w, group), group))
    assert "Traceback" not in e.value.details and len(e.value.problems) == 2   # 2 ranks
    with fails("this rank's part only"):     # no f before the matmul
        check_parallel_head(lambda h, w, group=None: torch.nn.functional.linear(h, w))
    with fails("expected this rank's slice"):
        check_parallel_head(lambda h, w, group=None: head(h, w, group)[..., :1])


# ---------------------------------------------------------------- lesson 05

from picolib.grading import (check_gather_sequence, check_reduce_scatter_sequence,  # noqa: E402
                             check_sp_activation_bytes, check_tokens_per_day)
from picolib.sequence_parallel import (activation_bytes_per_layer, all_gather_sequence,  # noqa: E402
                                       reduce_scatter_sequence_nograd)


def gather_along_batch(x, group=None):
    """Wrong: keeps comm.all_gather's dim-0 layout (rank blocks along the batch)."""
    import torch.distributed as dist
    n = dist.get_world_size(group)
    buf = x.new_empty(n * x.shape[0], *x.shape[1:])
    comm.all_gather(buf, x.contiguous(), group=group)
    return buf.view(x.shape[0], n * x.shape[1], x.shape[2])


def reduce_scatter_by_all_reduce(x, group=None):
    """Right values, wrong collective: an all-reduce then a slice (twice the bytes)."""
    import torch.distributed as dist
    x = x.clone()
    comm.all_reduce(x, group=group)
    return x.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)]


def test_check_sequence_collectives():
    check_gather_sequence(all_gather_sequence)
    check_reduce_scatter_sequence(reduce_scatter_sequence_nograd)
    with pytest.raises(ExerciseFailed):
        check_gather_sequence(gather_along_batch)
    with pytest.raises(ExerciseFailed):
        check_reduce_scatter_sequence(reduce_scatter_by_all_reduce)


def test_check_sp_activation_bytes():
    check_sp_activation_bytes(lambda s, b, h, f, a, tp, sp:
                              activation_bytes_per_layer(s, b, h, f, a, tp, "tp+sp" if sp else "tp"))
    with pytest.raises(ExerciseFailed):   # Korthikanti's 16-bit GPT constants, not our model
        check_sp_activation_bytes(lambda s, b, h, f, a, tp, sp:
                                  s * b * h * (34 / tp if sp else 10 + 24 / tp) + 5 * a * s * s * b / tp)
    with fails("whole on every rank"):   # splits the norms under TP too
        check_sp_activation_bytes(lambda s, b, h, f, a, tp, sp:
                                  activation_bytes_per_layer(s, b, h, f, a, tp, "tp+sp"))
    with fails("causal mask is missing"):
        check_sp_activation_bytes(lambda s, b, h, f, a, tp, sp: activation_bytes_per_layer(
            s, b, h, f, a, tp, "tp+sp" if sp else "tp") - s * s)


def test_check_tokens_per_day():
    check_tokens_per_day(lambda n, fl, p: n * fl / (6 * p) * 86400)
    with fails("forward alone"):   # 2N (forward only) instead of 6N
        check_tokens_per_day(lambda n, fl, p: n * fl / (2 * p) * 86400)
    with fails("tokens per second"):
        check_tokens_per_day(lambda n, fl, p: n * fl / (6 * p))
    with fails("4N, not 2N"):      # forward 2N + backward 2N: one matmul per weight in backward
        check_tokens_per_day(lambda n, fl, p: n * fl / (4 * p) * 86400)
    check_tokens_per_day(lambda n, fl, p: 86400 / (6 * p / (n * fl)))   # right, written differently


# ---------------------------------------------------------------- deadlocks (both lessons)

def _wait_for_left_neighbour(x):
    """Every rank first waits for its left neighbour, who waits too: a deadlock."""
    buf = torch.empty_like(x)
    comm.recv(buf, (dist.get_rank() - 1) % dist.get_world_size())
    return x


class StuckCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _wait_for_left_neighbour(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def stuck_loss(local, targets, vocab_start, group=None):
    return _wait_for_left_neighbour(local).sum()


def stuck_gather(x, group=None):
    return _wait_for_left_neighbour(x)


@pytest.mark.parametrize("check, args, name", [
    (check_conjugate_pair, (StuckCopy, _ReduceFromRegion), "StuckCopy / _ReduceFromRegion"),
    (check_vocab_parallel_loss, (stuck_loss,), "stuck_loss"),
    (check_gather_sequence, (stuck_gather,), "stuck_gather"),
    (check_reduce_scatter_sequence, (stuck_gather,), "stuck_gather")])
def test_a_deadlock_fails_the_check_with_a_clear_message(check, args, name, no_leftover_workers,
                                                         monkeypatch):
    monkeypatch.setattr(grading_core, "TIMEOUT", 2.0)     # the checks' one timeout setting
    with fails(f"{name} did not finish on 2 ranks within 2 s "
                                             "— a deadlock"):
        check(*args)


# ---------------------------------------------------------------- lesson 04: wrong answers

class ReduceInPlace(torch.autograd.Function):
    """Wrong: all-reduces autograd's input itself (the statement says: a clone)."""
    @staticmethod
    def forward(ctx, x, group):
        comm.all_reduce(x, group=group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CopyReducingGradInPlace(torch.autograd.Function):
    """Wrong: all-reduces the incoming gradient in place."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


def plain_all_reduce_loss(local, targets, vocab_start, group=None):
    """Wrong: comm.all_reduce where ReduceFromTP belongs (right numbers, through a deprecated
    fallback of PyTorch that warns it may be silently incorrect)."""
    m = local.detach().amax(-1)
    comm.all_reduce(m, op="max", group=group)
    shifted = local - m.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    comm.all_reduce(sum_exp, group=group)
    idx = targets - vocab_start
    mine = (idx >= 0) & (idx < local.shape[-1])
    target = shifted.gather(-1, idx.clamp(0, local.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    comm.all_reduce(target, group=group)
    return (sum_exp.log() - target).mean()


def test_conjugate_pair_rejects_in_place_all_reduces():
    with fails("g forward's input was changed in place"):
        check_conjugate_pair(_CopyToRegion, ReduceInPlace)
    with fails("f backward's incoming gradient was changed in place"):
        check_conjugate_pair(CopyReducingGradInPlace, _ReduceFromRegion)


def test_vocab_parallel_loss_rejects_a_plain_all_reduce_and_prints_no_warning(capfd):
    with fails("deprecated fallback.*ReduceFromTP"):
        check_vocab_parallel_loss(plain_all_reduce_loss)
    assert "silently incorr" not in capfd.readouterr().err


def test_a_scalar_loss_is_not_said_to_be_off_by_a_factor():
    with pytest.raises(ExerciseFailed) as info:
        check_vocab_parallel_loss(local_only_loss)
    assert "same factor" not in info.value.details


def test_parallel_head_names_g_used_instead_of_f():
    from picolib.tensor_parallel import reduce_from_tp
    with fails("that is g \\(ReduceFromTP\\); the head enters through f"):
        check_parallel_head(lambda h, w, group=None: torch.nn.functional.linear(
            reduce_from_tp(h, group), w))


# ---------------------------------------------------------------- issue 37: sub-groups, diagnoses
from picolib.grading import check_sp_norm_weight_grad  # noqa: E402


class CopyOnTheWorld(torch.autograd.Function):
    """Wrong: f's backward forgets the group (reduces over every rank)."""
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad, None


class CopyByAddition(torch.autograd.Function):
    """Right, written differently: x + 0 forward, a fresh tensor reduced backward."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x + 0

    @staticmethod
    def backward(ctx, grad):
        out = grad * 1.0
        comm.all_reduce(out, op="sum", group=ctx.group)
        return out, None


def test_conjugate_pair_on_a_sub_group():
    check_conjugate_pair(CopyByAddition, _ReduceFromRegion)
    with fails(r"group of 2 in \[\[0, 2\], \[1, 3\]\] rank 0: the group of your all_reduce is that "
               "of all 4 ranks, not of `group`"):
        check_conjugate_pair(CopyOnTheWorld, _ReduceFromRegion)


def test_vocab_parallel_loss_and_head_on_a_sub_group():
    with fails(r"group of 2 .* rank 0: the group of your all_reduce is that of all 4 ranks"):
        check_vocab_parallel_loss(lambda local, t, start, group=None:
                                  vocab_parallel_cross_entropy(local, t, start, None)
                                  if dist.get_world_size() == 4 and group is not None
                                  else vocab_parallel_cross_entropy(local, t, start, group))
    with fails(r"group of 2 .* rank 0: the group of your all_reduce is that of all 4 ranks"):
        check_parallel_head(lambda h, w, group=None: torch.nn.functional.linear(
            _CopyToRegion.apply(h, None), w))


def gather_no_transpose(x, group=None):
    n = dist.get_world_size(group)
    buf = x.new_empty(n * x.shape[0], *x.shape[1:])
    comm.all_gather(buf, x.contiguous(), group=group)
    return buf.reshape(x.shape[0], n * x.shape[1], x.shape[2])


def gather_buffer_as_is(x, group=None):
    n = dist.get_world_size(group)
    buf = x.new_empty(n * x.shape[0], *x.shape[1:])
    comm.all_gather(buf, x.contiguous(), group=group)
    return buf


def gather_with_a_list(x, group=None):
    """Right, written differently: the buffer's rank blocks split and concatenated on dim 1."""
    n = dist.get_world_size(group)
    buf = torch.empty(n * x.shape[0], *x.shape[1:])
    comm.all_gather(buf, x.contiguous(), group=group)
    return torch.cat(buf.split(x.shape[0]), dim=1)


def rs_batch_split(x, group=None):
    n = dist.get_world_size(group)
    b, s, h = x.shape
    out = x.new_empty(b, s // n, h)
    comm.reduce_scatter(out, x.reshape(n * b, s // n, h).contiguous(), group=group)
    return out


def rs_with_cat(x, group=None):
    """Right, written differently: the sequence chunks stacked with torch.cat on dim 0."""
    n = dist.get_world_size(group)
    out = torch.empty(x.shape[0], x.shape[1] // n, x.shape[2])
    comm.reduce_scatter(out, torch.cat(x.chunk(n, dim=1), dim=0), op="sum", group=group)
    return out


def test_sequence_collectives_name_each_mistake():
    check_gather_sequence(gather_with_a_list)
    check_reduce_scatter_sequence(rs_with_cat)
    with fails("reshaped straight into \\(b, s, h\\).*transpose\\(0, 1\\)"):
        check_gather_sequence(gather_no_transpose)
    with fails("returned all_gather's buffer \\(tp·b, s/tp, h\\) as it is"):
        check_gather_sequence(gather_buffer_as_is)
    with fails("that splits the batch, not the sequence"):
        check_reduce_scatter_sequence(rs_batch_split)
    with fails(r"group of 2 in .* rank 0: the group of your all_gather is that of all 4 ranks"):
        check_gather_sequence(lambda x, group=None: gather_with_a_list(x, None))
    with fails(r"group of 2 in .* rank 0: the group of your reduce_scatter is that of all 4 ranks"):
        check_reduce_scatter_sequence(lambda x, group=None: rs_with_cat(x, None))


def norm_grad_right(x, grad_out, eps, group=None):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    g = (grad_out * normed).sum((0, 1))
    comm.all_reduce(g, group=group)
    return g


def norm_grad_by_autograd(x, grad_out, eps, group=None):
    """Right, written differently: autograd on this rank's tokens, then the sum over ranks."""
    w = torch.ones(x.shape[-1], requires_grad=True)
    (x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w).backward(grad_out)
    g = w.grad.clone()
    comm.all_reduce(g, op="sum", group=group)
    return g


def norm_grad_local(x, grad_out, eps, group=None):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (grad_out * normed).sum((0, 1))


def norm_grad_avg(x, grad_out, eps, group=None):
    g = norm_grad_local(x, grad_out, eps)
    comm.all_reduce(g, op="avg", group=group)
    return g


def norm_grad_raw_x(x, grad_out, eps, group=None):
    g = (grad_out * x).sum((0, 1))
    comm.all_reduce(g, group=group)
    return g


def test_sp_norm_weight_grad_names_each_mistake():
    check_sp_norm_weight_grad(norm_grad_right)
    check_sp_norm_weight_grad(norm_grad_by_autograd)
    with fails("this rank's s/tp tokens only — .* all-reduce \\(sum\\)"):
        check_sp_norm_weight_grad(norm_grad_local)
    with fails("N=2 rank 0: weight gradient: 2× too small — a mean over the ranks"):
        check_sp_norm_weight_grad(norm_grad_avg)
    with fails("the weight multiplies the normalised"):
        check_sp_norm_weight_grad(norm_grad_raw_x)
    with fails(r"group of 2 in .* rank 0: the group of your all_reduce is that of all 4 ranks"):
        check_sp_norm_weight_grad(lambda x, dy, eps, group=None: norm_grad_right(x, dy, eps, None))
    with fails("not written yet"):
        check_sp_norm_weight_grad(lambda x, dy, eps, group=None: (_ for _ in ()).throw(
            NotImplementedError))


def _loss_parts(local, targets, vocab_start, group, shift):
    from picolib.tensor_parallel import reduce_from_tp
    idx = targets - vocab_start
    mine = (idx >= 0) & (idx < local.shape[-1])
    z = local - shift.unsqueeze(-1)
    sum_exp = reduce_from_tp(z.exp().sum(-1), group)
    target = reduce_from_tp((z * torch.nn.functional.one_hot(
        idx.clamp(0, local.shape[-1] - 1), local.shape[-1]) * mine.unsqueeze(-1)).sum(-1), group)
    return sum_exp, target


def loss_without_the_max(local, targets, vocab_start, group=None):
    """Wrong: exp of the raw logits — overflows fp32 beyond z ≈ 88.7."""
    sum_exp, target = _loss_parts(local, targets, vocab_start, group, torch.zeros(targets.shape))
    return (sum_exp.log() - target).mean()


def loss_summed_over_tokens(local, targets, vocab_start, group=None):
    """Wrong: the sum over the b·s tokens, not the mean."""
    return vocab_parallel_cross_entropy(local, targets, vocab_start, group) * targets.numel()


def loss_with_logsumexp(local, targets, vocab_start, group=None):
    """Right, written differently: the max from torch.max, the target picked with one_hot, the
    loss as log-sum-exp plus the max minus the raw target logit."""
    m = local.detach().max(-1).values
    comm.all_reduce(m, op="max", group=group)
    sum_exp, target = _loss_parts(local, targets, vocab_start, group, m)
    return (torch.log(sum_exp) - target).sum() / targets.numel()


def test_vocab_parallel_loss_needs_the_max_and_the_mean():
    check_vocab_parallel_loss(loss_with_logsumexp)
    with fails("the loss is inf on logits up to 1\\d\\d: exp\\(z\\) overflows fp32.*subtract the "
               "max") as info:
        check_vocab_parallel_loss(loss_without_the_max)
    assert "elements wrong" not in info.value.details
    with fails("the sum over the b·s = 18 tokens — return the mean") as info:
        check_vocab_parallel_loss(loss_summed_over_tokens)
    assert "ranks" not in info.value.details.split("tokens")[0]


def norm_grad_without_eps(x, grad_out, eps, group=None):
    """Wrong: no eps under the square root (inside the old check's tolerance: eps 1e-5 on
    inputs of size ~1)."""
    return norm_grad_right(x, grad_out, 0.0, group)


def norm_grad_eps_written_in(x, grad_out, eps, group=None):
    """Wrong: eps fixed at 1e-5 instead of the argument."""
    return norm_grad_right(x, grad_out, 1e-5, group)


def test_sp_norm_weight_grad_needs_the_argument_eps():
    with fails("weight gradient: eps left out — x̂ = x·rsqrt") as info:
        check_sp_norm_weight_grad(norm_grad_without_eps)
    assert "or " not in info.value.details.split("eps left out")[0]
    with fails("weight gradient: eps taken as 1e-5, not the argument eps = 0.001"):
        check_sp_norm_weight_grad(norm_grad_eps_written_in)


# ---------------------------------------------------------------- issue 60: hints that fit every case

def column_shard_one_rank_off(w, r, n):
    """Wrong: rank r takes rank r+1's rows (at 2 ranks that looks like reversed ranks)."""
    return _checked_split(w, (r + 1) % n, n, 0)


def row_shard_by_columns(w, r, n):
    """Right, written differently: the columns picked one by one and stacked."""
    if w.shape[1] % n:
        raise ValueError(f"{w.shape[1]} input features over {n} ranks")
    k = w.shape[1] // n
    return torch.stack([w[:, c] for c in range(r * k, (r + 1) * k)], dim=1)


def test_shards_hint_only_what_fits_every_case():
    check_shards(lambda w, r, n: _checked_split(w, r, n, 0), row_shard_by_columns)
    with pytest.raises(ExerciseFailed) as info:
        check_shards(column_shard_one_rank_off, lambda w, r, n: _checked_split(w, r, n, 1))
    assert "reverse order" not in info.value.details and "column_shard(W (8, 12), rank 0, world 4)" in info.value.details


class CopySkippingOnOneRank(torch.autograd.Function):
    """Wrong: f's backward all-reduces on rank 0 of the group only."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if dist.get_rank(ctx.group) == 0:
            comm.all_reduce(grad, group=ctx.group)
        return grad, None


def test_a_deadlock_in_f_backward_is_pointed_at_f_backward(no_leftover_workers, monkeypatch):
    monkeypatch.setattr(grading_core, "TIMEOUT", 2.0)
    check_conjugate_pair(CopyByAddition, _ReduceFromRegion)            # right, written differently
    with fails("a deadlock") as info:
        check_conjugate_pair(CopySkippingOnOneRank, _ReduceFromRegion)
    assert re.search(r"rank 0 was waiting in backward, line \d+: comm.all_reduce", info.value.details), info.value.details
    assert "waiting in forward" not in info.value.details


def loss_max_summed(local, targets, vocab_start, group=None):
    """Wrong: the max all-reduced with op="sum"."""
    m = local.detach().amax(-1)
    comm.all_reduce(m, op="sum", group=group)
    sum_exp, target = _loss_parts(local, targets, vocab_start, group, m)
    return (sum_exp.log() - target).mean()


def loss_one_max_for_all_tokens(local, targets, vocab_start, group=None):
    """Wrong: one max for the whole tensor, not one per token."""
    m = local.detach().max().expand(targets.shape).clone()
    comm.all_reduce(m, op="max", group=group)
    sum_exp, target = _loss_parts(local, targets, vocab_start, group, m)
    return (sum_exp.log() - target).mean()


def loss_by_local_logsumexp(local, targets, vocab_start, group=None):
    """Right, written differently: the max per token, then torch.logsumexp's exponentials summed
    over the ranks."""
    from picolib.tensor_parallel import reduce_from_tp
    m = local.detach().amax(-1, keepdim=True)
    comm.all_reduce(m, op="max", group=group)
    z = local - m
    total = reduce_from_tp(torch.logsumexp(z, -1).exp(), group)
    idx = (targets - vocab_start).unsqueeze(-1)
    mine = (idx >= 0) & (idx < local.shape[-1])
    target = reduce_from_tp(torch.where(mine, z.gather(-1, idx.clamp(0, local.shape[-1] - 1)), 0.0), group)
    return (total.log() - target.squeeze(-1)).mean()


@pytest.mark.parametrize("wrong", [loss_max_summed, loss_one_max_for_all_tokens])
def test_the_overflow_hint_only_for_an_overflow(wrong):
    check_vocab_parallel_loss(loss_by_local_logsumexp)
    with pytest.raises(ExerciseFailed) as info:
        check_vocab_parallel_loss(wrong)
    assert "overflows" not in info.value.details, info.value.details


# ---------------------------------------------------------------- issue 55: the vocab-parallel embedding
from picolib.grading import check_kv_replicas, check_vocab_parallel_embedding  # noqa: E402
from picolib.mappings import _CopyToReplicas, copy_to_region, reduce_from_region  # noqa: E402


def embed_right(tokens, shard, start, group=None):
    outside = (tokens < start) | (tokens >= start + shard.shape[0])
    local = (tokens - start).masked_fill(outside, 0)
    partial = torch.nn.functional.embedding(local, shard).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_region(partial, group)


def embed_by_one_hot(tokens, shard, start, group=None):
    """Right, written differently: a one-hot matrix (zero rows for other ranks' ids) times the shard."""
    idx = tokens - start
    hot = (idx.unsqueeze(-1) == torch.arange(shard.shape[0])).to(shard.dtype)
    return reduce_from_region(hot @ shard, group)


def embed_not_summed(tokens, shard, start, group=None):
    outside = (tokens < start) | (tokens >= start + shard.shape[0])
    local = (tokens - start).masked_fill(outside, 0)
    return torch.nn.functional.embedding(local, shard).masked_fill(outside.unsqueeze(-1), 0.0)


def embed_not_zeroed(tokens, shard, start, group=None):
    local = (tokens - start).clamp(0, shard.shape[0] - 1)
    return reduce_from_region(torch.nn.functional.embedding(local, shard), group)


def embed_not_shifted(tokens, shard, start, group=None):
    outside = (tokens < start) | (tokens >= start + shard.shape[0])
    partial = torch.nn.functional.embedding(tokens.masked_fill(outside, 0), shard)
    return reduce_from_region(partial.masked_fill(outside.unsqueeze(-1), 0.0), group)


def embed_plain_all_reduce(tokens, shard, start, group=None):
    out = embed_not_summed(tokens, shard, start)
    comm.all_reduce(out, group=group)
    return out


def embed_summed_both_ways(tokens, shard, start, group=None):
    """Wrong: f after g — the sum forward, and again backward."""
    return copy_to_region(embed_right(tokens, shard, start, group), group)


def embed_detached(tokens, shard, start, group=None):
    return embed_right(tokens, shard.detach(), start, group)


def test_vocab_parallel_embedding_names_each_mistake():
    check_vocab_parallel_embedding(embed_right)
    check_vocab_parallel_embedding(embed_by_one_hot)
    with fails("not written yet"):
        check_vocab_parallel_embedding(lambda *a, **k: (_ for _ in ()).throw(NotImplementedError))
    with fails("N=2 rank 0: embeddings: only this rank's rows are looked up"):
        check_vocab_parallel_embedding(embed_not_summed)
    with fails("N=2 rank 0: embeddings: the tokens this rank does not own were not zeroed"):
        check_vocab_parallel_embedding(embed_not_zeroed)
    with fails("rank 1.*IndexError.*shift the ids by vocab_start"):
        check_vocab_parallel_embedding(embed_not_shifted)
    with fails("deprecated fallback.*reduce_from_region"):
        check_vocab_parallel_embedding(embed_plain_all_reduce)
    with fails("N=2 rank 0: the shard's gradient is 2× its rows' gradient.*identity"):
        check_vocab_parallel_embedding(embed_summed_both_ways)
    with fails("do not depend on weight_shard"):
        check_vocab_parallel_embedding(embed_detached)
    with fails(r"group of 2 in .* rank 0: the group of your all_reduce is that of all 4 ranks"):
        check_vocab_parallel_embedding(lambda t, w, s, group=None: embed_right(t, w, s, None))


# ---------------------------------------------------------------- issue 55: replicated KV heads

def holders_right(rank, tp, kv):
    shared = max(1, tp // kv)
    slot = rank // shared
    return slot, list(range(slot * shared, (slot + 1) * shared))


def holders_from_query_heads(rank, tp, kv):
    """Right, written differently: the KV head of this rank's first query head (8 query heads
    per KV head assumed: any multiple of tp works), its holders by the same rule."""
    a = 8 * kv * tp
    head = lambda q: (q * (a // tp)) // (a // kv)
    if tp <= kv:
        return rank, [rank]
    return head(rank), [q for q in range(tp) if head(q) == head(rank)]


def holders_round_robin(rank, tp, kv):
    slot = rank % kv if tp > kv else rank
    return slot, [q for q in range(tp) if (q % kv if tp > kv else q) == slot]


def holders_head_index(rank, tp, kv):
    return (rank * kv // tp, [rank]) if tp < kv else holders_right(rank, tp, kv)


def holders_without_me(rank, tp, kv):
    slot, holders = holders_right(rank, tp, kv)
    return slot, [h for h in holders if h != rank]


class ReplicasNotSummed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class ReplicasSummedOverEveryone(torch.autograd.Function):
    """Wrong: plain f — the sum over the whole group, holders of other heads too."""
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None, None, None


def _buffer_reduce(grad, slot, n_slots, group, op="sum", in_place=False):
    buf = grad.new_zeros((n_slots,) + tuple(grad.shape))
    buf[slot] = grad
    comm.all_reduce(buf, op=op, group=group)
    if in_place:
        grad.copy_(buf[slot])
        return grad
    return buf[slot].clone()


class ReplicasAveraged(torch.autograd.Function):
    """Wrong: the mean over the holders (world / n_slots of them)."""
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.args = slot, n_slots, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        slot, n_slots, group = ctx.args
        return _buffer_reduce(grad, slot, n_slots, group) / (dist.get_world_size(group) // n_slots), \
            None, None, None


class ReplicasPerSlot(torch.autograd.Function):
    """Right numbers, too many calls: one all-reduce per slot."""
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.args = slot, n_slots, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        slot, n_slots, group = ctx.args
        out = None
        for k in range(n_slots):
            part = grad.clone() if k == slot else torch.zeros_like(grad)
            comm.all_reduce(part, group=group)
            out = part if k == slot else out
        return out, None, None, None


class ReplicasInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.args = slot, n_slots, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return _buffer_reduce(grad, *ctx.args, in_place=True), None, None, None


class ReplicasReducedForward(torch.autograd.Function):
    """Wrong: sums the weight forward too."""
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.args = slot, n_slots, group
        return _buffer_reduce(w.detach(), slot, n_slots, group)

    @staticmethod
    def backward(ctx, grad):
        return _buffer_reduce(grad, *ctx.args), None, None, None


class ReplicasOnTheWorld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.args = slot, n_slots
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return _buffer_reduce(grad, *ctx.args, None), None, None, None


def test_kv_replicas_names_each_mistake():
    check_kv_replicas(holders_right, _CopyToReplicas)
    check_kv_replicas(holders_from_query_heads, _CopyToReplicas)
    with fails("not written yet"):
        check_kv_replicas(lambda *a: (_ for _ in ()).throw(NotImplementedError), _CopyToReplicas)
    with fails("not round-robin"):
        check_kv_replicas(holders_round_robin, _CopyToReplicas)
    with fails("its slot is its slice of the K/V weight"):
        check_kv_replicas(holders_head_index, _CopyToReplicas)
    with fails("this rank included"):
        check_kv_replicas(holders_without_me, _CopyToReplicas)
    with fails(r"N=4, n_slots=2, rank 0 \(slot 0\): gradient: this rank's part only"):
        check_kv_replicas(holders_right, ReplicasNotSummed)
    with fails("summed over every rank of the group, holders of other KV heads too"):
        check_kv_replicas(holders_right, ReplicasSummedOverEveryone)
    with fails("2× too small — a mean over the holders"):
        check_kv_replicas(holders_right, ReplicasAveraged)
    with fails(r"calls \(forward, backward\) = \[0, 2\].*one all-reduce"):
        check_kv_replicas(holders_right, ReplicasPerSlot)
    with fails("incoming gradient was changed in place"):
        check_kv_replicas(holders_right, ReplicasInPlace)
    with fails("forward changed the weight"):
        check_kv_replicas(holders_right, ReplicasReducedForward)
    with fails(r"group of 2 in .*: the group of your all_reduce is that of all 4 ranks"):
        check_kv_replicas(holders_right, ReplicasOnTheWorld)


class ReplicasSummingTheMean(torch.autograd.Function):
    """Wrong, yet right on the unit run's constant gradients: every element replaced by the
    gradient's mean before the sum. Only the model run against one process catches it."""
    @staticmethod
    def forward(ctx, w, slot, n_slots, group):
        ctx.args = slot, n_slots, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return _buffer_reduce(grad.mean().expand_as(grad).clone(), *ctx.args), None, None, None


def test_kv_replicas_model_run_catches_what_the_unit_run_cannot():
    with fails(r"tp=4 TinyLlama \(2 KV heads\), rank 0, block 0: W_K's gradient against one process"):
        check_kv_replicas(holders_right, ReplicasSummingTheMean)


def embed_grad_scaled_by_freq(tokens, shard, start, group=None):
    """Wrong in backward only: scale_grad_by_freq divides each row's gradient by its count."""
    outside = (tokens < start) | (tokens >= start + shard.shape[0])
    local = (tokens - start).masked_fill(outside, 0)
    partial = torch.nn.functional.embedding(local, shard, scale_grad_by_freq=True)
    return reduce_from_region(partial.masked_fill(outside.unsqueeze(-1), 0.0), group)


def test_vocab_parallel_embedding_checks_the_gradient_itself():
    with fails(r"N=2 rank 0: gradient of weight_shard: \d+ of \d+ elements wrong"):
        check_vocab_parallel_embedding(embed_grad_scaled_by_freq)
