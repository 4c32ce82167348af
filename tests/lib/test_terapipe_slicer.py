"""TeraPipe's slicer: the DP equals brute-force search; the latency formula equals the
pipeline played on ideal devices (lesson 07's simulator) and a flow-shop recurrence; the DP
is never worse than uniform slices; the cost model fits, refuses, warns and refits."""
import itertools
import random

import pytest

from picolib.terapipe import TeraPipePlan, simulate_plan
from picolib.terapipe_slicer import (CostModel, check_cost, dp_slices, fit_cost_model,
                                     pipeline_latency, slice_costs, uniform_slices)
from picolib.timeline import makespan


def brute_force(seq, K, cost, unit=1):
    """Every composition of seq/unit, scored by a hand-written flow-shop recurrence."""
    n, best = seq // unit, (float("inf"), None)
    for cuts in itertools.product((0, 1), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        slices = [(b - a) * unit for a, b in zip(bounds, bounds[1:])]
        best = min(best, (flow_shop(slices, cost, K), tuple(slices)))
    return best


def flow_shop(slices, cost, K):
    """Completion time of slice i on stage k = max(previous slice on k, slice i on k−1) + tᵢ,
    forwards then backwards (the same recurrence, reversed): the step's makespan for
    forward share ⅓ of each slice's cost."""
    t, ctx = [], 0
    for length in slices:
        t.append(cost(length, ctx))
        ctx += length

    def phase(times):
        done = [0.0] * K
        for ti in times:
            for k in range(K):
                done[k] = max(done[k], done[k - 1] if k else 0.0) + ti
        return done[-1]
    return phase([x / 3 for x in t]) + phase([2 * x / 3 for x in reversed(t)])


def random_table(n, rng):
    """A cost table t(l, c) on a grid of n tokens, non-decreasing in c, positive."""
    base = {l: rng.uniform(0.5, 3.0) * l ** rng.uniform(0.6, 1.4) for l in range(1, n + 1)}
    steps = {(l, c): rng.uniform(0, 0.5) for l in range(1, n + 1) for c in range(n)}
    return lambda l, c: base[l] + sum(steps[(l, j)] for j in range(c))


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n, K = rng.randint(1, 10), rng.randint(1, 5)
    cost = random_table(n, rng)
    slices, value = dp_slices(n, K, cost)
    best, _ = brute_force(n, K, cost)
    assert value == pytest.approx(best, rel=1e-9)
    assert sum(slices) == n and flow_shop(slices, cost, K) == pytest.approx(value, rel=1e-9)


def test_dp_on_a_grid_equals_brute_force_on_it():
    cost = CostModel(a=2.0, b=0.01, d=0.002, e=0.001)
    for K in (2, 4, 8):
        slices, value = dp_slices(512, K, cost, unit=64)
        best, _ = brute_force(512, K, cost, unit=64)
        assert value == pytest.approx(best) and all(s % 64 == 0 for s in slices)


@pytest.mark.parametrize("seed", range(6))
def test_formula_equals_the_simulated_pipeline(seed):
    """T = m·Σtᵢ + (K−1)·max tᵢ against lesson 07's simulator running the plan's schedule
    (forwards, then backwards in reverse) and against the recurrence above."""
    rng = random.Random(100 + seed)
    n, K, m = rng.randint(1, 12), rng.randint(1, 6), rng.randint(1, 3)
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
    slices = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    cost = random_table(n, rng)
    T = pipeline_latency(slices, cost, K, n_micro=m)
    assert makespan(simulate_plan(TeraPipePlan(slices, K, 2 * K, n_micro=m), cost)) == pytest.approx(T)
    if m == 1:
        assert flow_shop(slices, cost, K) == pytest.approx(T)


def test_the_corrected_worked_example():
    """Slices (3, 3, 2), K = 3, t = tokens: Σt + (K−1)·max t = 8 + 2·3 = 14, not 8."""
    cost = lambda l, c: float(l)
    assert slice_costs((3, 3, 2), cost) == [3, 3, 2]
    assert pipeline_latency((3, 3, 2), cost, 3) == 14
    assert makespan(simulate_plan(TeraPipePlan((3, 3, 2), 3, 3), cost)) == pytest.approx(14)
    assert flow_shop((3, 3, 2), cost, 3) == pytest.approx(14)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_dp_is_never_worse_than_uniform(K):
    cost = CostModel(a=1.0, b=0.02, d=0.004, e=0.002)
    _, value = dp_slices(256, K, cost, unit=16)
    uniform = {M: pipeline_latency(uniform_slices(256, M), cost, K) for M in (1, 2, 4, 8, 16)}
    assert value <= min(uniform.values())
    assert value < min(uniform.values()) * 0.99        # and strictly better when context costs


def test_uniform_slices():
    assert uniform_slices(10, 3) == (4, 3, 3) and uniform_slices(8, 8) == (1,) * 8
    with pytest.raises(ValueError, match="need 1 ≤ slices ≤ 8"):
        uniform_slices(8, 9)


def test_bad_costs_and_units():
    with pytest.raises(ValueError, match="not monotone in the context"):
        dp_slices(4, 2, lambda l, c: l - 0.1 * c)
    with pytest.raises(ValueError, match="negative"):
        check_cost(lambda l, c: -1.0, 4)
    with pytest.raises(ValueError, match="unit=3 must be ≥ 1 and divide the sequence length 8"):
        dp_slices(8, 2, lambda l, c: l, unit=3)
    with pytest.raises(ValueError, match="d = -0.1 < 0"):
        CostModel(1, 1, -0.1, 0)


def _samples(model, noise=0.0, seed=0):
    rng = random.Random(seed)
    return [(l, c, model(l, c) * (1 + rng.uniform(-noise, noise)))
            for l in (16, 32, 64, 128) for c in (0, 128, 256, 512)]


def test_fit_recovers_the_model():
    true = CostModel(a=1e-3, b=2e-5, d=3e-8, e=1e-8)
    fit = fit_cost_model(_samples(true))
    for name in "abde":
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12)


def test_fit_that_falls_with_context_warns_and_refits():
    samples = [(l, c, 1e-3 + 2e-5 * l - 1e-8 * l * c) for l in (16, 32, 64) for c in (0, 128, 256)]
    with pytest.warns(UserWarning, match="not monotone in the context"):
        fit = fit_cost_model(samples)
    assert fit.d == 0 and fit(64, 256) == fit(64, 0)
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model(samples[:3])
