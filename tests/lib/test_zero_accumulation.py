"""Gradient accumulation and a fixed communication order, for DDP and ZeRO-1/2/3
(picolib/data_parallel.py, picolib/zero.py; lessons 02-03).

1. Three micro-batches accumulated per step (no_sync() on some steps,
   set_requires_gradient_sync() on the others) equal one process training on the global
   batch: the loss of every step and every weight after three Adam steps.
2. A model whose forward visits its blocks in a rank-dependent order, and skips one on
   some ranks, trains exactly as one process would: ZeRO issues its collectives in one
   fixed order on every rank (it used to be silently wrong in stages 1-2 and to hang in
   stage 3).

3. `ZeRO(..., reduce_every_micro_batch=True)` (stages 2-3) reduce-scatters after every
   micro-batch, adds into the shards, and holds no whole gradient between micro-batches:
   the same losses, weights and (summed over the step) gradients as one process.

Tolerance (fp32): atol 1e-5 on the weights. The parallel runs sum the micro-batch and
per-rank means in another order than one process summing the global batch, so the
gradients differ in the last bits (≈1e-8 seen). Adam divides by √v + eps: with torch's
eps = 1e-8 a gradient element of ~1e-9 (this model has some) turns a 1e-10 rounding
difference into 2e-5 on its weight, so both sides use eps = 1e-6 (≤ 7e-7 seen).
Losses: atol 1e-6 (≤ 4e-7 seen).
"""
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from picolib.comm import Ledger
from picolib.data_parallel import DDP
from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.zero import ZeRO

CFG = LlamaConfig(vocab_size=61, hidden=16, n_layers=2, n_heads=2, n_kv_heads=1,
                  ffn_hidden=24, max_seq=16, seed=5)
MB, SEQ, MICRO, STEPS, LR, EPS = 2, 8, 3, 3, 1e-2, 1e-6
WEIGHT_ATOL, LOSS_ATOL = 1e-5, 1e-6
WRAPPERS = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2 every", "ZeRO-3 every"]


def make_zero(model, name):
    """"ZeRO-s" or "ZeRO-s every" (reduce-scatter after every micro-batch)."""
    return ZeRO(model, int(name[5]), optimizer="adam", lr=LR, eps=EPS,
                reduce_every_micro_batch=name.endswith("every"))


def global_batch(step, n):
    return random_tokens(MB * MICRO * n, SEQ, CFG.vocab_size, seed=300 + step)


def reference(n):
    """One process, the global batch of every step at once."""
    model = TinyLlama(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        loss = model.loss(*global_batch(step, n))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses


def accumulate_worker():
    """Each wrapper: STEPS steps of MICRO micro-batches from this rank's rows. Returns the
    weights, the loss of each step (this rank's share) and, per backward, the number of
    gradient collectives (all-reduce / reduce-scatter) it issued and the gradient bytes
    it held after it."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in WRAPPERS:
        model = TinyLlama(CFG)
        if name == "DDP":
            wrapper = DDP(model)
            opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        else:
            wrapper = make_zero(model, name)
        losses, calls, held = [], [], []
        for step in range(STEPS):
            x, y = global_batch(step, n)
            rows = MB * MICRO
            x, y = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
            total = 0.0
            for i in range(MICRO):
                last = i == MICRO - 1
                if step % 2 == 0:     # the context manager ...
                    context = nullcontext() if last else wrapper.no_sync()
                else:                 # ... or the flag a pipeline executor sets
                    wrapper.set_requires_gradient_sync(last)
                    context = nullcontext()
                with context, Ledger() as led:
                    loss = model.loss(x[i * MB:(i + 1) * MB], y[i * MB:(i + 1) * MB]) / MICRO
                    loss.backward()
                calls.append(led.count("all_reduce") + led.count("reduce_scatter"))
                if name != "DDP":
                    held.append(wrapper.memory()["grads"])
                total += loss.item()
            stepper = opt if name == "DDP" else wrapper  # ZeRO owns its optimizer
            stepper.step()
            stepper.zero_grad()
            losses.append(total)
        weights = ({k: p.detach().clone() for k, p in model.named_parameters()} if name == "DDP"
                   else wrapper.gather_parameters())
        groups = len(wrapper.buckets) if name == "DDP" else len(wrapper.units)
        shard = sum(u.grad.numel() * 4 for u in wrapper.units) if name != "DDP" else 0
        out[name] = dict(weights=weights, losses=losses, calls=calls, groups=groups, held=held,
                         shard=shard)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_accumulating_three_micro_batches_equals_the_global_batch(n):
    ranks = run(accumulate_worker, n, timeout=240)
    ref_weights, ref_losses = reference(n)
    for name in WRAPPERS:
        mean_loss = [sum(r[name]["losses"][s] for r in ranks) / n for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(mean_loss), torch.tensor(ref_losses),
                                   atol=LOSS_ATOL, rtol=0, msg=f"{name} N={n} losses")
        for rank, res in enumerate(ranks):
            assert set(res[name]["weights"]) == set(ref_weights)
            for k, w in ref_weights.items():
                torch.testing.assert_close(res[name]["weights"][k], w, atol=WEIGHT_ATOL, rtol=0,
                                           msg=f"{name} N={n} rank {rank} {k}")
            # the gradients are communicated once per step, in the last backward, or
            # (reduce_every_micro_batch) after every backward
            g, r = res[name]["groups"], res[name]
            want = [g, g, g] if name.endswith("every") else [0, 0, g]
            assert g >= 1 and r["calls"] == want * STEPS, (name, r["calls"])
            if name.endswith("every"):     # between micro-batches: the shards only
                assert r["held"] == [r["shard"]] * (MICRO * STEPS), (name, r["held"])
            elif name in ("ZeRO-2", "ZeRO-3"):   # whole gradients until the last backward
                assert min(r["held"][0], r["held"][1]) > (n - 1) * r["shard"], (name, r["held"])


def gradient_worker(name):
    """One step of MICRO micro-batches; the reduced gradient, gathered from the shards."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    wrapper = make_zero(model, name)
    x, y = global_batch(0, n)
    rows = MB * MICRO
    x, y = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
    for i in range(MICRO):
        wrapper.set_requires_gradient_sync(i == MICRO - 1)
        (model.loss(x[i * MB:(i + 1) * MB], y[i * MB:(i + 1) * MB]) / MICRO).backward()
    wrapper.finish_gradient_sync()
    return {k: v for u in wrapper.units for k, v in u.gather(u.grad, None).items()}


@pytest.mark.parametrize("name", ["ZeRO-2", "ZeRO-2 every", "ZeRO-3 every"])
def test_accumulated_gradients_equal_one_process(name):
    n = 2
    model = TinyLlama(CFG)
    model.loss(*global_batch(0, n)).backward()
    for rank, got in enumerate(run(gradient_worker, n, name, timeout=60)):
        for k, p in model.named_parameters():
            torch.testing.assert_close(got[k], p.grad, atol=1e-6, rtol=1e-5,
                                       msg=f"{name} rank {rank} {k}")


def test_reduce_every_micro_batch_needs_stage_2_or_3():
    with pytest.raises(ValueError, match="stage 2 or 3"):
        ZeRO(TinyLlama(CFG), 1, reduce_every_micro_batch=True)


# --------------------------------------------------------------------------- the order

class Shuffled(nn.Module):
    """embed → residual blocks, in the order `order` (any subset) → head."""

    def __init__(self, hidden=16, vocab=29, blocks=3):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                                    for _ in range(blocks))
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, order):
        h = self.embed(x)
        for k in order:
            h = h + self.blocks[k](h)
        return self.head(h)


# rank r's order of the blocks: rank 1 skips block 1, rank 3 skips block 0
ORDERS = [[0, 1, 2], [2, 0], [1, 2, 0], [2, 1]]
VOCAB = 29


def shuffled_batch(step, rank):
    return random_tokens(4, 6, VOCAB, seed=1000 * step + rank)


def shuffled_loss(model, step, rank):
    x, y = shuffled_batch(step, rank)
    return F.cross_entropy(model(x, ORDERS[rank]).flatten(0, 1), y.flatten())


def shuffled_reference(n):
    model = Shuffled()
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        (sum(shuffled_loss(model, step, r) for r in range(n)) / n).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def shuffled_worker(name):
    r = dist.get_rank()
    model = Shuffled()
    if name == "DDP":
        wrapper, opt = DDP(model, bucket_cap_bytes=1200), torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    else:
        wrapper = make_zero(model, name)
    for step in range(STEPS):
        shuffled_loss(model, step, r).backward()
        stepper = opt if name == "DDP" else wrapper  # ZeRO owns its optimizer
        stepper.step()
        stepper.zero_grad()
    if name == "DDP":
        return {k: p.detach().clone() for k, p in model.named_parameters()}
    return wrapper.gather_parameters()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", WRAPPERS)
def test_rank_dependent_use_order_matches_one_process(name, n):
    ref = shuffled_reference(n)
    for rank, got in enumerate(run(shuffled_worker, n, name, timeout=60)):
        assert set(got) == set(ref)
        for k, w in ref.items():
            torch.testing.assert_close(got[k], w, atol=WEIGHT_ATOL, rtol=0,
                                       msg=f"{name} N={n} rank {rank} {k}")
