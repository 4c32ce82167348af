"""Data parallelism (picolib.data_parallel) against one process that sees the whole batch.

Tolerance: weights after 3 SGD steps agree to atol=1e-5 (fp32). The parallel run sums
per-rank means in a different order than the single process sums the batch, so the
results differ by rounding (measured ~1e-8); SGD's update is linear in the gradient
and does not amplify that.
"""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from picolib.comm import Ledger
from picolib.data_parallel import DDP, all_reduce_gradients, assign_buckets
from picolib.launch import WorkerError, run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.timeline import Timeline
from picolib.tryit.lesson02 import rows, single_process   # the lesson's batch slices and one-process reference

CFG = LlamaConfig(n_layers=2)
GBS, SEQ, STEPS, LR, ATOL = 8, 16, 3, 0.1, 1e-5


def batch(step):
    return random_tokens(GBS, SEQ, CFG.vocab_size, seed=100 + step)


def single_process_weights(steps=STEPS):
    return single_process(CFG, batch, steps, LR)


def assert_weights_close(results, expected):
    for weights in results:
        for got, want in zip(weights, expected, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def naive_worker():
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        model.loss(*rows(*batch(step), n, rank)).backward()
        all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def ddp_worker(bucket_cap_bytes, grad_acc=1, set_to_none=True, overlap=True):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG.replace(seed=rank))  # different weights: the broadcast must fix them
    ddp = DDP(model, bucket_cap_bytes=bucket_cap_bytes, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    calls = []
    for step in range(STEPS):
        tokens, targets = rows(*batch(step), n, rank)
        for micro in range(grad_acc):
            x, y = rows(tokens, targets, grad_acc, micro)
            with Ledger() as ledger:
                if micro < grad_acc - 1:
                    with ddp.no_sync():
                        (ddp.module.loss(x, y) / grad_acc).backward()
                else:
                    (ddp.module.loss(x, y) / grad_acc).backward()
            calls.append(ledger.count("all_reduce"))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return [p.detach().clone() for p in model.parameters()], calls, len(ddp.buckets)


@pytest.mark.parametrize("n", [2, 4])
def test_naive_dp_matches_single_process(n):
    assert_weights_close(run(naive_worker, n, timeout=180), single_process_weights())


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_matches_single_process(n):
    out = run(ddp_worker, n, 2**15, timeout=180)
    assert_weights_close([w for w, _, _ in out], single_process_weights())
    assert out[0][2] > 1  # several buckets were exercised


def test_ddp_without_overlap_matches_single_process():
    out = run(ddp_worker, 2, 2**15, overlap=False, timeout=180)
    assert_weights_close([w for w, _, _ in out], single_process_weights())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_ddp_grad_accumulation_with_no_sync_equals_big_batch(set_to_none):
    out = run(ddp_worker, 2, 2**14, grad_acc=2, set_to_none=set_to_none, timeout=180)
    assert_weights_close([w for w, _, _ in out], single_process_weights())
    _, calls, buckets = out[0]
    assert calls == [0, buckets] * STEPS  # accumulation steps: no all-reduce at all


def bucket_count_worker(cap):
    model = TinyLlama(CFG)
    ddp = DDP(model, bucket_cap_bytes=cap)
    sizes = [p.numel() * p.element_size() for p in model.parameters()][::-1]
    x, y = random_tokens(2, SEQ, CFG.vocab_size, seed=dist.get_rank())
    with Ledger() as ledger:
        ddp.module.loss(x, y).backward()
    with Ledger() as second:
        ddp(x).sum().backward()
    return (ledger.count("all_reduce"), second.count("all_reduce"), len(ddp.buckets),
            len(assign_buckets(sizes, cap)), ddp.bucket_bytes(), ledger.total("nbytes"))


@pytest.mark.parametrize("cap", [1, 2**12, 2**15, 10**9])
def test_one_all_reduce_per_bucket_per_step(cap):
    calls, calls_again, buckets, expected, bucket_bytes, nbytes = run(
        bucket_count_worker, 2, cap, timeout=180)[0]
    n_params = sum(1 for _ in TinyLlama(CFG).parameters())
    assert calls == calls_again == buckets == expected
    assert sum(bucket_bytes) == nbytes == 4 * sum(p.numel() for p in TinyLlama(CFG).parameters())
    if cap == 1:
        assert buckets == n_params
    if cap == 10**9:
        assert buckets == 1


def test_assign_buckets_fills_in_order_up_to_the_cap():
    assert assign_buckets([4, 4, 4, 10, 2], cap=8) == [[0, 1], [2], [3], [4]]
    assert assign_buckets([3, 3, 3], cap=100) == [[0, 1, 2]]
    assert assign_buckets([5, 5], cap=1) == [[0], [1]]
    assert assign_buckets([], cap=8) == []
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([1], cap=0)


def overlap_worker(overlap):
    model = TinyLlama(CFG)
    ddp = DDP(model, bucket_cap_bytes=2**14, overlap=overlap, timeline=Timeline())
    seen = []  # all-reduces already issued when the last gradient (the embedding's) is ready
    model.embed.weight.register_post_accumulate_grad_hook(lambda p: seen.append(ledger.count()))
    x, y = random_tokens(2, SEQ, CFG.vocab_size, seed=dist.get_rank())
    with Ledger() as ledger:
        ddp.module.loss(x, y).backward()
    return seen, len(ddp.buckets), ddp.timeline.events


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_are_issued_during_backward_only_with_overlap(overlap):
    seen, buckets, events = run(overlap_worker, 2, overlap, timeout=180)[0]
    assert buckets > 2
    assert seen == ([buckets] if overlap else [0])
    comm_spans = [e for e in events if e["name"] == "all_reduce"]
    assert [e["meta"]["bucket"] for e in comm_spans] == list(range(buckets))
    assert all(e["lane"] == "comm" and e["end"] >= e["start"] for e in comm_spans)


def emulated_link_worker(cost):
    tl = Timeline(emulate={"all_reduce": cost})
    ddp = DDP(TinyLlama(CFG), bucket_cap_bytes=2**15, timeline=tl)
    x, y = random_tokens(2, SEQ, CFG.vocab_size, seed=0)
    ddp.module.loss(x, y).backward()
    return tl.events, len(ddp.buckets)


def test_emulated_link_serialises_the_all_reduces():
    events, buckets = run(emulated_link_worker, 2, 0.02, timeout=180)[0]
    assert len(events) == buckets and all(e["emulated"] for e in events)
    for before, after in zip(events, events[1:]):
        assert after["end"] >= before["end"] + 0.02 - 1e-9
    assert all(e["end"] - e["start"] >= 0.02 - 1e-9 for e in events)


def late_rank_worker(cost):
    tl = Timeline(emulate={"all_reduce": cost})
    model = TinyLlama(CFG)
    ddp = DDP(model, bucket_cap_bytes=2**15, timeline=tl)
    x, y = random_tokens(2, SEQ, CFG.vocab_size, seed=0)
    if dist.get_rank() == 1:
        time.sleep(0.1)                      # rank 1 starts backward late: it issues later
    model.loss_fn(ddp(x), y).backward()
    return tl.events


def test_no_all_reduce_starts_before_every_rank_has_issued_it():
    """Issue 59: the emulated link started each all-reduce at this rank's own issue, so the
    early rank's all-reduces were drawn (and slept) as done before the late rank issued them."""
    early, late = run(late_rank_worker, 2, 0.02, timeout=180)
    assert len(early) == len(late) > 1
    for a, b in zip(early, late):
        assert b["meta"]["issued"] > a["meta"]["issued"] + 0.05        # the skew is there
        assert min(a["start"], b["start"]) >= b["meta"]["issued"]
        assert a["end"] >= a["start"] + 0.02 - 1e-9


def unused_parameter_worker():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ddp = DDP(model, bucket_cap_bytes=64)
    x = torch.full((2, 4), float(dist.get_rank() + 1))
    with Ledger() as ledger:
        model[0](x).sum().backward()  # model[1] gets no gradient
    grads = model[0].weight.grad.clone(), model[1].weight.grad.clone()
    return (*grads, ledger.count(), len(ddp.buckets))


def test_parameters_without_gradient_still_take_part():
    g0, g1, calls, buckets = run(unused_parameter_worker, 2, timeout=180)[0]
    assert calls == buckets
    torch.testing.assert_close(g0, torch.full((4, 4), 3.0))  # mean over ranks of 2·(r+1)
    torch.testing.assert_close(g1, torch.zeros(4, 4))


# --------------------------------------------------------------------------- bad input

def test_bad_bucket_cap_is_a_clear_error_before_any_work():
    model = TinyLlama(CFG)
    with pytest.raises(ValueError, match="bucket_cap_bytes must be > 0, not 0"):
        DDP(model, bucket_cap_bytes=0)
    with pytest.raises(ValueError, match="> 0, not -5"):
        DDP(model, bucket_cap_bytes=-5)
    with pytest.raises(TypeError, match="bucket_cap_bytes must be an int"):
        DDP(model, bucket_cap_bytes=1.5)
    assert all(p.grad is None for p in model.parameters())  # nothing was attached


def test_no_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="initialised process group"):
        DDP(TinyLlama(CFG))
    with pytest.raises(RuntimeError, match="initialised process group"):
        all_reduce_gradients(TinyLlama(CFG))


def not_member_worker():
    group = dist.new_group([0])
    with Ledger() as ledger:
        try:
            DDP(TinyLlama(CFG), group=group)
        except ValueError as e:
            return str(e), ledger.count()
    return "no error", ledger.count()


def test_rank_outside_the_group_is_a_clear_error():
    out = run(not_member_worker, 2, timeout=180)
    assert out[0] == ("no error", 1)  # rank 0 forms a group of one: one broadcast
    assert "rank 1 is not a member" in out[1][0] and out[1][1] == 0


def several_devices_worker():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with Ledger() as ledger:
        try:
            DDP(model)
        except ValueError as e:
            return str(e), ledger.count()
    return "no error", ledger.count()


def test_parameters_on_several_devices_are_a_clear_error():
    for message, calls in run(several_devices_worker, 2, timeout=180):
        assert "one device" in message and "cpu" in message and "meta" in message
        assert calls == 0


def test_module_must_have_trainable_parameters():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters"):
        DDP(frozen)
    with pytest.raises(TypeError, match="nn.Module"):
        DDP(lambda x: x)


# --------------------------------------------------------------------------- non-finite

def nan_worker(catch):
    """Step 1 is healthy; in step 2 rank 1 multiplies its loss by NaN; step 3 is healthy."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    ddp = DDP(model, bucket_cap_bytes=2**15)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    message, untouched = None, None
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        loss = model.loss(*rows(*batch(step), n, rank))
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        try:
            loss.backward()
        except FloatingPointError as e:
            if not catch:
                raise
            message = str(e)
            untouched = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return message, untouched, finite, ddp.syncs


def test_nan_loss_on_one_rank_is_reported_by_every_rank(no_leftover_workers):
    with pytest.raises(WorkerError, match=r"step 2: a gradient is NaN or inf after the all-reduce; "
                                          r"the local gradient was non-finite on rank 1\."):
        run(nan_worker, 2, False, timeout=60)
    for message, untouched, finite, syncs in run(nan_worker, 2, True, timeout=60):
        assert message.startswith("step 2: ") and "non-finite on rank 1." in message
        assert untouched and finite and syncs == 3   # backward raised before the optimizer ran


def test_requires_gradient_sync_must_be_a_bool():
    def worker():
        ddp = DDP(nn.Linear(2, 2))
        try:
            ddp.set_requires_gradient_sync(0)
        except TypeError as e:
            return str(e), ddp._sync
    assert run(worker, 1)[0] == ("requires_gradient_sync must be a bool, not 0", True)


# --------------------------------------------------------------------------- the contract

def owned_optimizer_worker():
    """DDP owning its AdamW: step()/zero_grad() on the wrapper, memory(), and step() on a
    DDP that owns none."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    ddp = DDP(model, optimizer=torch.optim.AdamW, lr=1e-3)
    for step in range(STEPS):
        model.loss(*rows(*batch(step), n, r)).backward()
        ddp.step()
        ddp.zero_grad()
    zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    bare = DDP(TinyLlama(CFG))
    try:
        bare.step()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return [p.detach().clone() for p in model.parameters()], ddp.memory(), zeroed, refused


def test_ddp_owning_its_optimizer_follows_the_contract():
    model = TinyLlama(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        model.loss(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
    psi = sum(p.numel() for p in model.parameters())
    for weights, memory, zeroed, refused in run(owned_optimizer_worker, 2):
        for w, ref in zip(weights, model.parameters(), strict=True):
            torch.testing.assert_close(w, ref.detach(), atol=1e-5, rtol=0)   # Adam: rounding, seen ≤ 3e-6
        assert memory == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
        assert zeroed and "owns no optimizer" in refused


def bf16_compute_worker():
    """DDP(param_dtype=bf16): bf16 compute copies of fp32 masters, AdamW on the masters."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    ddp = DDP(model, optimizer=torch.optim.AdamW, lr=1e-3, param_dtype=torch.bfloat16)
    for step in range(STEPS):
        model.loss(*rows(*batch(step), n, r)).backward()
        ddp.step()
        ddp.zero_grad()
    return ([m.detach().clone() for m in ddp.masters.values()],
            [p.detach().clone() for p in model.parameters()], ddp.memory(),
            {k: t.dtype for k, t in ddp.state_dict()["model"].items()})


def test_ddp_bf16_compute_copies_equal_one_process_with_the_same_recipe():
    """The recipe written out in one process: bf16 copies of the model compute each rank's
    half; each half's bf16 gradient is halved and the two summed in bf16 (DDP's all-reduce),
    made fp32 onto the fp32 masters, which AdamW steps; the copies follow. Masters agree to
    atol 1e-6 (the bf16 sum is the same two roundings either way; seen 0), the bf16 copies
    are the masters rounded, and the bytes are ZeRO's: 2 + 2 + (4 + 8) per parameter.
    The recipe is really bf16: fp32 training ends > 1e-4 away."""
    ref = TinyLlama(CFG)
    masters = [nn.Parameter(p.detach().clone()) for p in ref.parameters()]
    copy = TinyLlama(CFG)
    for p in copy.parameters():     # the parameters only: buffers (the RoPE tables) stay fp32
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-3)
    for step in range(STEPS):
        halves = [torch.autograd.grad(copy.loss(*rows(*batch(step), 2, piece)),
                                      list(copy.parameters())) for piece in range(2)]
        for m, g0, g1 in zip(masters, *halves):
            m.grad = (g0 / 2 + g1 / 2).float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(copy.parameters(), masters):
                p.copy_(m)
    fp32 = TinyLlama(CFG)
    fp32_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    for step in range(STEPS):
        fp32.loss(*batch(step)).backward()
        fp32_opt.step()
        fp32_opt.zero_grad()
    assert max((p - m).abs().max().item() for p, m in zip(fp32.parameters(), masters)) > 1e-4
    psi = sum(p.numel() for p in ref.parameters())
    for got, params, memory, dtypes in run(bf16_compute_worker, 2):
        for g, w, p in zip(got, masters, params, strict=True):
            torch.testing.assert_close(g, w.detach(), atol=1e-6, rtol=0)
            assert p.dtype == torch.bfloat16 and torch.equal(p, g.to(torch.bfloat16))
        assert memory == {"params": 2 * psi, "grads": 2 * psi, "optimizer": (4 + 8) * psi}
        assert set(dtypes.values()) == {torch.float32}     # a checkpoint holds the masters


def test_ddp_bf16_compute_needs_an_owned_optimizer():
    def worker():
        try:
            DDP(nn.Linear(2, 2), param_dtype=torch.bfloat16)
        except ValueError as e:
            return str(e)
    assert "pass optimizer= as well" in run(worker, 1)[0]


def autocast_worker():
    """One backward under bf16 autocast on this rank's half of the batch; DDP averages the
    fp32 gradients."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    DDP(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(*rows(*batch(0), n, r))
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_ddp_under_bf16_autocast_equals_one_process_under_the_same_autocast():
    """The one process runs each rank's half under the same autocast and averages: the same
    bf16 matmuls, so only the fp32 sum order differs (atol 1e-6). Without autocast the
    gradients differ by far more (> 1e-4): the autocast is really on."""
    model = TinyLlama(CFG)
    for piece in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(*rows(*batch(0), 2, piece)) / 2
        loss.backward()
    want = [p.grad for p in model.parameters()]
    fp32 = TinyLlama(CFG)
    fp32.loss(*batch(0)).backward()
    assert max((p.grad - w).abs().max().item() for p, w in zip(fp32.parameters(), want)) > 1e-4
    for grads in run(autocast_worker, 2):
        for g, w in zip(grads, want, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
