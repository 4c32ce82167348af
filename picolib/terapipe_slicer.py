"""TeraPipe's slicer: how to cut one sequence into token slices (lesson 08).

A slice of l tokens that comes after c tokens of context costs t(l, c) on a pipeline stage
(forward + backward): the projections and the MLP grow with l, attention with l·(c + l)
because each token attends to its whole causal context. With K stages and slices
l₁…l_M run one after another (forwards in order, backwards in reverse), the step takes

    T = Σᵢ tᵢ + (K − 1) · maxᵢ tᵢ ,      tᵢ = t(lᵢ, l₁ + … + lᵢ₋₁)

(Li et al., "TeraPipe", ICML 2021, §3.3): every slice crosses the last stage, and the
slowest one is paid once more on each of the other K − 1 stages while the pipeline fills
and drains. `pipeline_latency` is that formula; `dp_slices` is the paper's dynamic program
that minimises it: fix a cap t_max on the slowest slice, find by DP the slicing with the
least Σ tᵢ whose slices all cost ≤ t_max, add (K − 1)·t_max, and keep the best cap.
`uniform_slices` is the equal cut to compare with. `CostModel` / `fit_cost_model` are the
simple model t(l, c) = a + b·l + d·l·c + e·l² fitted from timings (the paper fits one in
l and c too); `picolib.terapipe.measure_costs` takes the timings.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

__all__ = ["pipeline_latency", "slice_costs", "uniform_slices", "dp_slices", "least_sum", "check_cost",
           "CostModel", "fit_cost_model", "check_slices", "token_flops"]


# --------------------------------------------------------------------------- the core

def slice_costs(slices, cost) -> list[float]:
    """[t(l₁, 0), t(l₂, l₁), t(l₃, l₁ + l₂), ...]: each slice's cost after its context."""
    out, context = [], 0
    for length in check_slices(slices):
        out.append(float(cost(length, context)))
        context += length
    return out


def pipeline_latency(slices, cost, n_stages: int, n_micro: int = 1) -> float:
    """T = Σ tᵢ + (K − 1)·max tᵢ over the slices of all `n_micro` micro-batches (each cut
    the same way): the makespan of K equal stages running the slices in order."""
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need n_stages ≥ 1 and n_micro ≥ 1, got {n_stages} and {n_micro}")
    t = slice_costs(slices, cost)
    return n_micro * sum(t) + (n_stages - 1) * max(t)


def least_sum(n: int, t: dict, cap: float) -> tuple[list, list]:
    """S(i): the least Σ tᵢ of i positions cut into slices of cost ≤ cap; last(i): its last slice."""
    S, last = [0.0] + [math.inf] * n, [0] * (n + 1)
    for i in range(1, n + 1):
        for k in range(1, i + 1):                    # the last slice: positions i−k … i−1
            if t[k, i - k] <= cap and S[i - k] + t[k, i - k] < S[i]:
                S[i], last[i] = S[i - k] + t[k, i - k], k
    return S, last


def dp_slices(seq: int, n_stages: int, cost, unit: int = 1) -> tuple[tuple[int, ...], float]:
    """The slices of `seq` tokens (multiples of `unit`) with the least step time, and that time."""
    n = _check_dp(seq, n_stages, cost, unit)
    t = {(k, c): float(cost(k * unit, c * unit)) for k in range(1, n + 1) for c in range(n - k + 1)}
    best, best_slices = math.inf, None
    for cap in sorted(set(t.values())):              # every possible slowest slice
        if n_stages > 1 and (n_stages - 1) * cap >= best:
            break                                    # the fill alone costs more than the best
        S, last = least_sum(n, t, cap)
        if S[n] + (n_stages - 1) * cap < best:
            best, best_slices = S[n] + (n_stages - 1) * cap, _cut(last, n, unit)
    return best_slices, best


# --------------------------------------------------------------------------- checks and the uniform cut

def check_slices(slices, seq: int | None = None) -> tuple[int, ...]:
    """The slices as a tuple of ints; a clear error for a slice of 0 tokens (or fewer) and
    for slices that do not add up to the sequence length `seq`."""
    out = tuple(int(x) for x in slices)
    if not out:
        raise ValueError("no slices: give at least one slice length")
    bad = [(i, x) for i, x in enumerate(out) if x < 1]
    if bad:
        raise ValueError(f"slice {bad[0][0]} has {bad[0][1]} tokens; every slice needs ≥ 1 "
                         f"(slices {list(out)})")
    if seq is not None and sum(out) != seq:
        raise ValueError(f"slices {list(out)} add up to {sum(out)} tokens, not the sequence "
                         f"length {seq}")
    return out


def uniform_slices(seq: int, n_slices: int) -> tuple[int, ...]:
    """`n_slices` slices of equal length (the first ones one token longer if it does not
    divide): what a slicer without a cost model would do."""
    if not 1 <= n_slices <= seq:
        raise ValueError(f"{n_slices} slices of a {seq}-token sequence: need 1 ≤ slices ≤ {seq}")
    q, r = divmod(seq, n_slices)
    return tuple(q + (i < r) for i in range(n_slices))


def check_cost(cost, seq: int, unit: int = 1) -> None:
    """The slicer's assumption, checked on the grid it uses: t(l, c) ≥ 0 and t does not go
    down when the context grows (later tokens attend to more). A measured table that
    breaks it is noise: fit a model (`fit_cost_model`) instead."""
    for length in range(unit, seq + 1, unit):
        prev = None
        for context in range(0, seq - length + 1, unit):
            t = float(cost(length, context))
            if t < 0:
                raise ValueError(f"t(l={length}, c={context}) = {t:g} is negative")
            if prev is not None and t < prev - 1e-12:
                raise ValueError(
                    f"the cost is not monotone in the context: t(l={length}, c={context}) = "
                    f"{t:g} < t(l={length}, c={context - unit}) = {prev:g}; later tokens "
                    "attend to more context and cannot be cheaper — refit the cost model")
            prev = t


def _check_dp(seq: int, n_stages: int, cost, unit: int) -> int:
    """dp_slices' checks; the number of positions n = seq / unit. The DP is O(n⁴): `unit`
    keeps n small (the paper slices at a granularity too)."""
    if unit < 1 or seq % unit:
        raise ValueError(f"unit={unit} must be ≥ 1 and divide the sequence length {seq}")
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: need at least one stage")
    check_cost(cost, seq, unit)
    return seq // unit


def _cut(last: list, n: int, unit: int) -> tuple[int, ...]:
    """The slice lengths in tokens, read back from the last slice of each prefix."""
    cuts, i = [], n
    while i:
        cuts.append(last[i] * unit)
        i -= last[i]
    return tuple(reversed(cuts))


# --------------------------------------------------------------------------- the cost model

@dataclass(frozen=True)
class CostModel:
    """t(l, c) = a + b·l + d·l·c + e·l² seconds for a slice of l tokens after c tokens of
    context: a fixed overhead, the per-token work (projections, MLP), the attention to
    the context, and the attention inside the slice. d ≥ 0: more context never costs less."""
    a: float
    b: float
    d: float
    e: float

    def __post_init__(self):
        if self.d < 0:
            raise ValueError(f"d = {self.d:g} < 0: the cost would fall as the context grows "
                             "(later tokens attend to more, they cannot be cheaper)")

    def __call__(self, length, context) -> float:
        return self.a + self.b * length + self.d * length * context + self.e * length * length


def fit_cost_model(samples) -> CostModel:
    """Least squares of (l, c, seconds) samples on the terms 1, l, l·c, l², in relative
    error (each sample divided by its time, so short slices weigh as much). A fit whose
    context term comes out negative (timing noise) is not monotone in the context: warn,
    and refit without that term. A quadratic term that makes t fall somewhere on the
    measured lengths is dropped the same way."""
    rows = [(float(l), float(c), float(s)) for l, c, s in samples]
    if any(s <= 0 for _, _, s in rows):
        raise ValueError("every sample needs a positive time")
    if len(rows) < 4:
        raise ValueError(f"{len(rows)} samples: fitting 4 coefficients needs at least 4")
    terms = ["a", "b", "d", "e"]

    def fit(keep):
        # relative errors: a short slice's time matters as much as a long one's
        X = torch.tensor([[{"a": 1.0, "b": l, "d": l * c, "e": l * l}[k] / s for k in keep]
                          for l, c, s in rows], dtype=torch.float64)
        y = torch.ones(len(rows), 1, dtype=torch.float64)
        coef = torch.linalg.lstsq(X, y).solution.flatten().tolist()
        return {**dict.fromkeys(terms, 0.0), **dict(zip(keep, coef))}

    keep = list(terms)
    c = fit(keep)
    if c["d"] < 0:
        warnings.warn(f"the fitted cost falls with the context (d = {c['d']:.3g} < 0): not "
                      "monotone in the context — refitting without the l·c term", stacklevel=2)
        keep.remove("d")
        c = fit(keep)
    lengths = sorted({l for l, _, _ in rows})
    if c["e"] < 0 and any(c["b"] + 2 * c["e"] * l < 0 for l in lengths):
        warnings.warn(f"the fitted cost falls with the slice length (e = {c['e']:.3g}): "
                      "refitting without the l² term", stacklevel=2)
        keep.remove("e")
        c = fit(keep)
    return CostModel(c["a"], c["b"], max(c["d"], 0.0), c["e"])



# --------------------------------------------------------------------------- where a token's FLOPs go

def token_flops(hidden: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, keys: int,
                gated: bool = True) -> dict:
    """Forward matmul FLOPs of one token in one layer that attends to `keys` keys (its
    context and itself), split into the part every token pays and the part that grows
    with the context (computed; lesson 08 checks it against FlopCounterMode).

    Every token: 2 FLOPs per weight of the projections (q and o: h², k and v: h·kv·d) and
    of the MLP (2 matrices of h·F, 3 when `gated`, SwiGLU). The context: q·kᵀ and p·v,
    2·keys·d FLOPs each per query head → 4·keys·h. For GPT (kv = a, F = 4h, not gated)
    the share of the context is 4·keys·h / (24h² + 4·keys·h) ≈ keys / (6h)."""
    if min(hidden, n_heads, n_kv_heads, ffn_hidden, keys) < 1 or hidden % n_heads:
        raise ValueError("need positive sizes and hidden divisible by n_heads")
    head_dim = hidden // n_heads
    weights = 2 * hidden * hidden + 2 * hidden * n_kv_heads * head_dim \
        + (3 if gated else 2) * hidden * ffn_hidden
    linear, context = 2 * weights, 4 * keys * n_heads * head_dim
    return {"linear": linear, "context": context, "total": linear + context,
            "context_share": context / (linear + context)}
