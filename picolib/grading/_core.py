"""What every check shares: calling the student's code safely, comparing (with a one-line
diagnosis of the common mistakes: a uniform factor, a permutation), reporting."""
from __future__ import annotations

import torch

from ..launch import WorkerError, WorkerTimeout, run

TIMEOUT = 60.0  # seconds a distributed exercise may run before it counts as a deadlock


class ExerciseFailed(AssertionError):
    """The student's answer differs from the reference (the message says how)."""


def call_student(fn, *args, **kwargs):
    """Call the student's function; an unfinished exercise becomes a clear failure."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseFailed(f"{getattr(fn, '__name__', 'your function')} is not written yet "
                             "(it raises NotImplementedError)") from None


def run_student(worker, world_size: int, *args, name: str = "your function",
                timeout: float | None = None, **kwargs) -> list:
    """Run `worker` on ranks through launch.run; a rank's failure, or ranks that never finish
    (after `TIMEOUT` seconds, the one setting every lesson uses), become ExerciseFailed."""
    timeout = TIMEOUT if timeout is None else timeout
    try:
        return run(worker, world_size, *args, timeout=timeout, **kwargs)
    except WorkerTimeout as e:
        raise ExerciseFailed(
            f"{name} did not finish on {world_size} ranks within {timeout:g} s — a deadlock? "
            "(a collective that some rank skips or calls in another order; two neighbours that "
            "both block in send). Where the ranks were stuck:\n" + str(e)) from None
    except WorkerError as e:
        if "NotImplementedError" in str(e).split("\n")[0]:
            raise ExerciseFailed(f"rank {e.rank}: the exercise is not written yet "
                                 "(NotImplementedError)") from None
        raise ExerciseFailed(str(e)) from None


def compare(what: str, got, expected, atol: float = 1e-6, rtol: float = 1e-5) -> list[str]:
    """Describe how `got` differs from `expected` (numbers, tensors, sequences); [] if equal."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{what}: expected a tensor, got {type(got).__name__}"]
        if tuple(got.shape) != tuple(expected.shape):
            return [f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"]
        if not torch.allclose(got.double(), expected.double(), atol=atol, rtol=rtol):
            err = (got.double() - expected.double()).abs().max().item()
            hint = diagnose(got, expected, atol, rtol)
            return [f"{what}: values differ (max abs error {err:.3g}, tolerance {atol:g})"
                    + (f" — {hint}" if hint else "")]
        return []
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return [f"{what}: expected {len(expected)} items, got {got!r}"]
        plain = all(not isinstance(e, torch.Tensor) for e in expected)
        if (plain and list(map(repr, got)) != list(map(repr, expected))
                and sorted(map(repr, got)) == sorted(map(repr, expected))):
            return [f"{what}: the right items in the wrong order: got {list(got)!r}, "
                    f"expected {list(expected)!r}"]
        return [p for i, (g, e) in enumerate(zip(got, expected, strict=True))
                for p in compare(f"{what}[{i}]", g, e, atol, rtol)]
    if isinstance(expected, float):
        try:
            ok = abs(float(got) - expected) <= atol + rtol * abs(expected)
        except (TypeError, ValueError):
            ok = False
        return [] if ok else [f"{what}: got {got!r}, expected {expected!r}"]
    return [] if got == expected else [f"{what}: got {got!r}, expected {expected!r}"]


def diagnose(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6,
             rtol: float = 1e-5) -> str:
    """One line naming a common mistake when `got` is `expected` off by a uniform factor
    (forgot to average over N ranks, or to divide by k micro-batches: got = N·expected) or
    is a permutation of it (right values, wrong order); "" when neither fits."""
    g, e = got.double().flatten(), expected.double().flatten()
    big = e.abs() > atol
    if big.any():
        ratio = (g[big] / e[big]).median().item()
        if abs(ratio - 1) > 1e-3 and torch.allclose(g, ratio * e, atol=atol, rtol=rtol):
            whole = round(ratio) if abs(ratio - round(ratio)) < 1e-3 else None
            inverse = round(1 / ratio) if ratio and abs(1 / ratio - round(1 / ratio)) < 1e-3 else None
            if whole and whole > 1:
                return (f"every value is {whole}× too large: a sum where a mean was wanted "
                        f"(forgot to divide by the {whole} ranks or micro-batches?)")
            if inverse and inverse > 1:
                return f"every value is {inverse}× too small: divided once too often?"
            return f"every value is off by the same factor {ratio:.4g}"
    if torch.allclose(g.sort().values, e.sort().values, atol=atol, rtol=rtol):
        return "the right values in the wrong order (a permutation: check the rank or chunk order)"
    return ""


def report(title: str, problems: list[str], passed: int | None = None) -> None:
    """Print the verdict; raise ExerciseFailed listing every difference."""
    if problems:
        lines = "\n".join(f"  ✗ {p}" for p in problems)
        print(f"{title}: {len(problems)} problem(s)\n{lines}")
        raise ExerciseFailed(f"{title}:\n{lines}")
    print(f"✓ {title}" + (f": all {passed} checks passed" if passed else ""))
