"""Checks for lesson 02 (data parallel).

- `check_assign_buckets(fn)`: `fn(nbytes, cap)` → lists of indices, consecutive tensors
  packed into buckets of at most `cap` bytes (a tensor larger than the cap alone).
- `check_grad_accumulation_steps(fn)`: `fn(gbs, mbs, dp)` → grad_acc with
  gbs = mbs × grad_acc × dp; a ValueError when no whole number of steps gives gbs.
- `check_average_gradients(fn)`: `fn(model, group=None)` replaces every `.grad` by its
  mean over the ranks, through picolib.comm; run on 2 and 3 ranks.
- `check_accumulate_and_step(fn)`: `fn(ddp, optimizer, micro_batches)` runs forward and
  backward on each (tokens, targets) micro-batch, communicating only on the last, then
  steps; run on 2 ranks against one process that sees the whole batch (the gradient
  handed to the optimizer, then the weights).
A problem every rank shares is reported once ("every rank"); a sum where a mean was wanted
is named as such (`_core.compare`); a wrong bucket list is shown beside the right one
with the rule it breaks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import Ledger
from ..data_parallel import DDP, assign_buckets
from ..model import LlamaConfig, TinyLlama, random_tokens
from ._core import call_student, compare, report, run_student

__all__ = ["check_assign_buckets", "check_grad_accumulation_steps",
           "check_average_gradients", "check_accumulate_and_step", "grad_accumulation_steps"]


def _run(worker, n, *args, name):
    return run_student(worker, n, *args, name=name)


def _bucket_problem(nbytes, cap, got, want) -> str:
    """One line: the bucket lists, and which rule the answer breaks."""
    head = f"nbytes={nbytes}, cap={cap}: got buckets {got!r}, expected {want!r}"
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return head + " — return a list of lists of indices"
    if got[::-1] == want:
        return head + " — the right buckets in reverse order: keep the order given (it is already backward's)"
    flat = [i for b in got for i in b]
    if sorted(flat) != list(range(len(nbytes))):
        return head + " — every index must appear exactly once"
    if flat != list(range(len(nbytes))):
        return head + (" — the buckets are in reverse order: keep the order given (it is "
                       "already backward's)" if flat == list(range(len(nbytes)))[::-1] else
                       " — a bucket must hold consecutive tensors, in the order given")
    over = [b for b in got if len(b) > 1 and sum(nbytes[i] for i in b) > cap]
    if over:
        return head + (f" — bucket {over[0]} holds {sum(nbytes[i] for i in over[0])} bytes, "
                       f"more than the cap: close a bucket *before* the next tensor would pass it")
    return head + " — a bucket was closed while the next tensor still fitted under the cap"


def check_assign_buckets(fn) -> None:
    """Buckets in the order given, closed when the next tensor would pass the cap."""
    cases = [([4, 4, 4, 10, 2], 8), ([1, 1, 1, 1], 2), ([3, 3, 3], 100), ([5, 5, 5], 1),
             ([16, 64, 16, 64], 64), ([2, 9, 2, 2, 9], 10), ([7], 7), ([], 8),
             ([256, 65536, 32768, 32768, 32768, 256, 16384], 2**17)]
    problems = []
    for nbytes, cap in cases:
        got = call_student(fn, list(nbytes), cap)
        if isinstance(got, (list, tuple)):
            got = [list(b) if isinstance(b, (list, tuple)) else b for b in got]
        want = assign_buckets(nbytes, cap)
        if got != want:
            problems.append(_bucket_problem(nbytes, cap, got, want))
    report("bucket assignment", problems, len(cases))


def grad_accumulation_steps(gbs: int, mbs: int, dp: int) -> int:
    """grad_acc such that gbs = mbs × grad_acc × dp (the reference answer)."""
    if gbs % (mbs * dp):
        raise ValueError(f"gbs={gbs} is not a multiple of mbs×dp = {mbs}×{dp} = {mbs * dp}")
    return gbs // (mbs * dp)


def check_grad_accumulation_steps(fn) -> None:
    """Whole numbers of steps, and a ValueError where none exists (1024 samples, mbs 2, dp 12)."""
    good = [(1024, 2, 128), (1024, 2, 512), (1024, 2, 16), (16, 2, 2), (8, 8, 1), (4096, 4, 64)]
    bad = [(1024, 2, 12), (10, 4, 1), (16, 2, 3)]
    problems = []
    for gbs, mbs, dp in good:
        problems += compare(f"gbs={gbs}, mbs={mbs}, dp={dp}", call_student(fn, gbs, mbs, dp),
                            grad_accumulation_steps(gbs, mbs, dp))
    for gbs, mbs, dp in bad:
        try:
            got = call_student(fn, gbs, mbs, dp)
        except ValueError:
            continue
        problems.append(f"gbs={gbs}, mbs={mbs}, dp={dp}: returned {got!r}; mbs×dp = "
                        f"{mbs * dp} does not divide {gbs}, so raise ValueError")
    report("gradient accumulation steps", problems, len(good) + len(bad))


def _small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _average_worker(fn):
    rank = dist.get_rank()
    model = _small_model(0)
    g = torch.Generator().manual_seed(100 + rank)
    model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
    with Ledger() as ledger:
        call_student(fn, model)
    return [p.grad.clone() for p in model.parameters()], ledger.summary()


def _one_line_per_n(n, per_rank: list[list[str]]) -> list[str]:
    """The same problem on every rank is one line ("every rank"), else one per rank."""
    lines = per_rank
    if all(ls == lines[0] for ls in lines):
        return [f"N={n}, every rank: {p}" for p in lines[0]]
    return [f"N={n} rank {r}: {p}" for r, ls in enumerate(lines) for p in ls]


def check_average_gradients(fn) -> None:
    """Every rank ends with the mean of all ranks' gradients, computed with picolib.comm."""
    problems, checks = [], 0
    for n in (2, 3):
        expected = []
        for rank in range(n):  # the reference: every rank's gradients, in one process
            model = _small_model(0)
            g = torch.Generator().manual_seed(100 + rank)
            model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
            expected.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        mean = torch.stack(expected).mean(0)
        per_rank = []
        for grads, summary in _run(_average_worker, n, fn, name="average_gradients"):
            checks += 2
            mine = compare("gradients (all parameters, flattened)",
                           torch.cat([g.flatten() for g in grads]), mean, atol=1e-6)
            if "all_reduce" not in summary:
                mine.append("calls: no picolib.comm.all_reduce was called (collectives "
                            f"seen: {sorted(summary) or 'none'})")
            per_rank.append(mine)
        problems += _one_line_per_n(n, per_rank)
    report("naive gradient averaging", problems, checks)


_CFG = LlamaConfig(n_layers=1, hidden=32, n_heads=2, n_kv_heads=1, ffn_hidden=48)


def _micro_batches(step_rows, pieces):
    tokens, targets = step_rows
    k = tokens.shape[0] // pieces
    return [(tokens[i * k:(i + 1) * k], targets[i * k:(i + 1) * k]) for i in range(pieces)]


def _accumulate_worker(fn, grad_acc):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(_CFG)
    ddp = DDP(model, bucket_cap_bytes=2**13)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    step = opt.step

    def step_and_record(*args, **kwargs):     # the gradient the optimizer is given
        seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        return step(*args, **kwargs)

    opt.step = step_and_record
    tokens, targets = random_tokens(8, 8, _CFG.vocab_size, seed=7)
    mine = _micro_batches((tokens, targets), n)[rank]
    with Ledger() as ledger:
        call_student(fn, ddp, opt, _micro_batches(mine, grad_acc))
    weights = [p.detach().clone() for p in model.parameters()]
    return weights, ledger.count("all_reduce"), len(ddp.buckets), seen


def check_accumulate_and_step(fn) -> None:
    """The gradient given to the optimizer equals the whole batch's; the weights equal one
    SGD step on the whole batch; one all-reduce per bucket in all."""
    grad_acc = 2
    model = TinyLlama(_CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.loss(*random_tokens(8, 8, _CFG.vocab_size, seed=7)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    opt.step()
    expected = [p.detach().clone() for p in model.parameters()]
    per_rank, checks = [], 0
    for weights, calls, buckets, seen in _run(_accumulate_worker, 2, fn, grad_acc,
                                              name="accumulate_and_step"):
        checks += 3
        mine = []
        if len(seen) != 1:
            mine.append(f"optimizer: step() called {len(seen)} times; once, after the last "
                        "micro-batch")
        else:
            mine += compare("gradient at the step", seen[0], grad, atol=1e-5)
            if not mine:
                mine += compare("weights after the step", weights, expected, atol=1e-5)[:1]
        if calls != buckets:
            mine.append(f"traffic: {calls} all-reduces for {grad_acc} micro-batches; with "
                        f"no_sync on all but the last there are {buckets} (one per bucket)")
        per_rank.append(mine)
    report("accumulation with no_sync", _one_line_per_n(2, per_rank), checks)
