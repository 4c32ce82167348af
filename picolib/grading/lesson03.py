"""Checks for lesson 03 (ZeRO).

- `check_shard_bounds(fn)`: `fn(numel, n, rank)` → (start, stop) of rank's shard of a flat
  buffer padded to a multiple of n (each shard ⌈numel/n⌉ elements).
- `check_zero_memory(fn)`: `fn(stage, psi, n, k)` → {"params", "grads", "optimizer"} bytes
  per rank with bf16 parameters and gradients (2 + 2) and k optimizer bytes per
  parameter; stage 0 is plain DP; stages 1-3 pad Ψ to a multiple of n.
- `check_zero1_step(fn)`: `fn(param, grad, lr, group=None)` → the new full parameter
  vector after one ZeRO-1 SGD step: reduce-scatter (mean) the gradient, update this rank's
  shard, all-gather — through picolib.comm, on 2 and 3 ranks, with a size that does not
  divide by either, and 5 elements on 4 ranks (torch.chunk makes 3 pieces there: an answer
  that takes chunk's piece is told so). What each rank hands the all-gather must be its updated parameter shard
  (gathering the mean gradient and stepping the whole vector gives the same values and bytes).
- `check_reduce_scatter_gradients(fn)`: ZeRO-2's gradient step: `fn(grads, group=None)`
  takes this rank's gradients of one unit (a list of tensors), flattens and pads them
  and reduce-scatters (mean), returning this rank's shard — compared with the shard
  picolib's `ZeRO(model, 2)` holds after the same backward, on 2 and 4 ranks, and on a unit
  of 5 elements whose values differ from rank to rank.
- `check_gather_unit(fn)`: ZeRO-3's gather before forward: `fn(shard, shapes, group=None)`
  all-gathers every rank's shard of one unit and returns the unit's parameters (padding
  dropped) in the given shapes — compared with picolib's `ZeRO(model, 3)` after a step, and
  on the 5-element unit.
A problem every rank shares is reported once; a sum where a mean was wanted, a shard
taken whole, padding kept, shards in reverse rank order or the gathered buffer read column
by column each get a one-line diagnosis — only when it reproduces the answer (03.2: in every
case, so that ×2 at N = 2 is not taken for fp32).
"""
from __future__ import annotations

import re
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..comm import Ledger
from ..model import LlamaConfig, TinyLlama, random_tokens
from ..sharded_optim import split_units
from ..zero import ZeRO, padded_numel, shard_bounds, zero_memory_bytes
from ._core import (SUBGROUPS, ExerciseFailed, call_student, compare, explain, fits, members,
                    my_group, on_world_not_group, report, run_student, world_calls)

__all__ = ["check_shard_bounds", "check_zero_memory", "check_zero1_step",
           "check_reduce_scatter_gradients", "check_gather_unit"]


def check_shard_bounds(fn) -> None:
    """Every rank's [start, stop) for sizes that divide by n and sizes that do not."""
    cases = [(10, 4), (12, 4), (4, 2), (1, 8), (7, 1), (2214, 4), (1000, 3), (5, 8)]
    problems, count = [], 0
    for numel, n in cases:
        try:
            got = [call_student(fn, numel, n, r) for r in range(n)]
        except ExerciseFailed:
            raise
        except Exception as e:
            problems.append(f"numel={numel}, n={n}: your function raised {type(e).__name__} "
                            f"({e}) — never an error: pad the buffer up to a multiple of n")
            count += 1
            continue
        got = [tuple(g) if isinstance(g, (list, tuple)) else g for g in got]
        want = [shard_bounds(numel, n, r) for r in range(n)]
        count += 1
        if got == want:
            continue
        size = -(-numel // n)
        floor = [(r * (numel // n), (r + 1) * (numel // n)) for r in range(n)]
        clipped = [(min(a, numel), min(b, numel)) for a, b in want]
        inclusive = [(a, b - 1) for a, b in want]
        why = ("the stop is inclusive: the range is half-open, [start, stop), so stop is the "
               "next shard's start" if got == inclusive else
               "the ranks in reverse order: rank 0 owns the first slice" if got == want[::-1] else
               "⌊numel/n⌋ per shard: the last elements belong to no rank; use ⌈numel/n⌉ and pad"
               if got == floor else
               "the shards stop at numel: with padding every shard has ⌈numel/n⌉ elements, the "
               "last one runs into the padding" if got == clipped else
               f"each shard is ⌈{numel}/{n}⌉ = {size} elements, rank r starts at r·{size}")
        problems.append(f"numel={numel}, n={n}: got {got}, expected {want} — {why}")
    report("shard bounds with padding", problems, count)


_SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}   # the stage that starts sharding it
_WHAT = {"optimizer": "the optimizer state", "grads": "the gradients", "params": "the parameters"}


def _other_stage(got: dict, stage: int, psi: int, n: int, k: int) -> str:
    """The answer is another stage's, whole: name it (one case; at N = 1 every stage is the same,
    and then the answer is right or not another stage's)."""
    other = [s for s in range(4) if s != stage and got == zero_memory_bytes(s, psi, n, k, param_bytes=2)]
    if not other:
        return ""
    which = " or ".join(f"stage {s}'s" for s in other)
    return (f"this is {which} memory, not stage {stage}'s" +
            (" (a stage off by one)" if all(abs(s - stage) == 1 for s in other) else "")
            + ": stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also "
            "the parameters")


def _slips(key: str):
    """The known slips for one part, each (diagnosis, rule): `rule(stage, psi, n, k)` is the
    value an answer with that slip (and no other) gives. A slip is named only when its rule
    gives the student's value in every case: at N = 2 a part kept whole is also twice the right
    value, as fp32 would be, and only the other cases tell the two apart."""
    first, per = _SHARDED_FROM[key], (2 if key != "optimizer" else None)

    def right(stage, psi, n, k):
        return zero_memory_bytes(stage, psi, n, k, param_bytes=2)[key]

    def size(k):
        return per if per is not None else k
    out = [(f"{key} sharded, but only stage ≥ {first} shards {_WHAT[key]}",
            lambda s, psi, n, k: size(k) * (-(-psi // n) if s >= 1 else psi / n) if s < first
            else right(s, psi, n, k)),
           (f"{key} kept whole, but stage ≥ {first} shards {_WHAT[key]} (÷ n)",
            lambda s, psi, n, k: size(k) * (-(-psi // n) * n) if s >= first else right(s, psi, n, k))]
    for shard in (lambda psi, n: psi / n, lambda psi, n: psi // n):
        out.append((f"{key} not padded: stages 1-3 use Ψ' = n⌈Ψ/n⌉",
                    lambda s, psi, n, k, shard=shard: size(k) * (shard(psi, n) if s >= first else psi)))
    if key == "optimizer":
        out.append(("optimizer with 12 bytes per parameter: use the argument k",
                    lambda s, psi, n, k: right(s, psi, n, k) * 12 / k))
    else:
        out.append((f"{key} at 4 bytes per value: bf16 is 2", lambda s, psi, n, k: 2 * right(s, psi, n, k)))
    return out


def _close(a, b) -> bool:
    try:
        return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return False


def _zero_memory_hints(answers: list) -> dict:
    """{part: diagnosis} for each part whose values one known slip reproduces in every case
    (`answers`: [((stage, psi, n, k), got dict)]); when several slips fit, all are named."""
    hints = {}
    for key in ("params", "grads", "optimizer"):
        cases = [(args, got[key]) for args, got in answers if isinstance(got, dict) and key in got]
        if len(cases) != len(answers) or all(_close(v, zero_memory_bytes(*args, param_bytes=2)[key])
                                             for args, v in cases):
            continue
        fitting = list(dict.fromkeys(why for why, rule in _slips(key)
                                     if fits(rule, cases, _close)))
        if fitting:
            hints[key] = explain(fitting)
    if hints and all("not padded" in h for h in hints.values()):
        return {"all": "no padding: stages 1-3 use Ψ' = n⌈Ψ/n⌉ for the full buffers, Ψ'/n a shard"}
    return hints


def check_zero_memory(fn) -> None:
    """DP and the three stages, against the formula, padding included; a wrong answer is
    told which stage it is, or which part is sharded at the wrong stage — a diagnosis only
    when it explains the answers of every case."""
    cases = [(s, 7_500_000_000, 64, 12) for s in range(4)]               # the ZeRO paper's model
    cases += [(s, 10, 4, 12) for s in range(4)] + [(s, 6498, 8, 12) for s in range(4)]
    cases += [(s, 1000, 1, 12) for s in range(4)] + [(2, 99, 2, 8), (3, 99, 2, 8), (3, 3, 8, 4),
                                                     (1, 5, 2, 8)]   # N = 2: ×N is ×2
    answers, wrong = [], []
    for stage, psi, n, k in cases:
        got = call_student(fn, stage, psi, n, k)
        if isinstance(got, dict):
            try:
                got = {key: int(v) if float(v).is_integer() else float(v) for key, v in got.items()}
            except (TypeError, ValueError):
                pass
        want = zero_memory_bytes(stage, psi, n, k, param_bytes=2)
        where = f"stage={stage}, Ψ={psi}, N={n}, k={k}"
        if isinstance(got, dict) and set(got) != set(want):
            report("ZeRO memory per rank", [f"{where}: the keys must be {sorted(want)}, not "
                                            f"{sorted(got)}"], len(cases))
        answers.append(((stage, psi, n, k), got))
        line = compare(where, got, want)
        if line:
            wrong.append((where, (stage, psi, n, k), got, line))
    staged = {where: _other_stage(got, *args) for where, args, got, _ in wrong
              if isinstance(got, dict)}
    problems, hinted = [], {}
    parts = _zero_memory_hints(answers)
    for where, args, got, line in wrong:
        want = zero_memory_bytes(*args, param_bytes=2)
        bad = [key for key in want if isinstance(got, dict) and not _close(got.get(key), want[key])]
        if staged.get(where):                      # the whole answer is another stage's
            named = [staged[where]]
        elif "all" in parts:
            named = [parts["all"]]
        elif bad and all(key in parts for key in bad):
            named = [parts[key] for key in bad]
        else:
            named = []
        for hint in named:
            hinted.setdefault(hint, []).append(where)
        if not named:
            problems += line
    problems = [f"{where[0]}: {hint}" + (f" (and {len(where) - 1} more case(s) alike)"
                                         if len(where) > 1 else "")
                for hint, where in hinted.items()] + problems
    report("ZeRO memory per rank", problems, len(cases))


def _zero1_data(numel, n, rank, split):
    """(param, every rank's gradient): one parameter vector per group (the groups' data
    differ, so an answer that reduces over the world shows), one gradient per rank."""
    team = members(rank)[0] if split else 0
    g = torch.Generator().manual_seed(7 + 100 * team)
    param = torch.randn(numel, generator=g)
    grads = torch.randn(n, numel, generator=torch.Generator().manual_seed(8))
    return param, grads


def _zero1_worker(fn, numel, lr, split):
    group = my_group(split)
    rank, n = dist.get_rank(), dist.get_world_size()
    param, grads = _zero1_data(numel, n, rank, split)
    with Ledger(keep_inputs=True) as ledger:      # what this rank hands to each collective
        out = call_student(fn, param.clone(), grads[rank].clone(), lr, group=group)
    gathered = [sent for record, sent in ledger.inputs if record.op == "all_gather"]
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, ledger.summary(), world_calls(ledger) if split else [], gathered


def _gathered_problem(where, gathered, param, grads, rank, lr, split) -> list[str]:
    """ZeRO-1's structure: the one all-gather carries this rank's *updated parameter shard*
    (it stepped its shard alone), not the mean gradient every rank would then apply whole."""
    mine = members(rank) if split else list(range(grads.shape[0]))
    n, me, numel = len(mine), mine.index(rank), param.numel()
    size = -(-numel // n)
    padded = torch.zeros(2, size * n)
    padded[0, :numel], padded[1, :numel] = param, grads[mine].mean(0)
    new_shard = (padded[0] - lr * padded[1])[me * size:(me + 1) * size]
    grad_shard = padded[1, me * size:(me + 1) * size]
    if len(gathered) != 1:
        return [f"{where}: {len(gathered)} all-gathers; ZeRO-1 gathers once, the updated "
                "parameter shards"]
    sent = gathered[0].double().flatten()
    if sent.numel() == size and torch.allclose(sent, new_shard.double(), atol=1e-5):
        return []
    if sent.numel() == size and torch.allclose(sent, grad_shard.double(), atol=1e-5):
        return [f"{where}: you all-gathered the mean gradient and stepped the whole vector on every "
                "rank — ZeRO-1 steps only this rank's shard (w_shard − lr·g_shard) and all-gathers "
                "the updated parameters"]
    return [f"{where}: the all-gather's input ({sent.numel()} values) is not this rank's updated "
            f"parameter shard ({size} values, elements {me * size}…{(me + 1) * size - 1} of the "
            "padded vector after w − lr·g): step your shard, then gather it"]


def _zero1_problem(where, out, param, grads, rank, lr, split) -> list[str]:
    """The values, with the mistake named: compared as the gradient the step applied
    ((param − new) / lr), which tells a sum from a mean and a group from the world."""
    n_group = len(members(rank)) if split else grads.shape[0]
    mine = members(rank) if split else list(range(grads.shape[0]))
    mean = grads[mine].mean(0)
    if not isinstance(out, torch.Tensor):
        return [f"{where}: return the new parameter vector (a tensor), got {type(out).__name__}"]
    if out.shape != param.shape:
        size = -(-param.numel() // n_group)
        if out.numel() in (size, -(-param.numel() // grads.shape[0])):
            return [f"{where}: returned {out.numel()} elements, this rank's shard — all-gather "
                    f"the updated shards and return all {param.numel()}"]
        return compare(f"{where}: new parameters", out, param - lr * mean, atol=1e-6)
    applied = (param - out.double().float()) / lr
    if torch.allclose(applied, mean, atol=1e-4):
        return []
    if split and torch.allclose(applied, grads.mean(0), atol=1e-4):
        return [f"{where}: " + on_world_not_group("the mean gradient")]
    size = -(-param.numel() // n_group)
    owners = torch.cat([grads[r] for r in mine])      # shard j updated with its owner's gradient
    owners = torch.cat([owners.view(len(mine), -1)[j, j * size:(j + 1) * size]
                        for j in range(len(mine))])[:param.numel()]
    if torch.allclose(applied, grads[rank], atol=1e-4) or torch.allclose(applied, owners, atol=1e-4):
        return [f"{where}: each shard was updated with its rank's own gradient — reduce-scatter "
                "the gradient (op=\"avg\") and update with the mean"]
    me = mine.index(rank)
    stale = torch.ones(param.numel(), dtype=torch.bool)
    stale[me * size:(me + 1) * size] = False
    if (n_group > 1 and torch.allclose(applied[~stale], mean[~stale], atol=1e-4)
            and torch.allclose(applied[stale], torch.zeros(int(stale.sum())), atol=1e-6)):
        return [f"{where}: only this rank's shard was updated — all-gather the updated shards "
                "so every rank returns the whole new vector"]
    lines = compare(f"{where}: the gradient your step applied ((param − new)/lr)", applied,
                    mean, atol=1e-4)
    return lines


@contextmanager
def _short_pieces(numel: int, n: int):
    """A rank that raised IndexError on a line calling torch.chunk or .split, at a size those
    cut into fewer than n pieces, is told so (one more line under run_student's)."""
    try:
        yield
    except ExerciseFailed as e:
        pieces = {"chunk": len(torch.empty(numel).chunk(n)),
                  "split": len(torch.empty(numel).split(-(-numel // n)))}
        called = [f for f in pieces if re.search(rf"\b{f}\(", e.details) and pieces[f] < n]
        if "IndexError" not in e.details or not called:
            raise
        size = -(-numel // n)
        hint = (f"{numel} elements on {n} ranks: {' and '.join(called)}() cut them into "
                f"{pieces[called[0]]} pieces of at most {size}, not {n} — rank r's shard is "
                f"elements [r·{size}, (r+1)·{size}) of the buffer padded to {n * size}: pad first")
        print(f"  ✗ {hint}")
        raise ExerciseFailed(e.args[0], e.problems + [hint]) from None


def check_zero1_step(fn, timeout: float | None = None) -> None:
    """Values equal to one SGD step on the mean gradient of the group, the same on every rank,
    and the traffic of a reduce-scatter plus an all-gather of the padded buffer (no
    all-reduce): on 2 and 3 ranks and on 4 ranks split into two groups of 2."""
    problems, count = [], 0
    # 5 elements on 4 ranks: shards of 2, but torch.chunk(4) gives 3 pieces (2, 2, 1)
    for n, numel, split in [(2, 11, False), (3, 11, False), (3, 12, False), (4, 5, False),
                            (4, 11, True)]:
        with _short_pieces(numel, 2 if split else n):
            ranks = run_student(_zero1_worker, n, fn, numel, 0.1, split, name="zero1_step",
                                timeout=timeout)
        per_rank = []
        for rank, (out, led, world, gathered) in enumerate(ranks):
            count += 1
            param, grads = _zero1_data(numel, n, rank, split)
            where = f"{numel} elements"
            if world:
                per_rank.append([on_world_not_group(f"the group of your {world[0]}")])
                continue
            mine = _zero1_problem(where, out, param, grads, rank, 0.1, split)
            if not mine and "all_reduce" not in led:
                mine = _gathered_problem(where, gathered, param, grads, rank, 0.1, split)
            if "all_reduce" in led:
                mine.append(f"{where}: used all_reduce — ZeRO-1 reduce-scatters instead")
            m = 2 if split else n
            ring = (m - 1) * padded_numel(numel, m) * 4 // m
            for op in ("reduce_scatter", "all_gather"):
                sent = led.get(op, {}).get("sent_bytes", 0)
                if sent != ring:
                    mine.append(f"{where}: {op} sent {sent} bytes; one {op} of the padded "
                                f"buffer ({padded_numel(numel, m)} fp32) over {m} ranks "
                                f"sends {ring}")
            per_rank.append(mine)
        problems += _every_rank(_label(n, split), per_rank)
        if problems:
            break                                    # the same mistake again on more ranks
    report("ZeRO-1 step", problems, count)


# ---------------------------------------------------------------- ZeRO-2 and ZeRO-3 by hand

# odd sizes: every unit needs padding on 4 ranks (the checks run 4 ranks first)
_CFG = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                   ffn_hidden=23, max_seq=16)
# and a unit of 5 elements: on 4 ranks shards of 2, where torch.chunk(4) makes 3 pieces;
# its values differ from rank to rank
_TINY = [(3,), (2,)]


def _tiny(rank: int, size: int | None = None, index: int = 0) -> list[torch.Tensor] | torch.Tensor:
    """Rank `rank`'s gradients of the 5-element unit (or, given `size`, its parameter shard
    as the `index`-th rank of its group, padding 0)."""
    g = torch.Generator().manual_seed(50 + rank)
    if size is None:
        return [torch.randn(shape, generator=g) for shape in _TINY]
    shard = torch.randn(size, generator=g)
    shard[index * size + torch.arange(size) >= 5] = 0.0
    return shard


def _ranks_of(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _label(n: int, split: bool) -> str:
    return f"group of 2 in {list(SUBGROUPS)}" if split else f"N={n}"


def _every_rank(n, per_rank: list[list[str]]) -> list[str]:
    """One line per distinct mistake: the same problem on every rank (and unit) is
    reported once, with the first occurrence's numbers."""
    def key(p):                              # the problem without its unit and its error size
        return re.sub(r"-?\d+(\.\d*)?(e[-+]?\d+)?", "#", re.sub(r" \(largest error [^)]*\)", "", p))
    ranks_with = {}
    for rank, problems in enumerate(per_rank):
        for p in problems:
            ranks_with.setdefault(key(p), [p, set()])[1].add(rank)
    out = []
    for k, (first, ranks) in ranks_with.items():
        cases = sum(key(x) == k for q in per_rank for x in q)
        who = "every rank" if len(ranks) == len(per_rank) else "rank " + ", ".join(map(str, sorted(ranks)))
        out.append(f"{n if isinstance(n, str) else f'N={n}'}, {who}" + (f" ({cases} cases like this one)" if cases > len(ranks) else "")
                   + f": {first}")
    return out


def _traffic(led: dict, op: str, nbytes: int) -> list[str]:
    out = []
    if "all_reduce" in led:
        out.append("calls: used all_reduce — ZeRO sends each rank only its shard "
                   f"({op.replace('_', '-')})")
    calls = led.get(op, {}).get("calls", 0)
    if out:
        return out
    if calls != 1:
        out.append(f"calls: {calls} picolib.comm.{op} calls for one unit; one call moves the "
                   "whole flat buffer")
    elif led[op]["nbytes"] != nbytes:
        out.append(f"calls: the {op} moved a buffer of {led[op]['nbytes']} bytes; the unit "
                   f"padded to a multiple of N is {nbytes} bytes")
    return out


def _unit_grads(model):
    return [[p.grad.detach().clone() for _, p in named] for _, named in split_units(model)]


def _rs_worker(fn, split):
    group = my_group(split)
    rank = dist.get_rank()
    x, y = random_tokens(2, 8, _CFG.vocab_size, seed=rank)
    plain = TinyLlama(_CFG)                      # same seed: the same weights as ZeRO's
    plain.loss(x, y).backward()
    answers = []
    for grads in _unit_grads(plain) + [_tiny(rank)]:
        with Ledger() as led:
            got = call_student(fn, [g.clone() for g in grads], group=group)
        # the shard a reversed flattening (or the world) would give, to name those mistakes
        others = {}
        for key, order, grp in (("reversed", grads[::-1], group), ("world", grads, None)):
            flat = torch.cat([g.flatten() for g in order])
            flat = flat.clone()
            dist.all_reduce(flat, group=grp)
            m = dist.get_world_size(grp)
            size = -(-flat.numel() // m)
            padded = torch.cat([flat / m, flat.new_zeros(size * m - flat.numel())])
            others[key] = padded[dist.get_rank(grp) * size:(dist.get_rank(grp) + 1) * size]
        answers.append((got.detach().clone() if isinstance(got, torch.Tensor) else got,
                        led.summary(), sum(g.numel() for g in grads), others))
    model = TinyLlama(_CFG)
    zero = ZeRO(model, 2, group=group, optimizer=torch.optim.SGD, lr=0.1)
    model.loss(x, y).backward()
    zero.finish_gradient_sync()                  # picolib's reduce-scatter, unit by unit
    mine = _ranks_of(group)                      # the tiny unit's shard, by hand
    mean = torch.stack([torch.cat(_tiny(r)) for r in mine]).mean(0)
    size = -(-mean.numel() // len(mine))
    tiny = torch.cat([mean, mean.new_zeros(size * len(mine) - mean.numel())])
    me = mine.index(rank)
    return answers, [u.grad.clone() for u in zero.units] + [tiny[me * size:(me + 1) * size]]


def check_reduce_scatter_gradients(fn, timeout: float | None = None) -> None:
    """This rank's shard of the mean gradient, for each unit, equal to picolib ZeRO-2's: on 2
    and 4 ranks and on 4 ranks split into two groups of 2."""
    problems, count = [], 0
    for n, split in ((4, False), (2, False), (4, True)):
        per_rank = []
        m = 2 if split else n
        with _short_pieces(5, m):
            results = run_student(_rs_worker, n, fn, split, name="reduce_scatter_gradients",
                                  timeout=timeout)
        for rank, (answers, shards) in enumerate(results):
            mine = []
            for unit, ((got, led, numel, others), want) in enumerate(zip(answers, shards)):
                count += 1
                what = f"unit {unit} ({numel} elements)"
                ok = isinstance(got, torch.Tensor) and got.shape == want.shape
                if ok and torch.allclose(got, want, atol=1e-6):
                    pass
                elif isinstance(got, torch.Tensor) and got.numel() in (numel, padded_numel(numel, m)):
                    mine.append(f"{what}: returned {got.numel()} elements — the whole gradient; "
                                f"return only this rank's shard of ⌈{numel}/{m}⌉ = {want.numel()}")
                elif split and isinstance(got, torch.Tensor) and (
                        got.numel() == -(-numel // 4) or got.shape == want.shape
                        and torch.allclose(got, others["world"], atol=1e-6)):
                    mine.append(f"{what}: " + on_world_not_group("the shard"))
                elif ok and torch.allclose(got, others["reversed"], atol=1e-6):
                    mine.append(f"{what}: the gradients were flattened in reverse order — keep the "
                                "order given (the unit's flat buffer holds its parameters in order)")
                else:
                    mine += compare(f"{what}: your shard", got, want, atol=1e-6)
                mine += [f"{what}: {p}" for p in
                         _traffic(led, "reduce_scatter", padded_numel(numel, m) * 4)]
            per_rank.append(mine)
        problems += _every_rank(_label(n, split), per_rank)
        if problems:
            break
    report("ZeRO-2 gradient reduce-scatter", problems, count)


def _gather_worker(fn, split):
    group = my_group(split)
    rank = dist.get_rank()
    model = TinyLlama(_CFG)
    zero = ZeRO(model, 3, group=group, optimizer=torch.optim.Adam, lr=0.01)
    x, y = random_tokens(2, 8, _CFG.vocab_size, seed=rank)
    model.loss(x, y).backward()
    zero.step()                                   # the shards now differ from the start
    full = zero.gather_parameters()               # picolib's answer: {name: tensor}
    answers = []
    for u in zero.units:
        shapes = [tuple(p.shape) for p in u.params]
        world = [torch.empty_like(u.shard) for _ in range(dist.get_world_size())]
        dist.all_gather(world, u.shard.detach().clone())   # what ignoring `group` gathers
        with Ledger() as led:
            got = call_student(fn, u.shard.detach().clone(), shapes, group=group)
        if isinstance(got, (list, tuple)):
            got = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in got]
        answers.append((got, led.summary(), [full[name] for name in u.names], u.numel,
                        torch.cat(world), list(u.names)))
    mine, size = _ranks_of(group), -(-5 // dist.get_world_size(group))
    with Ledger() as led:                        # the tiny unit: shards of rank-dependent values
        got = call_student(fn, _tiny(rank, size, mine.index(rank)), list(_TINY), group=group)
    if isinstance(got, (list, tuple)):
        got = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in got]
    whole = torch.cat([_tiny(r, size, j) for j, r in enumerate(mine)])[:5]
    world = [_tiny(r, size, (members(r) if group is not None else mine).index(r))
             for r in range(dist.get_world_size())]
    answers.append((got, led.summary(), list(whole.split([3, 2])), 5, torch.cat(world),
                    ["tiny.a", "tiny.b"]))
    return answers


def _gather_hint(got: list, want: list, n: int, numel: int) -> str:
    """Name the usual mistakes: padding kept, shards in reverse rank order, the gathered buffer
    read column by column (each named only when it reproduces the answer)."""
    flat = torch.cat([t.flatten() for t in got]).double()
    ref = torch.cat([t.flatten() for t in want]).double()
    pad = padded_numel(numel, n)
    if flat.numel() == pad != numel:
        return f"{pad} elements returned for {numel}: drop the {pad - numel} elements of padding"
    if flat.numel() != numel:
        return f"{flat.numel()} elements returned; the unit has {numel}"
    size = pad // n
    padded = torch.cat([ref, ref.new_zeros(pad - numel)])
    fitting = []
    if n > 1 and torch.allclose(flat, torch.cat(list(padded.split(size))[::-1])[:numel], atol=1e-6):
        fitting.append("the shards are concatenated in reverse rank order: rank r's shard goes at "
                       "elements [r·S, (r+1)·S)")
    if n > 1 and size > 1 and torch.allclose(flat, padded.view(n, size).t().reshape(-1)[:numel],
                                             atol=1e-6):
        fitting.append("the gathered buffer was read column by column (element j of every "
                       "rank's shard side by side): rank r's shard is one block, elements "
                       "[r·S, (r+1)·S)")
    return explain(fitting)


def check_gather_unit(fn, timeout: float | None = None) -> None:
    """Each unit's parameters, gathered from the shards, equal picolib ZeRO-3's: on 2 and 4
    ranks and on 4 ranks split into two groups of 2."""
    problems, count = [], 0
    for n, split in ((4, False), (2, False), (4, True)):
        per_rank = []
        m = 2 if split else n
        with _short_pieces(5, m):
            results = run_student(_gather_worker, n, fn, split, name="gather_unit", timeout=timeout)
        for answers in results:
            mine = []
            for unit, (got, led, want, numel, world, names) in enumerate(answers):
                count += 1
                what = f"unit {unit} ({numel} elements)"
                if not isinstance(got, (list, tuple)) or not all(isinstance(t, torch.Tensor)
                                                                 for t in got):
                    mine.append(f"{what}: return a list of tensors, one per parameter "
                                f"(got {type(got).__name__})")
                    continue
                flat = torch.cat([t.flatten() for t in got])
                hint = _gather_hint(got, want, m, numel)
                if split and (flat.numel() == world.numel() or flat.numel() == numel
                              and torch.allclose(flat, world[:numel], atol=1e-6)):
                    mine.append(f"{what}: " + on_world_not_group("the gather"))
                elif hint:
                    mine.append(f"{what}: {hint}")
                else:
                    shapes = [tuple(t.shape) for t in got]
                    if shapes != [tuple(t.shape) for t in want]:
                        mine.append(f"{what}: shapes {shapes}, expected "
                                    f"{[tuple(t.shape) for t in want]}")
                    else:
                        mine += [line for name, g, w in zip(names, got, want)
                                 for line in compare(f"{what}: {name}", g, w, atol=1e-6)][:1]
                mine += [f"{what}: {p}" for p in
                         _traffic(led, "all_gather", padded_numel(numel, m) * 4)]
            per_rank.append(mine)
        problems += _every_rank(_label(n, split), per_rank)
        if problems:
            break
    report("ZeRO-3 gather before forward", problems, count)
