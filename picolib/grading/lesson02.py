"""Checks for lesson 02 (data parallel).

- `check_assign_buckets(fn)`: `fn(nbytes, cap)` → lists of indices, consecutive tensors
  packed into buckets of at most `cap` bytes (a tensor larger than the cap alone).
- `check_grad_accumulation_steps(fn)`: `fn(gbs, mbs, dp)` → grad_acc with
  gbs = mbs × grad_acc × dp; a ValueError when no whole number of steps gives gbs.
- `check_average_gradients(fn)`: `fn(model, group=None)` replaces every `.grad` by its
  mean over the ranks of `group`, through picolib.comm, and leaves the weights alone; run on
  2 and 3 ranks and on 4 ranks split into two groups of 2, with rank-dependent weights and
  gradients, one of them zero on one rank only (an answer that skips it hangs the others).
- `check_accumulate_and_step(fn)`: `fn(ddp, optimizer, micro_batches)` runs forward (through
  the wrapper, `ddp(tokens)`) and backward on each (tokens, targets) micro-batch,
  communicating only on the last, steps and zeroes the gradients; two steps in a row on 2 ranks × 3 micro-batches and on 3 ranks
  × 4 micro-batches, against one process that sees each whole batch (the gradient handed
  to the optimizer at each step, then the weights).
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
from ._core import (SUBGROUPS, ExerciseFailed, call_student, compare, compare_parameters, explain,
                    members, my_group, on_world_not_group, report, run_student)

__all__ = ["check_assign_buckets", "check_grad_accumulation_steps",
           "check_average_gradients", "check_accumulate_and_step", "grad_accumulation_steps"]


def _run(worker, n, *args, name, timeout=None):
    return run_student(worker, n, *args, name=name, timeout=timeout)


class _Raised:
    """What the student's function raised instead of returning (not ExerciseFailed)."""

    def __init__(self, error: Exception):
        self.error = error

    def __str__(self):
        text = str(self.error).splitlines()[0][:120] if str(self.error) else ""
        return f"raised {type(self.error).__name__}" + (f": {text}" if text else "")


def _call(fn, *args):
    """The student's result, or _Raised for an exception (an `assert` included), so that it
    becomes one problem line rather than a traceback."""
    try:
        return call_student(fn, *args)
    except ExerciseFailed:
        raise
    except Exception as e:
        return _Raised(e)


def _bucket_problem(nbytes, cap, got, want) -> str:
    """One line: the bucket lists, and which rule the answer breaks."""
    if isinstance(got, _Raised):
        return (f"nbytes={nbytes}, cap={cap}: {got}"
                + (" — with no tensors there are no buckets: return []" if not nbytes else ""))
    head = f"nbytes={nbytes}, cap={cap}: got buckets {got!r}, expected {want!r}"
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return head + " — return a list of lists of indices"
    if got[::-1] == want:
        return head + " — the right buckets in reverse order: keep the order given (it is already backward's)"
    if any(b == [] for b in got):
        return head + (" — an empty bucket: every bucket holds at least one tensor (no tensors, "
                       "no buckets)")
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
        got = _call(fn, list(nbytes), cap)
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
        got = _call(fn, gbs, mbs, dp)
        if isinstance(got, _Raised):
            problems.append(f"gbs={gbs}, mbs={mbs}, dp={dp}: {got}; mbs×dp = {mbs * dp} divides "
                            f"{gbs}: return {grad_accumulation_steps(gbs, mbs, dp)}")
            continue
        problems += compare(f"gbs={gbs}, mbs={mbs}, dp={dp}", got, grad_accumulation_steps(gbs, mbs, dp))
    for gbs, mbs, dp in bad:
        got = _call(fn, gbs, mbs, dp)
        if isinstance(got, _Raised) and isinstance(got.error, ValueError):
            continue
        if isinstance(got, _Raised):
            why = (" (an assert is a check for bugs, removed by python -O: raise ValueError("
                   "...) yourself)" if isinstance(got.error, AssertionError) else "")
            problems.append(f"gbs={gbs}, mbs={mbs}, dp={dp}: {got}, not the ValueError the "
                            f"statement asks for{why}")
            continue
        problems.append(f"gbs={gbs}, mbs={mbs}, dp={dp}: returned {got!r}; mbs×dp = "
                        f"{mbs * dp} does not divide {gbs}, so raise ValueError")
    report("gradient accumulation steps", problems, len(good) + len(bad))


def _small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _grads_of(rank):
    """Rank `rank`'s model and gradients: its own weights (seeded by the rank, so that an
    all-reduce of the weights shows) and its own batch; on rank 1 the last bias's gradient is
    exactly zero (its micro-batch gave it no signal), so a test such as `if p.grad.any()`
    decides differently on different ranks."""
    model = _small_model(rank)
    g = torch.Generator().manual_seed(100 + rank)
    model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
    if rank == 1:
        model[2].bias.grad.zero_()
    return model


def _average_worker(fn, split):
    group = my_group(split)
    model = _grads_of(dist.get_rank())
    with Ledger() as ledger:
        call_student(fn, model, group=group)
    return ([p.grad.clone() for p in model.parameters()], ledger.summary(),
            [p.detach().clone() for p in model.parameters()])


def _one_line_per_n(n, per_rank: list[list[str]], label: str | None = None) -> list[str]:
    """The same problem on every rank is one line ("every rank"), else one per rank."""
    lines, label = per_rank, label or f"N={n}"
    if all(ls == lines[0] for ls in lines):
        return [f"{label}, every rank: {p}" for p in lines[0]]
    return [f"{label} rank {r}: {p}" for r, ls in enumerate(lines) for p in ls]


def _average_slips(own, mean, world, n, m, split) -> dict:
    """What each common slip leaves in p.grad on one rank (its group of m ranks out of n;
    `mean` the group's mean, `world` the world's), with its diagnosis."""
    out = {"gradients: this rank's own, unchanged — the mean was never written back into p.grad (an "
           "all-reduce of a copy, or p.grad = … on a clone?)": own}
    if m > 1:
        out[f"gradients: {m}× the mean: the sum over the {m} ranks — divide by {m} (dist.get_world_size(group)) "
            "or reduce with op=\"avg\""] = mean * m
    if split:
        out[on_world_not_group("the mean")] = world
        out[on_world_not_group("the sum") + " (not divided either)"] = world * n
        out[on_world_not_group("the sum") + f" (the division by the group's {m} is right)"] = world * n / m
        out[f"gradients: the group's sum divided by the world's {n} ranks, not the group's {m}: divide by "
            "dist.get_world_size(group)"] = mean * m / n
    return out


def check_average_gradients(fn, timeout: float | None = None) -> None:
    """Every rank ends with the mean of its group's gradients, computed with picolib.comm: on
    2 and 3 ranks (the world) and on 4 ranks split into two groups of 2."""
    problems, checks = [], 0
    for n, split in ((2, False), (3, False), (4, True)):
        own = [torch.cat([p.grad.flatten() for p in _grads_of(r).parameters()])
               for r in range(n)]                     # every rank's gradients, in one process
        world = torch.stack(own).mean(0)
        per_rank = []
        results = _run(_average_worker, n, fn, split, name="average_gradients", timeout=timeout)
        for rank, (grads, summary, weights) in enumerate(results):
            checks += 3
            mean = torch.stack([own[m] for m in members(rank)]).mean(0) if split else world
            got = torch.cat([g.flatten() for g in grads])
            mine = compare("gradients (all parameters, flattened)", got, mean, atol=1e-6)
            moved = any(not torch.equal(w, p) for w, p in zip(weights, _small_model(rank).parameters()))
            if moved:     # the weights were reduced: that explains the gradients too
                mine = ["weights: changed — p (the weights) was all-reduced or divided, not "
                        "p.grad: average the gradients and leave the weights to the optimizer"]
            elif mine:
                hint = explain([why for why, value in _average_slips(own[rank], mean, world, n,
                                                                     2 if split else n, split).items()
                                if torch.allclose(got, value, atol=1e-6)])
                mine = [hint] if hint else mine
            if "all_reduce" not in summary:
                mine.append("calls: no picolib.comm.all_reduce was called (collectives "
                            f"seen: {sorted(summary) or 'none'})")
            per_rank.append(mine)
        label = f"group of 2 in {list(SUBGROUPS)}" if split else None
        problems += _one_line_per_n(n, per_rank, label)
    report("naive gradient averaging", problems, checks)


_CFG = LlamaConfig(n_layers=1, hidden=32, n_heads=2, n_kv_heads=1, ffn_hidden=48)


def _micro_batches(step_rows, pieces):
    tokens, targets = step_rows
    k = tokens.shape[0] // pieces
    return [(tokens[i * k:(i + 1) * k], targets[i * k:(i + 1) * k]) for i in range(pieces)]


ROWS, STEPS = 60, 2  # rows of a global batch; optimizer steps in a row
# rows per micro-batch: 10 and 5, never k, n or 2, so a loss divided by its rows shows as such
CASES = ((2, 3), (3, 4))  # (ranks, micro-batches per step): k ≠ 2 and k ≠ ranks somewhere


def _batches():
    return [random_tokens(ROWS, 8, _CFG.vocab_size, seed=7 + s) for s in range(STEPS)]


def _accumulate_worker(fn, grad_acc):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(_CFG)
    ddp = DDP(model, bucket_cap_bytes=2**13)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def record(*_):                           # before each step: the gradient it is given
        seen.append(torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                               for p in model.parameters()]))

    opt.register_step_pre_hook(record)
    forwards = []                             # forwards through the wrapper, not ddp.module
    ddp.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with Ledger() as ledger:
        for batch in _batches():
            mine = _micro_batches(batch, n)[rank]
            call_student(fn, ddp, opt, _micro_batches(mine, grad_acc))
    weights = [p.detach().clone() for p in model.parameters()]
    return weights, ledger.count("all_reduce"), len(ddp.buckets), seen, len(forwards)


def _reference():
    """One process, each whole batch: the gradient at every step, and the final weights."""
    model = TinyLlama(_CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for batch in _batches():
        model.loss(*batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


def _last_micro_batch_grad(n, k):
    """Step 1's gradient of the last micro-batch alone, averaged over the n ranks (what is left
    when zero_grad() runs inside the loop): one process on the ranks' last micro-batches."""
    mine = [_micro_batches(_micro_batches(_batches()[0], n)[r], k)[-1] for r in range(n)]
    model = TinyLlama(_CFG)
    model.loss(torch.cat([x for x, _ in mine]), torch.cat([y for _, y in mine])).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _step_problem(i, got, want, earlier, n, k, last=None) -> list[str]:
    """The gradient handed to step i, with the mistake it shows named."""
    wrong = compare_parameters(f"gradient at step {i + 1}", got, want, TinyLlama(_CFG), atol=1e-5)
    if not wrong:
        return []
    g, w = got.double(), want.double()
    if last is not None and any(torch.allclose(g, last.double() / d, atol=1e-5, rtol=1e-4)
                                for d in (k, 1)):
        return [f"gradient at step {i + 1}: only the last micro-batch's — zero_grad() (or a .grad "
                "reset) inside the loop wipes the others: zero once, after the step"]
    m = ROWS // (n * k)
    fitting = [(ratio, why) for ratio, why in (
        (k / n, f"divided by the {n} ranks instead of the {k} micro-batches (DDP already averages "
                "over the ranks)"),
        (float(k), f"the {k} micro-batch losses were summed: divide each by k = len(micro_batches) "
                   f"= {k}"),
        (k / 2, f"divided by 2 whatever the number of micro-batches: use k = len(micro_batches) "
                f"(here {k})"),
        (1 / n, f"averaged over the {n} ranks once more: DDP already does"),
        (k / m, f"each micro-batch's loss divided by its rows (x.shape[0] = {m}), not by the "
                f"number of micro-batches k = {k} (the loss is already a mean over its rows)"))
        if abs(ratio - 1) > 1e-6 and torch.allclose(g, ratio * w, atol=1e-5, rtol=1e-4)]
    if fitting:        # k/n and k/2 coincide on 2 ranks: then both are named
        return [f"gradient at step {i + 1}: {fitting[0][0]:.3g}× the right one — "
                + explain([why for _, why in fitting])]
    if earlier is not None and torch.allclose(g, w + earlier.double(), atol=1e-5, rtol=1e-4):
        return [f"gradient at step {i + 1}: it still holds step {i}'s gradient — zero the "
                "gradients after the step (optimizer.zero_grad())"]
    return wrong


def check_accumulate_and_step(fn, timeout: float | None = None) -> None:
    """Two steps in a row on (2 ranks, 3 micro-batches) and (3 ranks, 4 micro-batches): the
    gradient given to the optimizer at each step equals the whole batch's; the weights equal
    two SGD steps on the whole batches; one all-reduce per bucket per step."""
    grads, expected = _reference()
    problems, checks = [], 0
    for n, grad_acc in CASES:
        per_rank = []
        last = _last_micro_batch_grad(n, grad_acc)
        for weights, calls, buckets, seen, forwards in _run(_accumulate_worker, n, fn, grad_acc,
                                                            name="accumulate_and_step", timeout=timeout):
            checks += 4
            mine = []
            if len(seen) != STEPS:
                mine.append(f"optimizer: step() called {len(seen)} times in {STEPS} calls of your "
                            "function; once per call, after the last micro-batch")
            else:
                for i in range(STEPS):
                    mine += _step_problem(i, seen[i], grads[i], grads[i - 1] if i else None,
                                          n, grad_acc, last if i == 0 else None)
                    if mine:
                        break
                if not mine:
                    mine += compare_parameters(f"weights after {STEPS} steps",
                                               torch.cat([w.flatten() for w in weights]),
                                               torch.cat([e.flatten() for e in expected]),
                                               TinyLlama(_CFG), atol=1e-5)
            if forwards != STEPS * grad_acc:
                mine.append(f"forward: {forwards} of {STEPS * grad_acc} forwards went through the "
                            "wrapper — call ddp(tokens), not ddp.module: PyTorch's DDP arms its "
                            "hooks in its forward and would leave these gradients un-averaged")
            if calls != STEPS * buckets:
                mine.append(f"traffic: {calls} all-reduces for {STEPS} steps of {grad_acc} "
                            f"micro-batches; with no_sync on all but the last there are "
                            f"{STEPS * buckets} (one per bucket per step)")
            per_rank.append(mine)
        problems += _one_line_per_n(n, per_rank, f"{n} ranks × {grad_acc} micro-batches")
    report("accumulation with no_sync", problems, checks)
