"""Checks for lesson 04 (tensor parallelism).

- `check_shards(column_shard, row_shard)`: `column_shard(weight, rank, world)` → the rows of
  an nn.Linear weight (out, in) that rank owns; `row_shard(...)` → its columns; both raise a
  ValueError naming the numbers when the size does not divide.
- `check_conjugate_pair(CopyToTP, ReduceFromTP)`: two autograd Functions, `.apply(x, group)`:
  f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward),
  through picolib.comm; run on 2 and 3 ranks.
- `check_vocab_parallel_loss(fn)`: `fn(local_logits, targets, vocab_start, group=None)` → the
  mean cross-entropy from vocab-sharded logits, equal to F.cross_entropy with the right
  gradients, without gathering the logits; run on 2 and 3 ranks and two groups of 2, on
  logits that reach 100
  (exp overflows fp32 unless the max is subtracted).
- `check_parallel_head(fn)`: `fn(hidden, weight_shard, group=None)` → this rank's vocabulary
  slice of the logits (b, s, v/tp), through f so that backward sums the gradient of the
  (replicated) hidden state; run on 2 and 3 ranks and two groups of 2, with the vocab-parallel
  loss behind it.
- `check_vocab_parallel_embedding(fn)`: `fn(tokens, weight_shard, vocab_start, group=None)` →
  the embeddings (b, s, h) from this rank's rows of the table: ids outside them zeroed, the
  partial embeddings summed with g; values against the dense lookup and the shard's gradient
  against its rows of the dense gradient, on 2 and 3 ranks and two groups of 2.
- `check_kv_replicas(kv_holders, CopyToReplicas)`: which tp ranks hold the same slice of K/V
  (against `tensor_parallel.tp_cut`), and f over those ranks alone (identity forward, their
  sum backward, one all-reduce), on 4 ranks and two groups of 2, then inside a tp = 4
  TinyLlama with 2 KV heads against one process.

Each wrong answer a student commonly gives gets its own one-line message (f and g swapped
or missing, a loss that is not a scalar, gathered logits where a slice is expected) —
caught before backward, so no raw autograd traceback.

Ranks that never finish (a collective one rank skips) fail the check after `_core.TIMEOUT`.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import Ledger
from ._core import (SUBGROUPS, ExerciseFailed, call_student, compare, members, my_group,
                    on_world_not_group, report, run_student, world_calls)

__all__ = ["check_shards", "check_conjugate_pair", "check_vocab_parallel_loss",
           "check_parallel_head", "check_vocab_parallel_embedding", "check_kv_replicas"]


def _shard_hints(got, w, r, world, dim) -> set[str]:
    """Every named mistake a wrong shard fits (the other dimension sliced, transposed, strided,
    another rank's): at 1 or 2 ranks one shard can fit several."""
    def piece(d, rank):
        step = w.shape[d] // world
        return w.narrow(d, rank * step, step)
    def same(a):
        return isinstance(got, torch.Tensor) and got.shape == a.shape and torch.equal(got, a)
    other = 1 - dim
    kind, axis = (("rows", "output"), ("columns", "input"))[dim]
    fits = set()
    if w.shape[other] % world == 0 and (same(piece(other, r)) or same(piece(other, r).t())):
        fits.add(f"you sliced the {('rows', 'columns')[other]}: W is (out, in), and this shard "
                 f"holds the {kind} of rank's {axis} features")
    if same(piece(dim, r).t()):
        fits.add("the shard is transposed: keep W's (out, in) layout")
    if world > 1 and same(w[r::world] if dim == 0 else w[:, r::world]):
        fits.add(f"strided {kind} r, r + world, …: a rank's slice is contiguous")
    if world > 1 and same(piece(dim, world - 1 - r)):
        fits.add("the ranks in reverse order: rank 0 owns the first slice")
    return fits


def check_shards(column_shard, row_shard) -> None:
    """Exact slices for several shapes and world sizes; y = x Wᵀ rebuilt from the shards.
    A wrong shard is named (the other dimension, transposed, strided, reversed ranks), once
    per function; a size that does not divide must raise a ValueError naming both numbers."""
    problems, checks = [], 0
    wrong = {"column_shard": [], "row_shard": []}   # (case, compare's line, hint) of each failure
    g = torch.Generator().manual_seed(4)
    for out_f, in_f, world in ((6, 4, 2), (8, 12, 4), (5, 3, 1), (12, 9, 3)):
        w, x = torch.randn(out_f, in_f, generator=g), torch.randn(2, in_f, generator=g)
        y = x @ w.t()
        cols = [call_student(column_shard, w, r, world) for r in range(world)]
        rows = [call_student(row_shard, w, r, world) for r in range(world)]
        for r in range(world):
            checks += 2
            for name, got, dim, n in (("column_shard", cols[r], 0, out_f), ("row_shard", rows[r], 1, in_f)):
                want = w.narrow(dim, r * n // world, n // world)
                case = f"{name}(W {tuple(w.shape)}, rank {r}, world {world})"
                line = compare(case, got, want, atol=0)
                if line:
                    wrong[name].append((case, line, _shard_hints(got, w, r, world, dim)))
        if not any(wrong.values()):
            checks += 2
            problems += compare(f"world {world}: concatenated column outputs", torch.cat(
                [x @ c.t() for c in cols], -1), y, atol=1e-6)
            problems += compare(f"world {world}: summed row outputs", sum(
                x.chunk(world, -1)[r] @ rows[r].t() for r in range(world)), y, atol=1e-6)
    for name, cases in wrong.items():
        # a hint only when it names every failing case: at 2 ranks a shard one rank off looks
        # reversed, and at 1 rank a transposed shard looks like the other dimension sliced
        hints = set.intersection(*(h for _, _, h in cases)) if cases else set()
        if len(hints) == 1 and any("world 1)" not in c and "world 2)" not in c for c, _, _ in cases):
            problems.append(f"{cases[0][0]}: {hints.pop()}")
        else:
            problems += [line for _, lines, _ in cases for line in lines]
    for fn, name, shape in ((column_shard, "column_shard", (6, 4)), (row_shard, "row_shard", (4, 6))):
        checks += 1
        try:
            call_student(fn, torch.zeros(shape), 0, 4)
            problems.append(f"{name}: W {shape} over 4 ranks should raise a ValueError (6 % 4 != 0)")
        except ValueError as e:
            if "6" not in str(e) or "4" not in str(e):
                problems.append(f"{name}: the ValueError should name both numbers (6 and 4): {e}")
        except ExerciseFailed:
            raise
        except Exception as e:
            problems.append(f"{name}: W {shape} over 4 ranks raised {type(e).__name__}, not the "
                            "ValueError the statement asks for (naming 6 and 4)")
    report("column and row shards", problems, checks)


def _name(fn) -> str:
    return getattr(fn, "__name__", "your function")


_FALLBACK = "autograd kernel was not registered"  # PyTorch's warning for c10d ops in autograd


def _quietly(fn, *args):
    """fn(*args), with PyTorch's deprecated-fallback warnings caught: (result, whether any
    all-reduce ran inside autograd without an autograd Function)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, any(_FALLBACK in str(w.message) for w in caught)


def _pair_worker(f_cls, g_cls, split=False):
    group = my_group(split)
    # a barrier on a group of its own after each direction: a collective one rank skips then
    # deadlocks where it is skipped, instead of pairing with the next direction's collective
    phases = dist.new_group(backend="gloo")
    r = dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    upstream = torch.full((3,), float(r + 1))
    with Ledger() as f_fwd:
        fx = f_cls.apply(x, group)
    dist.barrier(group=phases)
    with Ledger() as f_bwd:
        fx.backward(upstream)
    dist.barrier(group=phases)
    y = torch.full((3,), float(r + 1), requires_grad=True)
    with Ledger() as g_fwd:
        gy = g_cls.apply(y, group)
    dist.barrier(group=phases)
    with Ledger() as g_bwd:
        gy.backward(torch.full((3,), float(r + 1)))
    touched = [name for name, t in (("f backward's incoming gradient", upstream),
                                    ("g forward's input", y)) if not torch.equal(t.detach(),
                                                                                torch.full((3,), float(r + 1)))]
    world = sorted({op for led in (f_fwd, f_bwd, g_fwd, g_bwd) for op in world_calls(led)}) \
        if split else []
    return (fx.detach(), x.grad, gy.detach(), y.grad,
            [led.count("all_reduce") for led in (f_fwd, f_bwd, g_fwd, g_bwd)], touched, world)


def _direction(what, got, mine, total, want_sum):
    """One line for f's or g's result in one direction: right, or which mistake it is."""
    if not isinstance(got, torch.Tensor) or got.shape != mine.shape:
        return compare(what, got, total if want_sum else mine)
    if torch.allclose(got, total if want_sum else mine):
        return []
    if want_sum and torch.allclose(got, mine):
        return [f"{what}: this rank's value passed through unchanged — this direction must "
                "all-reduce (sum over the ranks)"]
    if not want_sum and torch.allclose(got, total):
        return [f"{what}: summed over the ranks — this direction is the identity (the all-reduce "
                "belongs to the other direction; f and g swapped, or reduced both ways?)"]
    return compare(what, got, total if want_sum else mine)


def check_conjugate_pair(copy_to_tp, reduce_from_tp, timeout: float | None = None) -> None:
    """Rank r feeds r+1 forward and r+1 as the upstream gradient: f returns r+1 and passes
    back Σ(r+1) over the group; g returns Σ(r+1) and passes back r+1. One comm.all_reduce
    each, where due. On 2 and 3 ranks, and on 4 ranks split into two groups of 2."""
    problems, checks = [], 0
    for n, split in ((2, False), (3, False), (4, True)):
        pair = f"{_name(copy_to_tp)} / {_name(reduce_from_tp)}"
        results = run_student(_pair_worker, n, copy_to_tp, reduce_from_tp, split, name=pair,
                              timeout=timeout)
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        for r, (fx, fgrad, gy, ggrad, counts, touched, world) in enumerate(results):
            mine = torch.full((3,), float(r + 1))
            team = members(r) if split else range(n)
            total = torch.full((3,), float(sum(m + 1 for m in team)))
            checks += 6
            if world:
                problems.append(f"{label} rank {r}: " + on_world_not_group(
                    "the group of your all_reduce") + " (ctx.group = group in forward)")
                continue
            for name in touched:
                problems.append(f"{label} rank {r}: {name} was changed in place — all-reduce a "
                                "clone (autograd may still need the tensor it handed you)")
            problems += _direction(f"{label} rank {r}: f forward", fx, mine, total, want_sum=False)
            problems += _direction(f"{label} rank {r}: f backward", fgrad, mine, total, want_sum=True)
            problems += _direction(f"{label} rank {r}: g forward", gy, mine, total, want_sum=True)
            problems += _direction(f"{label} rank {r}: g backward", ggrad, mine, total, want_sum=False)
            if counts != [0, 1, 1, 0]:
                problems.append(f"{label} rank {r}: comm.all_reduce calls (f fwd, f bwd, g fwd, "
                                f"g bwd) = {counts}, expected [0, 1, 1, 0]")
        if problems:
            break                                     # the same mistake again on more ranks
    report("the conjugate pair f / g", problems, checks)


def _not_a_loss(loss) -> str:
    """Why `loss` cannot be a training loss ("" when it can): said before backward runs."""
    if not isinstance(loss, torch.Tensor):
        return f"returned {type(loss).__name__}, expected a scalar tensor (the mean loss)"
    if loss.dim() != 0:
        return (f"returned a tensor of shape {tuple(loss.shape)}, expected a scalar: the mean over "
                "all b·s tokens (.mean())")
    if not loss.requires_grad:
        return ("the loss does not depend on local_logits in autograd (detached, or summed with an "
                "all-reduce outside an autograd Function?): use ReduceFromTP for the sums")
    return ""


# added to the logits of every other token (b, s) of the vocab-parallel loss's batches
_OFFSET = torch.tensor([0.0, 100.0]).repeat(9).view(3, 6, 1)


def _team(split):
    """(group, this rank's index among the datasets, its rank in the group, the group's size)."""
    group = my_group(split)
    team = members(dist.get_rank())[0] if split else 0
    return group, team, dist.get_rank(group), dist.get_world_size(group)


def _loss_worker(fn, logits, targets, split=False):
    group, team, r, n = _team(split)
    logits, targets = logits[team], targets[team]     # each group its own batch
    v = logits.shape[-1]
    local = logits.chunk(n, -1)[r].clone().requires_grad_()
    with Ledger() as led:
        loss, fallback = _quietly(fn, local, targets, r * v // n, group)
    wrong = _not_a_loss(loss)
    if split and not wrong and world_calls(led):
        wrong = on_world_not_group(f"the group of your {world_calls(led)[0]}")
    if wrong:
        return wrong, None, {}
    _, fallback_bwd = _quietly(loss.backward)
    if fallback or fallback_bwd:
        return ("an all-reduce inside autograd without an autograd Function: a plain comm.all_reduce "
                "on a tensor that needs a gradient works only through PyTorch's deprecated fallback "
                "(\"silently incorrect\") — sum the sum-exp and the target logit with ReduceFromTP"), None, {}
    return loss.detach(), local.grad, led.summary()


def check_vocab_parallel_loss(fn, timeout: float | None = None) -> None:
    """Loss and logit gradients equal to F.cross_entropy; no all-gather, and fewer bytes
    communicated than the logits themselves. On 2 and 3 ranks, and on 4 ranks split into two
    groups of 2, each group with its own batch."""
    problems, checks = [], 0
    g = torch.Generator().manual_seed(5)
    for n, split in ((2, False), (3, False), (4, True)):
        m = 2 if split else n
        # every other token's logits sit near 100: exp(100) overflows fp32 (beyond 3.4e38), so
        # only a loss that subtracts the max stays finite; 24 words: 12, 8 or 6 a rank
        batches = [((torch.randn(3, 6, 24, generator=g) * 5 + _OFFSET).requires_grad_(),
                    torch.randint(0, 24, (3, 6), generator=g)) for _ in range(n if split else 1)]
        refs = []
        for logits, targets in batches:
            ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            ref.backward()
            refs.append(ref.detach())
        results = run_student(_loss_worker, n, fn, [b[0].detach() for b in batches],
                              [b[1] for b in batches], split, name=_name(fn), timeout=timeout)
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        for r, (loss, grad, summary) in enumerate(results):
            team = members(r)[0] if split else 0
            gr = members(r).index(r) if split else r
            logits = batches[team][0]
            checks += 3
            if isinstance(loss, str):
                problems.append(f"{label} rank {r}: {loss}")
                continue
            if loss.item() == float("inf"):      # log of an overflowed sum: exp of a raw logit
                problems.append(f"{label} rank {r}: the loss is inf on logits up to "
                                f"{logits.max().item():.0f}: exp(z) overflows fp32 above z ≈ 88.7 — "
                                "subtract the max m (all-reduced with op=\"max\") before exp")
                continue
            if loss.item() == float("-inf"):     # log 0: every exp(z − m) underflowed
                problems.append(f"{label} rank {r}: the loss is -inf: some token's sum of exp(z − m) "
                                "underflowed to 0, so the m you subtracted is far above that token's "
                                "largest logit — m is each token's max over the whole vocabulary: "
                                "amax(-1) of the local logits, all-reduced with op=\"max\"")
                continue
            if not torch.isfinite(loss).all():
                problems.append(f"{label} rank {r}: the loss is {loss.item()}, expected "
                                f"{refs[team].item():.6g}")
                continue
            tokens = logits.shape[0] * logits.shape[1]
            if torch.allclose(loss, refs[team] * tokens, atol=1e-3 * tokens):
                problems.append(f"{label} rank {r}: loss {loss.item():.6g}, expected "
                                f"{refs[team].item():.6g}: the sum over the b·s = {tokens} tokens "
                                "— return the mean")
                continue
            problems += compare(f"{label} rank {r}: loss", loss, refs[team], atol=1e-4)
            if grad is None:
                problems.append(f"{label} rank {r}: no gradient reached the local logits")
            else:
                problems += compare(f"{label} rank {r}: gradient of the local logits", grad,
                                    logits.grad.chunk(m, -1)[gr], atol=1e-6)
            moved = sum(s["nbytes"] for s in summary.values())
            if "all_gather" in summary or moved >= logits.numel() * 4 // m:
                problems.append(f"{label} rank {r}: communicated {summary} — reduce max, sum-exp and "
                                "target logit (b·s numbers each) instead of gathering logits")
            if not summary:
                problems.append(f"{label} rank {r}: no picolib.comm collective was called")
        if problems:
            break                                     # the same mistake again on more ranks
    report("vocab-parallel cross-entropy", problems, checks)


def _head_worker(fn, hidden, weight, targets, split=False):
    from ..vocab_parallel import vocab_parallel_cross_entropy
    group, team, r, n = _team(split)
    hidden, weight, targets = hidden[team], weight[team], targets[team]
    v = weight.shape[0]
    shard = weight.chunk(n, 0)[r].clone().requires_grad_()
    x = hidden.clone().requires_grad_()
    with Ledger() as fwd:
        logits, _ = _quietly(fn, x, shard, group)
    if not isinstance(logits, torch.Tensor):
        return f"returned {type(logits).__name__}, expected a tensor of logits"
    want = (*hidden.shape[:-1], v // n)
    if tuple(logits.shape) == (*hidden.shape[:-1], v) and n > 1:
        return (f"returned logits of shape {tuple(logits.shape)}: the whole vocabulary — return "
                f"this rank's slice {want} (v/tp = {v}/{n}) and do not gather: the vocab-parallel "
                "loss reads the slices")
    if tuple(logits.shape) != want:
        return f"returned logits of shape {tuple(logits.shape)}, expected this rank's slice {want}"
    if not logits.requires_grad:
        return "the logits do not depend on the hidden state and weight in autograd (detached?)"
    loss = vocab_parallel_cross_entropy(logits, targets, vocab_start=r * v // n, group=group)
    with Ledger() as bwd:
        _quietly(loss.backward)
    if split and (world_calls(fwd) or world_calls(bwd)):
        return on_world_not_group("the group of your " + (world_calls(fwd) + world_calls(bwd))[0]) \
            + " (f's all-reduce runs in backward: keep the group in ctx)"
    return (logits.detach(), x.grad, shard.grad,
            [led.count("all_reduce") for led in (fwd, bwd)], [led.count() for led in (fwd, bwd)])


def check_parallel_head(fn, timeout: float | None = None) -> None:
    """Logits slices, hidden-state gradient (whole, summed by f) and weight-shard gradient
    equal to the dense head; f's one all-reduce in backward, nothing forward. On 2 and 3
    ranks, and on 4 ranks split into two groups of 2, each group with its own data."""
    problems, checks = [], 0
    g = torch.Generator().manual_seed(6)
    for n, split in ((2, False), (3, False), (4, True)):
        m = 2 if split else n
        data = []
        for _ in range(n if split else 1):
            hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
            weight = torch.randn(24, 8, generator=g, requires_grad=True)
            targets = torch.randint(0, 24, (2, 5), generator=g)
            logits = hidden @ weight.t()
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            data.append((hidden, weight, targets, logits.detach()))
        results = run_student(_head_worker, n, fn, [d[0].detach() for d in data],
                              [d[1].detach() for d in data], [d[2] for d in data], split,
                              name=_name(fn), timeout=timeout)
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        for r, res in enumerate(results):
            team = members(r)[0] if split else 0
            gr = members(r).index(r) if split else r
            hidden, weight, targets, logits = data[team]
            checks += 4
            if isinstance(res, str):
                problems.append(f"{label} rank {r}: {res}")
                continue
            got, xgrad, wgrad, reduces, calls = res
            want = logits.chunk(m, -1)[gr]
            if reduces[0] and torch.allclose(got, m * want, atol=1e-5):
                problems.append(f"{label} rank {r}: logits {m}× too large: the hidden state was "
                                "summed over the ranks in forward — that is g (ReduceFromTP); the "
                                "head enters through f (CopyToTP: identity forward, sum in backward)")
                continue
            problems += compare(f"{label} rank {r}: logits", got, want)
            if xgrad is not None and not torch.allclose(xgrad, hidden.grad, atol=1e-6):
                # what this rank's vocabulary slice alone contributes (f's sum left out)
                p = torch.softmax(logits, -1) - F.one_hot(targets, 24)
                part = (p.chunk(m, -1)[gr] / targets.numel()) @ weight.detach().chunk(m, 0)[gr]
                if torch.allclose(xgrad, part, atol=1e-6):
                    problems.append(f"{label} rank {r}: the hidden state's gradient is this rank's "
                                    "part only — enter through f (CopyToTP), whose backward sums "
                                    "it over the ranks")
                    continue
            problems += compare(f"{label} rank {r}: gradient of the hidden state", xgrad, hidden.grad)
            problems += compare(f"{label} rank {r}: gradient of the weight shard", wgrad,
                                weight.grad.chunk(m, 0)[gr])
            if reduces != [0, 1] or calls[0]:
                problems.append(f"{label} rank {r}: picolib.comm calls forward {calls[0]}, "
                                f"all-reduces backward {reduces[1]}; expected none forward and "
                                "one (f's) backward")
        if problems:
            break
    report("the column-parallel head", problems, checks)


# --------------------------------------------------------------------------- the vocab-parallel embedding

def _embed_worker(fn, tables, tokens, upstream, split=False):
    """On a rank: the student's embedding of this rank's rows, its ledger forward and backward,
    and the gradient of its shard (or a one-line reason it cannot be compared)."""
    group, team, r, n = _team(split)
    table, tokens, upstream = tables[team], tokens[team], upstream[team]
    v = table.shape[0]
    shard = table.chunk(n, 0)[r].clone().requires_grad_()
    try:
        with Ledger() as fwd:
            out, fallback = _quietly(fn, tokens, shard, r * v // n, group)
    except IndexError as e:     # raised, not returned: the other ranks wait in the all-reduce
        raise IndexError(f"{e}: F.embedding was given an id outside this rank's {v // n} rows — "
                         "shift the ids by vocab_start (and send the others to any row before "
                         "zeroing them)") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (*tokens.shape, table.shape[1]):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"returned {got}, expected the embeddings {(*tokens.shape, table.shape[1])}"
    if not out.requires_grad:
        return "the embeddings do not depend on weight_shard in autograd (detached?)"
    with Ledger() as bwd:
        _, fallback_bwd = _quietly(out.backward, upstream)
    if fallback or fallback_bwd:
        return ("an all-reduce inside autograd without an autograd Function (PyTorch's deprecated "
                "fallback, \"silently incorrect\"): sum the partial embeddings with g, "
                "reduce_from_region")
    if split and (world_calls(fwd) or world_calls(bwd)):
        return on_world_not_group("the group of your " + (world_calls(fwd) + world_calls(bwd))[0])
    return (out.detach(), shard.grad, [led.count("all_reduce") for led in (fwd, bwd)],
            [led.count() for led in (fwd, bwd)])


def _partials(table, tokens, n, fill):
    """Each rank's lookup of its own rows: ids outside them sent to a row (`fill`: "zero" the
    vector, as asked; "row 0" or "clamp": the vector of that row left in)."""
    out = []
    for r, rows in enumerate(table.chunk(n, 0)):
        start, k = r * rows.shape[0], rows.shape[0]
        outside = (tokens < start) | (tokens >= start + k)
        local = (tokens - start).clamp(0, k - 1) if fill == "clamp" else (tokens - start).masked_fill(outside, 0)
        e = F.embedding(local, rows)
        out.append(e.masked_fill(outside.unsqueeze(-1), 0.0) if fill == "zero" else e)
    return out


def _embed_values(got, table, tokens, n, r) -> str:
    """The one-line diagnosis of a wrong embedding (values), "" when none fits."""
    close = lambda a: torch.allclose(got, a, atol=1e-6)
    mine = _partials(table, tokens, n, "zero")
    if n > 1 and close(mine[r]):
        return ("only this rank's rows are looked up (every other token's vector is zero): sum the "
                "partial embeddings over the group with g (reduce_from_region)")
    if any(close(sum(_partials(table, tokens, n, fill))) for fill in ("row 0", "clamp")):
        return ("the tokens this rank does not own were not zeroed: each rank added the vector of "
                "the row it sent them to — masked_fill those vectors with 0 before the sum")
    return ""


def check_vocab_parallel_embedding(fn, timeout: float | None = None) -> None:
    """Embeddings equal to the dense lookup on every rank, and the shard's gradient equal to its
    rows of the dense table's gradient; one all-reduce forward, none backward. On 2 and 3 ranks,
    and on 4 ranks split into two groups of 2, each group with its own table and tokens."""
    problems, checks = [], 0
    g = torch.Generator().manual_seed(7)
    for n, split in ((2, False), (3, False), (4, True)):
        m = 2 if split else n
        data = []
        for _ in range(n if split else 1):
            table = torch.randn(12, 4, generator=g, requires_grad=True)
            tokens = torch.randint(0, 12, (2, 9), generator=g)
            tokens[0, :8] = torch.tensor([0, 11, 5, 6, 3, 4, 7, 8])   # both ends of every slice
            upstream = torch.randn(2, 9, 4, generator=g)
            (F.embedding(tokens, table) * upstream).sum().backward()
            data.append((table, tokens, upstream))
        results = run_student(_embed_worker, n, fn, [d[0].detach() for d in data],
                              [d[1] for d in data], [d[2] for d in data], split,
                              name=_name(fn), timeout=timeout)
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        for r, res in enumerate(results):
            team = members(r)[0] if split else 0
            gr = members(r).index(r) if split else r
            table, tokens, _ = data[team]
            checks += 3
            if isinstance(res, str):
                problems.append(f"{label} rank {r}: {res}")
                continue
            out, grad, reduces, calls = res
            want = F.embedding(tokens, table.detach())
            if not torch.allclose(out, want, atol=1e-6):
                hint = _embed_values(out, table.detach(), tokens, m, gr)
                problems += ([f"{label} rank {r}: embeddings: {hint}"] if hint else
                             compare(f"{label} rank {r}: embeddings", out, want))
                continue
            rows = table.grad.chunk(m, 0)[gr]
            if grad is not None and m > 1 and torch.allclose(grad, m * rows, atol=1e-5):
                problems.append(f"{label} rank {r}: the shard's gradient is {m}× its rows' gradient: "
                                "the gradient was summed over the ranks in backward — g's backward is "
                                "the identity (every rank already holds the whole gradient of the "
                                "embeddings)")
                continue
            problems += compare(f"{label} rank {r}: gradient of weight_shard", grad, rows)
            if reduces != [1, 0] or calls != [1, 0]:
                problems.append(f"{label} rank {r}: picolib.comm calls forward {calls[0]} "
                                f"(all-reduces {reduces[0]}), backward {calls[1]}; expected one "
                                "all-reduce forward (g) and none backward")
        if problems:
            break                                     # the same mistake again on more ranks
    report("the vocab-parallel embedding", problems, checks)


# --------------------------------------------------------------------------- replicated KV heads

KV_CASES = ((4, 2, 4), (8, 2, 8), (8, 1, 4), (8, 4, 2), (6, 3, 6), (8, 8, 8))  # (a, kv, tp)


def _holders_hints(fn) -> list[str]:
    """The named mistake every wrong (slot, holders) answer fits, when one does."""
    def round_robin(rank, tp, kv):
        slot = rank % kv if tp > kv else rank
        return slot, [q for q in range(tp) if (q % kv if tp > kv else q) == slot]

    def head_index(rank, tp, kv):
        return (rank * kv // tp, [rank]) if tp < kv else None

    def without_me(rank, tp, kv):
        shared = max(1, tp // kv)
        return rank // shared, [q for q in range(rank // shared * shared, (rank // shared + 1) * shared)
                                if q != rank]
    named = {round_robin: "the replicas are not round-robin: rank r holds query heads "
                          "[r·a/tp, (r+1)·a/tp), which read KV head ⌊r·kv/tp⌋ — consecutive ranks "
                          "share a KV head",
             head_index: "when tp < n_kv_heads a rank holds n_kv_heads/tp KV heads: its slot is its "
                         "slice of the K/V weight (its rank), not the first head's index",
             without_me: "holders lists every tp rank that holds the slot, this rank included"}
    wrong = [(a, kv, tp, r) for a, kv, tp in KV_CASES for r in range(tp)
             if _holders_answer(fn, r, tp, kv) != _holders_want(a, kv, tp, r)]
    return [msg for rule, msg in named.items()
            if wrong and all(_as_pair(rule(r, tp, kv)) == _holders_answer(fn, r, tp, kv)
                             for _, kv, tp, r in wrong)]


def _as_pair(got):
    try:
        slot, holders = got
        return int(slot), [int(h) for h in holders]
    except (TypeError, ValueError):
        return got


def _holders_answer(fn, rank, tp, kv):
    return _as_pair(call_student(fn, rank, tp, kv))


def _holders_want(a, kv, tp, rank):
    from ..tensor_parallel import tp_cut
    cut = tp_cut("attn.wk", tp, rank, (a, kv))
    return cut.index, list(cut.holders)


def _replicas_worker(copy_cls, cases, split=False):
    """On a rank, per (n_slots, slot of each group rank): forward's output, backward's result,
    the upstream gradient untouched?, all-reduces (forward, backward), world calls."""
    group = my_group(split)
    phases = dist.new_group(backend="gloo")
    r, out = dist.get_rank(group), []
    for n_slots, slots in cases:
        w = torch.full((2, 3), 10.0 + dist.get_rank(), requires_grad=True)
        upstream = torch.full((2, 3), float(dist.get_rank() + 1))
        with Ledger() as fwd:
            y = copy_cls.apply(w, slots[r], n_slots, group)
        dist.barrier(group=phases)
        with Ledger() as bwd:
            y.backward(upstream)
        dist.barrier(group=phases)
        world = sorted(set(world_calls(fwd) + world_calls(bwd))) if split else []
        out.append((y.detach(), w.grad, torch.equal(upstream, torch.full((2, 3), float(dist.get_rank() + 1))),
                    [fwd.count("all_reduce"), bwd.count("all_reduce")], [fwd.count(), bwd.count()], world))
    return out


def _replica_line(what, got, mine, summed, everyone, n_holders) -> str:
    if got is None:
        return f"{what}: no gradient reached the weight"
    if torch.allclose(got, summed):
        return ""
    if n_holders > 1 and torch.allclose(got, mine):
        return (f"{what}: this rank's part only — sum it over the {n_holders} ranks that hold the "
                "same slot (the other part comes from their query heads)")
    if torch.allclose(got, everyone):
        return (f"{what}: summed over every rank of the group, holders of other KV heads too — sum "
                "over the ranks of this slot only (this rank's gradient in row `slot` of a zero "
                "buffer of n_slots rows, one all-reduce)")
    if n_holders > 1 and torch.allclose(got, summed / n_holders):
        return f"{what}: {n_holders}× too small — a mean over the holders; the true gradient is their sum"
    return compare(what, got, summed)[0]


def _kv_model_worker(copy_cls, cfg, tokens, targets):
    """This rank's gradients of every block's W_K and W_V, with `copy_cls` where the library
    passes a replicated KV weight through copy_to_replicas (`ParallelAttention._kv`, overridden
    in a subclass built from each block's one-process attention)."""
    import copy
    from ..model import TinyLlama
    from ..tensor_parallel import ParallelAttention, apply_tensor_parallel

    class StudentAttention(ParallelAttention):
        def _kv(self, t):
            if self.replicas == 1 or t is None:
                return t
            return copy_cls.apply(t, self.slot, self.n_slots, self.group)

    model = TinyLlama(cfg)
    attentions = [copy.deepcopy(b.attn) for b in model.blocks]
    apply_tensor_parallel(model)
    for block, attn in zip(model.blocks, attentions):
        block.attn = StudentAttention(attn)
    model.loss(tokens, targets).backward()
    return [(b.attn.slot, b.attn.wk.weight.grad, b.attn.wv.weight.grad) for b in model.blocks]


def check_kv_replicas(kv_holders, copy_to_replicas, timeout: float | None = None) -> None:
    """`kv_holders(rank, tp, n_kv_heads)` → (slot, holders) against the library's plan
    (`tensor_parallel.tp_cut`) for six head counts; `copy_to_replicas.apply(w, slot, n_slots,
    group)` — identity forward, backward the sum over the ranks of `slot` with one all-reduce —
    on 4 ranks (2 and 4 holders a slot) and on two groups of 2; then inside a tp = 4 TinyLlama
    with 2 KV heads: every block's W_K and W_V gradient against one process."""
    problems, checks = [], 0
    for a, kv, tp in KV_CASES:
        for r in range(tp):
            checks += 1
            got, want = _holders_answer(kv_holders, r, tp, kv), _holders_want(a, kv, tp, r)
            if got != want:
                problems.append(f"kv_holders(rank={r}, tp={tp}, n_kv_heads={kv}): got {got!r}, "
                                f"expected {tuple(want)!r}")
    hints = _holders_hints(kv_holders) if problems else []
    if len(hints) == 1:
        problems = [problems[0] + " — " + hints[0]]
    cases = {False: [(2, [0, 0, 1, 1]), (1, [0, 0, 0, 0])], True: [(1, [0, 0])]}
    name = _name(copy_to_replicas)
    for split, n in ((False, 4), (True, 4)):
        results = run_student(_replicas_worker, n, copy_to_replicas, cases[split], split,
                              name=name, timeout=timeout)
        label = f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"
        for r, per_case in enumerate(results):
            team = members(r) if split else list(range(n))
            for (n_slots, slots), (y, grad, untouched, reduces, calls, world) in zip(cases[split], per_case):
                gr = team.index(r)
                holders = [team[q] for q in range(len(team)) if slots[q] == slots[gr]]
                what = f"{label}, n_slots={n_slots}, rank {r} (slot {slots[gr]})"
                checks += 3
                if world:
                    problems.append(f"{what}: " + on_world_not_group("the group of your all_reduce"))
                    continue
                if not torch.equal(y, torch.full((2, 3), 10.0 + r)):
                    problems.append(f"{what}: forward changed the weight — it is the identity (every "
                                    "holder has the same weight already)")
                if not untouched:
                    problems.append(f"{what}: backward's incoming gradient was changed in place — "
                                    "reduce a buffer of your own")
                mine = torch.full((2, 3), float(r + 1))
                line = _replica_line(f"{what}: gradient", grad, mine,
                                     torch.full((2, 3), float(sum(h + 1 for h in holders))),
                                     torch.full((2, 3), float(sum(h + 1 for h in team))), len(holders))
                problems += [line] if line else []
                if reduces != [0, 1] or calls != [0, 1]:
                    problems.append(f"{what}: picolib.comm calls (forward, backward) = {calls}, "
                                    f"all-reduces {reduces}; expected none forward and one all-reduce "
                                    "backward (of an (n_slots, …) buffer over the group)")
        if problems:
            report("replicated KV heads", problems, checks)
    from ..model import LlamaConfig, TinyLlama, random_tokens
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    tokens, targets = random_tokens(2, 8, cfg.vocab_size, seed=3)
    ref = TinyLlama(cfg)
    ref.loss(tokens, targets).backward()
    results = run_student(_kv_model_worker, 4, copy_to_replicas, cfg, tokens, targets, name=name,
                          timeout=timeout)
    for r, blocks in enumerate(results):
        for i, (slot, wk, wv) in enumerate(blocks):
            attn = ref.blocks[i].attn
            for w, got in (("W_K", wk), ("W_V", wv)):
                checks += 1
                want = getattr(attn, "wk" if w == "W_K" else "wv").weight.grad.chunk(cfg.n_kv_heads, 0)[slot]
                problems += compare(f"tp=4 TinyLlama (2 KV heads), rank {r}, block {i}: {w}'s gradient "
                                    "against one process", got, want, atol=1e-5)
    report("replicated KV heads", problems, checks)
