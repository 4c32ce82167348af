"""Checks for lesson 07 (pipeline parallel).

- `check_one_f_one_b(fn)`: `fn(rank, p, m)` → rank's 1F1B op list as [("F"|"BW", mb), ...].
- `check_bubble(fn)`: `fn(p, m, v=1)` → bubble time / ideal time of (interleaved) 1F1B,
  graded where make_schedule has the schedule (v ≥ 2 needs m a multiple of p).
- `check_broken_schedules(fn)`: `fn(reason)` → a 2-rank, 2-micro-batch `Schedule` that the
  validator must reject for exactly that reason: "missing", "B before F", "W before B",
  "deadlock" (every rank's own list is fine, the ranks wait for each other).
- `check_afab_stage(fn)`: `fn(stage, rank, p, tokens, targets)` runs one AFAB step of this
  rank's stage on real ranks, as the executor's forward and backward do (receive, run, send on;
  receive ∂ℒ/∂y, backward, send ∂ℒ/∂x back) → the loss on the last rank, None elsewhere; the
  stage's .grad must equal one process's.
"""
from __future__ import annotations

import torch

from ..model import LlamaConfig, TinyLlama, random_tokens
from ..pipeline_schedules import Op, Schedule, make_schedule, one_f_one_b
from .. import pipeline_simulator
from ..pipeline_simulator import ScheduleError, simulate, validate
from ..timeline import bubble_ratio
from ._core import call_student, compare, report, run_student

__all__ = ["check_one_f_one_b", "check_bubble", "check_broken_schedules", "check_afab_stage", "REASONS"]

REASONS = {"missing": "missing", "B before F": "before its F", "W before B": "before its B",
           "deadlock": "deadlock"}


def check_one_f_one_b(fn) -> None:
    """Compare with picolib's 1F1B for p in 1..4, m in 1..6, every rank; then validate the
    schedule made of the student's lists (it must not deadlock)."""
    problems, checks = [], 0
    for p in range(1, 5):
        for m in range(1, 7):
            ref = one_f_one_b(p, m)
            rows = []
            for r in range(p):
                got = call_student(fn, r, p, m)
                want = [(op.kind, op.mb) for op in ref.ops[r]]
                checks += 1
                try:
                    got = [(str(k), int(mb)) for k, mb in got]
                except (TypeError, ValueError):
                    problems.append(f"rank {r}, p={p}, m={m}: expected a list of (kind, mb) "
                                    f"pairs, got {got!r}")
                    continue
                if got != want:
                    fmt = lambda ops: " ".join(f"{k}{mb}" for k, mb in ops)
                    problems.append(f"rank {r}, p={p}, m={m}: got {fmt(got)}, expected {fmt(want)}")
                rows.append(got)
            if len(rows) == p and not problems:
                ops = [[Op(k, r, mb) for k, mb in row] for r, row in enumerate(rows)]
                try:
                    validate(Schedule("student", m, ref.stage_ranks, ops))
                except ScheduleError as e:
                    problems.append(f"p={p}, m={m}: the validator rejects your schedule: {e}")
        if len(problems) > 5:
            break
    report("1F1B op lists", problems[:8], checks)


def check_bubble(fn) -> None:
    """Against the simulator (F = 1/v, BW = 2/v per chunk, no W split), on every (p, m, v)
    of a grid that make_schedule accepts: 1F1B for v = 1, interleaved for v ≥ 2 with m a
    multiple of p. (Interleaving with m < p, e.g. m = 1, has no schedule: one micro-batch
    crosses the p·v chunks in turn and the bubble stays p−1 — not graded.)"""
    problems, checks = [], 0
    for p in (1, 2, 4, 8):
        for m in (1, 2, 4, 8, 16):
            for v in (1, 2, 4):
                name = "1f1b" if v == 1 else "interleaved"
                try:
                    sched = make_schedule(name, p, m, v)
                except ValueError:
                    continue
                sim = bubble_ratio(simulate(sched, {"F": 1 / v, "B": 2 / v, "W": 0}))
                checks += 1
                problems += compare(f"bubble(p={p}, m={m}, v={v}) vs the simulated {name}",
                                    call_student(fn, p, m, v), sim)
    report("bubble formula", problems[:8], checks)


def _valid(ops, n_micro=2) -> bool:
    try:
        validate(Schedule("repair", n_micro, (0, 1), ops))
        return True
    except (ScheduleError, ValueError):
        return False


def _one_repair(sched: Schedule, reason: str) -> bool:
    """Broken in exactly one way: one op put back ("missing") or one op moved to another place
    on its rank makes the schedule valid."""
    ops = [list(row) for row in sched.ops]
    if reason == "missing":
        for r in range(len(ops)):
            for kind in ("F", "BW", "B", "W"):
                for mb in range(sched.n_micro):
                    for at in range(len(ops[r]) + 1):
                        trial = [list(row) for row in ops]
                        trial[r].insert(at, Op(kind, r, mb))
                        if _valid(trial, sched.n_micro):
                            return True
        return False
    for r in range(len(ops)):
        for i in range(len(ops[r])):
            for at in range(len(ops[r])):
                row = ops[r][:i] + ops[r][i + 1:]
                row.insert(at, ops[r][i])
                trial = [list(x) for x in ops]
                trial[r] = row
                if _valid(trial, sched.n_micro):
                    return True
    return False


def check_broken_schedules(fn) -> None:
    """Each schedule must be rejected by `validate` for the asked reason and no other, and be
    broken in exactly one way: one op put back or moved repairs it."""
    problems = []
    for reason, phrase in REASONS.items():
        sched = call_student(fn, reason)
        if not isinstance(sched, Schedule):
            problems.append(f"{reason!r}: expected a Schedule, got {type(sched).__name__}")
            continue
        if sched.n_ranks != 2 or sched.n_micro != 2 or tuple(sched.stage_ranks) != (0, 1):
            problems.append(f"{reason!r}: use 2 ranks, 2 micro-batches, stage r on rank r")
            continue
        try:
            validate(sched)
            problems.append(f"{reason!r}: the validator accepts this schedule — it runs fine")
            continue
        except ScheduleError as e:
            message = str(e)
        if phrase not in message:
            problems.append(f"{reason!r}: rejected for another reason: {message}")
        elif not _one_repair(sched, reason):
            problems.append(f"{reason!r}: broken in more than one way — no single op "
                            + ("put back" if reason == "missing" else "moved on its rank")
                            + " makes it valid; start from a valid schedule and change one thing")
        if reason == "deadlock":
            try:
                pipeline_simulator.check_ops(sched)
            except ScheduleError as e:
                problems.append(f"'deadlock': every op must be present and in a valid order on "
                                f"its rank, but: {e}")
    report("broken schedules", problems, len(REASONS))


# (p, layers, m micro-batches, b, s): stages of unequal size, m not a multiple of p
_AFAB_CASES = [(2, 3, 3, 2, 5), (3, 5, 4, 1, 7)]


def _afab_cfg(layers):
    return LlamaConfig(hidden=16, n_layers=layers, n_heads=2, n_kv_heads=1, ffn_hidden=24, max_seq=8)


def _afab_data(cfg, m, b, s):
    tokens, targets = random_tokens(b * m, s, cfg.vocab_size, seed=7)
    return list(tokens.chunk(m)), list(targets.chunk(m))


def _afab_worker(fn, p, layers, m, b, s):
    import torch.distributed as dist

    from ..pipeline_parallel import split_stages, stage_grads
    rank, cfg = dist.get_rank(), _afab_cfg(layers)
    model = TinyLlama(cfg)
    stage = split_stages(model, p)[rank]
    held = {id(w) for w in stage.parameters()}
    loss = fn(stage, rank, p, *_afab_data(cfg, m, b, s))
    return ((None if loss is None else float(loss)), stage_grads(stage, model),
            [n for n, w in model.named_parameters() if id(w) in held])


def check_afab_stage(fn, timeout: float | None = None) -> None:
    """On 2 and 3 ranks, stages of unequal size, m = 3 and 4 micro-batches: the last rank's
    loss and every rank's gradients against one process on the whole batch (fp32: 1e-5)."""
    problems, checks = [], 0
    for p, layers, m, b, s in _AFAB_CASES:
        ranks = run_student(_afab_worker, p, fn, p, layers, m, b, s, name="afab_stage", timeout=timeout)
        ref = TinyLlama(_afab_cfg(layers))
        tokens, targets = _afab_data(_afab_cfg(layers), m, b, s)
        ref_loss = ref.loss(torch.cat(tokens), torch.cat(targets))
        ref_loss.backward()
        where = f"p={p}, {layers} layers, m={m}"
        for rank, (loss, grads, held) in enumerate(ranks):
            checks += 1
            if rank < p - 1 and loss is not None:
                problems.append(f"{where}, rank {rank}: returned a loss — only the last stage computes "
                                "it (return None elsewhere)")
            if rank == p - 1:
                if loss is None:
                    problems.append(f"{where}, rank {rank}: returned None — the last stage returns the "
                                    "loss, summed over the micro-batches")
                else:
                    problems += compare(f"{where}, rank {rank}: the loss", loss, ref_loss.item(), atol=1e-5)
            missing = [n for n in held if n not in grads]
            if missing:
                problems.append(f"{where}, rank {rank}: no gradient in {missing[0]}.grad — run the "
                                "backward of every micro-batch through the stage")
                continue
            want = dict(ref.named_parameters())
            for name in held:
                problems += compare(f"{where}, rank {rank}: ∂ℒ/∂{name}", grads[name], want[name].grad, atol=1e-5)
        if problems:
            break
    report("AFAB stage on real ranks", problems, checks)
