"""The mappings (picolib.mappings) against one process: each conjugate pair's forward and
backward, values and gradients, on 2 and 4 ranks, along dims 0, 1 and -1; and what each
moves through picolib.comm (one collective where due, bytes by the ring formula).

The single-process reference writes the distributed computation as one function of all
ranks' inputs. A *replicated* input (copy, scatter) is one tensor that every rank holds;
a *replicated* output (reduce, gather) feeds the same downstream computation on every rank,
so its loss counts once; every other output feeds a rank's own downstream (upstream
gradient g_r). Tolerance: fp32, atol=1e-6 (only the all-reduce and reduce-scatter add,
in another order than the reference's sum)."""
import pytest
import torch

from picolib import comm
from picolib.comm import ring_sent_bytes
from picolib.launch import run
from picolib.mappings import (all_gather_to_region, copy_to_region, copy_to_replicas, gather_along,
                              gather_from_region, reduce_from_region, reduce_scatter_to_region,
                              scatter_to_region, shard, split_along)

ATOL = 1e-6
FULL = (4, 8, 4)           # every dim divides by 2 and by 4
FULL_BYTES = 4 * 8 * 4 * 4

# name: (the mapping, replicated input, replicated output, reference forward on all
#        ranks' inputs → each rank's output, the comm ops forward, the comm ops backward)
CASES = {
    "copy_to_region": (lambda x, d: copy_to_region(x), True, False,
                       lambda xs, d, n: [xs[0]] * n, [], ["all_reduce"]),
    "reduce_from_region": (lambda x, d: reduce_from_region(x), False, True,
                           lambda xs, d, n: [sum(xs)] * n, ["all_reduce"], []),
    "scatter_to_region": (scatter_to_region, True, False,
                          lambda xs, d, n: list(xs[0].chunk(n, d)), [], ["all_gather"]),
    "gather_from_region": (gather_from_region, False, True,
                           lambda xs, d, n: [torch.cat(xs, d)] * n, ["all_gather"], []),
    "reduce_scatter_to_region": (reduce_scatter_to_region, False, False,
                                 lambda xs, d, n: list(sum(xs).chunk(n, d)),
                                 ["reduce_scatter"], ["all_gather"]),
    "all_gather_to_region": (all_gather_to_region, False, False,
                             lambda xs, d, n: [torch.cat(xs, d)] * n,
                             ["all_gather"], ["reduce_scatter"]),
}
CONJUGATES = [("copy_to_region", "reduce_from_region"), ("scatter_to_region", "gather_from_region"),
              ("reduce_scatter_to_region", "all_gather_to_region")]


def _inputs(name, n, dim, seed):
    """Each rank's input and upstream gradient, and the single-process expectations."""
    _, rep_in, rep_out, forward, _, _ = CASES[name]
    g = torch.Generator().manual_seed(seed)
    in_shape = list(FULL)
    if name in ("gather_from_region", "all_gather_to_region"):
        in_shape[dim] //= n                       # each rank holds a slice
    leaves = [torch.randn(in_shape, generator=g).requires_grad_() for _ in range(1 if rep_in else n)]
    outs = forward(leaves, dim, n)
    ups = [torch.randn(outs[0 if rep_out else r].shape, generator=g) for r in range(n)]
    if rep_out:
        ups = [ups[0]] * n
        loss = (outs[0] * ups[0]).sum()
    else:
        loss = sum((y * u).sum() for y, u in zip(outs, ups, strict=True))
    loss.backward()
    xs = [leaves[0 if rep_in else r].detach() for r in range(n)]
    grads = [leaves[0 if rep_in else r].grad for r in range(n)]
    return xs, ups, [y.detach() for y in outs], grads


def _one_rank(name, xs, ups, dim):
    import torch.distributed as dist
    r = dist.get_rank()
    x = xs[r].clone().requires_grad_()
    with comm.Ledger() as fwd:
        y = CASES[name][0](x, dim)
    with comm.Ledger() as bwd:
        y.backward(ups[r])
    records = [[(rec.op, rec.nbytes, rec.sent_bytes) for rec in led.records] for led in (fwd, bwd)]
    return y.detach(), x.grad, records


def _all_cases(cases):
    return [_one_rank(name, xs, ups, dim) for name, dim, xs, ups in cases]


@pytest.mark.parametrize("n", [2, 4])
def test_each_pair_matches_one_process_and_moves_one_collective_each_way(n):
    plan, expected = [], []
    for i, name in enumerate(CASES):
        for dim in (0, 1, -1):
            xs, ups, outs, grads = _inputs(name, n, dim, seed=10 * i + dim % 3)
            plan.append((name, dim, xs, ups))
            expected.append((name, dim, outs, grads))
    ranks = run(_all_cases, n, plan, timeout=120)
    for r, results in enumerate(ranks):
        moved = {}
        for (name, dim, outs, grads), (y, grad, (fwd, bwd)) in zip(expected, results, strict=True):
            moved[name, dim] = fwd, bwd
            where = f"{name} dim={dim} rank {r} of {n}"
            assert y.shape == outs[r].shape, where
            assert torch.allclose(y, outs[r], atol=ATOL), where
            assert torch.allclose(grad, grads[r], atol=ATOL), where
            _, _, _, _, ops_fwd, ops_bwd = CASES[name]
            sent = {op: ring_sent_bytes(op, FULL_BYTES, n) for op in ops_fwd + ops_bwd}
            assert fwd == [(op, FULL_BYTES, sent[op]) for op in ops_fwd], where
            assert bwd == [(op, FULL_BYTES, sent[op]) for op in ops_bwd], where
        for a, b in CONJUGATES:         # what one moves forward, its conjugate moves backward
            for dim in (0, 1, -1):
                assert moved[a, dim] == moved[b, dim][::-1], (a, b, dim)


def _bad_split():
    errors = []
    x = torch.zeros(2, 5, 3)
    with comm.Ledger() as led:
        for fn in (scatter_to_region, reduce_scatter_to_region):
            try:
                fn(x, 1)
            except ValueError as e:
                errors.append(str(e))
        try:
            gather_from_region(x, 3)
        except ValueError as e:
            errors.append(str(e))
    return errors, led.count()


def test_uneven_split_is_a_clear_error_before_any_collective():
    for errors, calls in run(_bad_split, 2, timeout=120):
        assert calls == 0
        assert errors[:2] == ["cannot split size 5 (dim 1) into 2 equal shards"] * 2
        assert errors[2] == "dim=3 is out of range for a tensor of 3 dims"
    with pytest.raises(ValueError, match="cannot split size 6 .dim 0. into 4"):
        shard(torch.zeros(6, 2), 0, 0, 4)


def _async_gather_and_split():
    full = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    work, finish = gather_along(split_along(full, 1), 1, async_op=True)
    work.wait()
    return finish()


def test_async_gather_reassembles_the_split():
    full = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    for out in run(_async_gather_and_split, 2, timeout=120):
        assert torch.equal(out, full)


def _replicas(ups):
    import torch.distributed as dist
    r = dist.get_rank()
    w = torch.ones(3, 2, requires_grad=True)
    with comm.Ledger() as led:
        y = copy_to_replicas(w, r // 2, 2)        # ranks 0, 1 share slot 0; ranks 2, 3 slot 1
        y.backward(ups[r])
    return torch.equal(y.detach(), w.detach()), w.grad, [(rec.op, rec.nbytes) for rec in led.records]


def test_copy_to_replicas_sums_the_gradients_of_one_slot_only():
    g = torch.Generator().manual_seed(3)
    ups = [torch.randn(3, 2, generator=g) for _ in range(4)]
    for r, (same, grad, records) in enumerate(run(_replicas, 4, ups, timeout=120)):
        mine = 2 * (r // 2)
        assert same and torch.allclose(grad, ups[mine] + ups[mine + 1], atol=ATOL)
        assert records == [("all_reduce", 2 * 3 * 2 * 4)]     # one (n_slots, 3, 2) fp32 buffer
