"""Checks for lesson 08 (TeraPipe).

- `check_pipeline_latency(fn)`: `fn(slices, cost, K)` → the step time of a slicing on K
  stages, `cost(l, c)` the time of a slice of l tokens after c tokens of context; graded
  against lesson 07's simulator playing the schedule (not against the formula).
- `check_dp_slicer(fn)`: `fn(seq, K, cost)` → (slices, T) minimising Σtᵢ + (K−1)·max tᵢ (a
  non-optimal answer is shown the better slicing; a wrong objective or cost is named only when
  it alone gives every answer, right ones included);
  T must be the optimum (found by exhaustive search) and the slices must reach it.
- `check_slice_mask(fn)`: `fn(slices, i)` → the bool mask (lᵢ, cᵢ + lᵢ) of which keys the
  queries of slice i attend to (its cached context and itself, causally); graded against
  the attention the model really computes.
"""
from __future__ import annotations

import itertools
import random

import torch

from ..model import attention_core
from ..terapipe import TeraPipePlan, simulate_plan
from ..timeline import makespan
from ._core import call_student, compare, explain, report

__all__ = ["check_pipeline_latency", "check_dp_slicer", "check_slice_mask"]


def _table(n, seed):
    """A positive cost t(l, c) on n tokens that grows with the context (random steps)."""
    rng = random.Random(seed)
    base = {l: rng.uniform(1, 3) * l ** 0.8 for l in range(1, n + 1)}
    grow = {l: rng.uniform(0.05, 0.6) for l in range(1, n + 1)}
    return lambda l, c: round(base[l] + grow[l] * l * c / n, 6)


def _compositions(n):
    for cuts in itertools.product((0, 1), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _simulated(slices, cost, K):
    return makespan(simulate_plan(TeraPipePlan(slices, K, K), cost))


def check_pipeline_latency(fn) -> None:
    """Random slicings of up to 10 tokens, K = 1..5 stages, context-dependent costs, and
    the worked example (3, 3, 2) on K = 3 with t = l."""
    problems, checks = [], 0
    cases = [((3, 3, 2), lambda l, c: float(l), 3)]
    for seed in range(12):
        rng = random.Random(seed)
        n = rng.randint(2, 10)
        slices = rng.choice(list(_compositions(n)))
        cases.append((slices, _table(n, seed), rng.randint(1, 5)))
    answers = []
    for slices, cost, K in cases:
        checks += 1
        got = call_student(fn, slices, cost, K)
        want = _simulated(slices, cost, K)
        answers.append((slices, cost, K, got))
        if compare("", got, want):
            t = [round(x, 6) for x in _times(slices, cost)]
            problems.append(f"latency of slices {list(slices)} on K={K} stages: got {got!r}, expected "
                            f"{want:.6g} — with tᵢ = cost(lᵢ, cᵢ) = {t}, Σt = {sum(t):.6g} and "
                            f"(K−1)·max t = {(K - 1) * max(t):.6g}")
    hint = _latency_hint(answers) if problems else ""
    if hint:
        problems = [f"{hint} — e.g. {problems[0]}"]
    report("pipeline latency of a slicing", problems[:6], checks)


def _times(slices, cost, context="right"):
    t, ctx = [], 0
    for length in slices:
        t.append(cost(length, {"right": ctx, "no context": 0, "context + l": ctx + length}[context]))
        ctx += length
    return t


_LATENCY_SLIPS = {
    "Σt alone: the pipeline fill is missing — the last slice still crosses K−1 more stages, "
    "(K−1)·max t": lambda t, K: sum(t),
    "K·max t, not (K−1)·max t: the slowest slice crosses K stages but only K−1 of them "
    "wait beyond Σt": lambda t, K: sum(t) + K * max(t),
    "K·Σt: the stages work one after another — slices overlap, so T = Σt + (K−1)·max t":
        lambda t, K: K * sum(t),
    "the fill is paid by the slowest slice (max t), not the first or the last":
        lambda t, K: sum(t) + (K - 1) * t[0],
    "the fill is paid by the slowest slice (max t), not the last":
        lambda t, K: sum(t) + (K - 1) * t[-1],
    "(n + K − 1)·max t: every slice counted as the slowest — sum the real tᵢ":
        lambda t, K: (len(t) + K - 1) * max(t),
}


def _latency_hint(answers) -> str:
    """The slip that alone gives every answer, right ones included — a formula, or the context
    of cost(l, c) taken wrong — or each that does ("" if none)."""
    def fit(rule, context="right"):
        try:
            return all(abs(float(got) - rule(_times(sl, cost, context), K)) < 1e-6 * max(1, abs(float(got)))
                       for sl, cost, K, got in answers)
        except (TypeError, ValueError):
            return False
    right = lambda t, K: sum(t) + (K - 1) * max(t)
    named = [why for why, rule in _LATENCY_SLIPS.items() if fit(rule)]
    if fit(right, "no context"):
        named.append("each slice's cost was taken with no context: slice i is cost(lᵢ, cᵢ) with "
                     "cᵢ = l₁ + … + lᵢ₋₁, the tokens before it")
    if fit(right, "context + l"):
        named.append("each slice's context counts the slice itself, cost(lᵢ, cᵢ + lᵢ): cᵢ = "
                     "l₁ + … + lᵢ₋₁, the tokens before it")
    return explain(named)


def _value(slices, cost, K):
    t, ctx = [], 0
    for length in slices:
        t.append(cost(length, ctx))
        ctx += length
    return sum(t) + (K - 1) * max(t)


_DP_SLIPS = {   # a wrong objective or cost the student's T is the optimum of, and what it means
    "your T is the optimum of Σt + K·max t: the fill is (K−1)·max t (the slowest slice crosses "
    "K−1 more stages)": lambda t, K, ctx: sum(t) + K * max(t),
    "your T is the optimum of Σt alone: the pipeline fill (K−1)·max t is missing":
        lambda t, K, ctx: sum(t),
    "your T is the optimum with each slice costed with no context, cost(l, 0): slice i costs "
    "cost(lᵢ, cᵢ) with cᵢ its tokens before it": "no context",
    "your T is the optimum with each slice's context counting the slice itself, cost(l, c + l): "
    "the context of the slice ending at i is i − k, not i": "context + l",
}


def _value_of(slices, cost, K, objective=None, context="right"):
    t, ctx = [], 0
    for length in slices:
        c = {"right": ctx, "no context": 0, "context + l": ctx + length}[context]
        t.append(cost(length, c))
        ctx += length
    return (objective or (lambda t, K, _: sum(t) + (K - 1) * max(t)))(t, K, None)


def _dp_hint(answers) -> str:
    """The slip that alone gives every answer — each case's T is the optimum of the same wrong
    objective or cost (by exhaustive search), and the returned slices reach it under that slip
    too — right answers included; "" when none fits, or when several do (no single cause)."""
    named = []
    for why, rule in _DP_SLIPS.items():
        objective, context = (None, rule) if isinstance(rule, str) else (rule, "right")
        if all(abs(T - min(_value_of(s, cost, K, objective, context) for s in _compositions(n))) <= 1e-6
               and abs(_value_of(slices, cost, K, objective, context) - T) <= 1e-6
               for n, K, cost, slices, T in answers):
            named.append(why)
    return named[0] if len(named) == 1 else ""


def check_dp_slicer(fn) -> None:
    """Sequences of 1..9 tokens, K = 1..6 stages, random context-growing cost tables: the
    returned T is the optimum over every slicing, and the returned slices reach it."""
    problems, checks, answers = [], 0, []
    for seed in range(14):
        rng = random.Random(50 + seed)
        n, K = rng.randint(1, 9), rng.randint(1, 6)
        cost = _table(n, 50 + seed)
        best_slices = min(_compositions(n), key=lambda s: _value(s, cost, K))
        best = _value(best_slices, cost, K)
        got = call_student(fn, n, K, cost)
        checks += 1
        case = f"seq={n}, K={K}"
        try:
            slices, T = got
            slices = [int(x) for x in slices]
            T = float(T)
        except (TypeError, ValueError):
            problems.append(f"{case}: expected (slices, T), a list of ints and a number, got {got!r}")
            continue
        if sum(slices) != n:
            problems.append(f"{case}: your slices {slices} sum to {sum(slices)}, not to the "
                            f"sequence's {n} tokens: every token is in exactly one slice")
            continue
        if min(slices, default=0) < 1:
            problems.append(f"{case}: your slices {slices} hold a slice of length "
                            f"{min(slices, default=0)}: every slice holds at least one token")
            continue
        mine = _value(slices, cost, K)
        answers.append((n, K, cost, slices, T))
        if abs(mine - best) <= 1e-6 and abs(T - best) > 1e-6:
            problems.append(f"{case}: your slices {slices} reach the optimum {best:.6g} but you "
                            f"return T = {T:.6g}, not their Σt + (K−1)·max t with tᵢ = cost(lᵢ, cᵢ), "
                            "cᵢ the tokens before slice i")
        elif T < best - 1e-6:
            problems.append(f"{case}: your T = {T:.6g} is below the optimum {best:.6g} "
                            f"(slicing {list(best_slices)}); your slices {slices} give {mine:.6g}")
        elif mine > best + 1e-6:
            if (abs(_value(slices[::-1], cost, K) - best) <= 1e-6 and abs(T - best) <= 1e-6
                    and slices != slices[::-1]):    # the optimum found, its slices read back wrong
                problems.append(f"{case}: your slices {slices} are the best slicing reversed: "
                                "the rebuild walks back from seq — reverse the list it collects")
            elif abs(T - best) <= 1e-6:
                problems.append(f"{case}: your T = {T:.6g} is the optimum, but your slices "
                                f"{slices} give {mine:.6g}: rebuild them from the choices of the "
                                f"best cap (e.g. {list(best_slices)})")
            else:
                problems.append(f"{case}: not optimal: slicing {list(best_slices)} gives T = "
                                f"{best:.6g} < yours {mine:.6g} (slices {slices})")
    if problems and len(answers) == checks:
        hint = _dp_hint(answers)
        if hint:
            problems = [f"{hint} — e.g. {problems[0]}"]
    report("DP slicer", problems[:6], checks)


def _model_mask(slices, i):
    """The mask the model really applies to slice i: key j is attended by query row r when
    the output row moves with value j (∂y_r/∂v_j = softmax weight, exactly 0 when masked)."""
    start, length = sum(slices[:i]), slices[i]
    keys = start + length
    q = torch.randn(1, 1, length, 4, dtype=torch.float64)
    k = torch.randn(1, 1, keys, 4, dtype=torch.float64)
    v = torch.randn(1, 1, keys, 4, dtype=torch.float64, requires_grad=True)
    y = attention_core(q, k, v)
    out = torch.zeros(length, keys, dtype=torch.bool)
    for row in range(length):
        (gv,) = torch.autograd.grad(y[0, 0, row].sum(), v, retain_graph=True)
        out[row] = gv[0, 0].abs().sum(-1) > 0
    return out


def check_slice_mask(fn) -> None:
    """Several slicings, every slice: the student's mask against the keys each query of the
    slice really attends to (gradients through the model's attention_core). A usual wrong mask
    is named when it alone gives every answer; otherwise each wrong slice says which query and
    key differ."""
    problems, checks, answers, first = [], 0, [], None
    for slices in ((3, 3, 2), (4,), (1, 1, 1), (2, 5, 1), (5, 3)):
        for i in range(len(slices)):
            want = _model_mask(slices, i)
            got = call_student(fn, slices, i)
            checks += 1
            where = f"slices {list(slices)}, slice {i}"
            if not isinstance(got, torch.Tensor):
                problems.append(f"{where}: expected a bool tensor, got {type(got).__name__}")
                continue
            if tuple(got.shape) != tuple(want.shape):
                problems += compare(f"{where}: mask", got.bool().float(), want.float())
                continue
            got = got.bool()
            answers.append(((want, sum(slices[:i])), got))
            if not torch.equal(got, want):
                first = first or (len(problems), sum(slices[:i]), want.shape)
                problems.append(f"{where}: {_mask_difference(got, want, sum(slices[:i]))}")
    if first is not None and len(answers) == checks:
        index, c, (length, keys) = first
        hint = explain([why.format(c=c, length=length, keys=keys) for why, rule in _MASK_SLIPS.items()
                        if all(torch.equal(got, rule(*args)) for args, got in answers)])
        problems = [f"{problems[index].split(': ', 1)[0]}: {hint}"] if hint else problems
    report("attention mask of a slice", problems[:6], checks)


def _mask_difference(got, want, c) -> str:
    """Which query of the slice and which key differ, in the statement's terms."""
    bad = (got != want).nonzero()
    r, j = (int(v) for v in bad[0])
    return (f"{len(bad)} of {want.numel()} entries wrong, the first: query {r} of the slice (token "
            f"{c + r}) and key {j} — got {bool(got[r, j])}, expected {bool(want[r, j])} (it "
            + ("may" if want[r, j] else "may not") + f" attend to key {j})")


def _ones(want):
    return torch.ones_like(want, dtype=torch.bool)


# the usual wrong masks of a slice with c tokens of cached context, as rules of (want, c)
_MASK_SLIPS = {
    "a top-left causal mask (tril of the {length}×{keys} block): query r of this slice is token "
    "c + r = {c} + r and sees keys 0 … c + r — align the diagonal bottom-right "
    "(torch.tril(…, diagonal=c))": lambda want, c: _ones(want).tril(),
    "the mask is inverted: True means the query attends to that key": lambda want, c: ~want,
    "the {c} cached context tokens are masked: every query of the slice sees all the tokens "
    "before the slice": lambda want, c: torch.cat([torch.zeros_like(want[:, :c]), want[:, c:]], 1),
    "nothing is masked: a query must not see the keys after it in its own slice":
        lambda want, c: _ones(want),
    "upper triangle: the mask is transposed (True where the key comes at or before the query)":
        lambda want, c: _ones(want).triu(c),
    "upper triangle from the first key: the mask is transposed, and its diagonal not moved by "
    "the {c} tokens of context": lambda want, c: _ones(want).triu(),
}
