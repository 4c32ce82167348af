"""Gradient accumulation and a fixed communication order, for DDP and ZeRO-1/2/3
(picolib/data_parallel.py, picolib/zero.py; lessons 02-03).

1. Three micro-batches accumulated per step (no_sync() on some steps,
   set_requires_gradient_sync() on the others) equal one process training on the global
   batch: the loss of every step and every weight after three Adam steps.
2. A model whose forward visits its blocks in a rank-dependent order, and skips one on
   some ranks, trains exactly as one process would: ZeRO issues its collectives in one
   fixed order on every rank (it used to be silently wrong in stages 1-2 and to hang in
   stage 3).

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
WRAPPERS = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


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
    gradient collectives (all-reduce / reduce-scatter) it issued."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in WRAPPERS:
        model = TinyLlama(CFG)
        if name == "DDP":
            wrapper = DDP(model)
            opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        else:
            wrapper = ZeRO(model, int(name[-1]), optimizer="adam", lr=LR, eps=EPS)
        losses, calls = [], []
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
                total += loss.item()
            stepper = opt if name == "DDP" else wrapper  # ZeRO owns its optimizer
            stepper.step()
            stepper.zero_grad()
            losses.append(total)
        weights = ({k: p.detach().clone() for k, p in model.named_parameters()} if name == "DDP"
                   else wrapper.gather_parameters())
        groups = len(wrapper.buckets) if name == "DDP" else len(wrapper.units)
        out[name] = dict(weights=weights, losses=losses, calls=calls, groups=groups)
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
            # the gradients are communicated once per step, in the last backward
            g = res[name]["groups"]
            assert g >= 1 and res[name]["calls"] == [0, 0, g] * STEPS, (name, res[name]["calls"])


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
        wrapper = ZeRO(model, int(name[-1]), optimizer="adam", lr=LR, eps=EPS)
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
