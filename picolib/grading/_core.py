"""What every check shares: calling the student's code safely, comparing (with a one-line
diagnosis of the common mistakes: a uniform factor, a permutation), running on a real
sub-group as well as the world, reporting in a few lines."""
from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from ..launch import WorkerError, WorkerTimeout, run

# seconds a distributed exercise may run before it counts as a deadlock: its ranks finish in
# milliseconds, so this is mostly start-up on a busy machine. Every distributed check takes
# `timeout=` to shorten (or lengthen) it.
TIMEOUT = 20.0
SHOWN = 8  # problem lines a failure prints; the rest are counted
SUBGROUPS = ([0, 2], [1, 3])  # 4 ranks as two groups of 2 (strided, as data-parallel groups are)
_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ExerciseFailed(AssertionError):
    """The student's answer differs from the reference. The problems were printed already
    (at most `SHOWN` lines); `.problems` holds every one, `.details` their text."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems) if problems is not None else [message]
        self.details = message + "".join(f"\n  ✗ {p}" for p in (problems or []))
        super().__init__(message)


def call_student(fn, *args, **kwargs):
    """Call the student's function; an unfinished exercise becomes a clear failure."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseFailed(f"{getattr(fn, '__name__', 'your function')} is not written yet "
                             "(it raises NotImplementedError)") from None


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<fn>\S+)')


def _student_frames(text: str) -> list[tuple[str, str, str]]:
    """(function, line, source) of every frame in a traceback or stack dump that is not
    picolib's, PyTorch's or Python's own: the student's code, innermost last."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if not m:
            continue
        path = m["file"]
        if (os.path.abspath(path).startswith(_LIBRARY) or "site-packages" in path
                or "/lib/python" in path or path.startswith("<frozen")):
            continue
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        source = "" if _FRAME.search(nxt) or nxt.startswith("---") else nxt
        out.append((m["fn"], m["line"], source))
    return out


def _where(frames) -> str:
    fn, line, source = frames[-1]
    return f"in {fn}, line {line}" + (f": {source}" if source else "")


def _timeout_message(e: WorkerTimeout, name: str, world_size: int, timeout: float) -> str:
    """The stuck ranks, each with the student's line it waits in (innermost first in a dump)."""
    lines = [f"{name} did not finish on {world_size} ranks within {timeout:g} s — a deadlock "
             "(a collective some rank skips or calls in another order; two neighbours that both "
             "block in send/recv)? Pass timeout=… to the check to wait less or more."]
    for block in str(e).split("--- rank ")[1:]:
        rank = block.split(" ", 1)[0]
        frames = _student_frames(block)[::-1]        # faulthandler prints innermost first
        lines.append(f"rank {rank} was waiting " + (_where(frames) if frames else
                                                  "outside your code"))
    return "\n".join(lines[:SHOWN])


# the errors a group rank passed where a global rank is due raises (torch.distributed's own
# words), and no other: every gloo error names "ProcessGroupGloo"
_PEER_NOT_IN_GROUP = re.compile(r"(global|group) rank -?\d+ is not part of (the parent )?group"
                                r"|invalid (destination|source|peer|src|dst) rank"
                                r"|rank -?\d+ is out of (range|bounds)", re.IGNORECASE)


_RUN_NOTE = re.compile(r"^picolib\.grading: (in the .*)$", re.MULTILINE)


def _error_message(e: WorkerError) -> str:
    first = str(e).split("\n")[0]
    run_ = _RUN_NOTE.search(e.remote_traceback)
    if run_:
        first += f" — {run_[1]}"
    frames = _student_frames(e.remote_traceback)
    last = e.remote_traceback.strip().splitlines()[-1:] or [first]
    msg = first if not frames else f"{first}\n  raised {_where(frames)}"
    if _PEER_NOT_IN_GROUP.search(last[0]):
        msg += ("\n  (with a sub-group, peers are global ranks: comm.ring_neighbours(group) or "
                "dist.get_global_rank(group, i) turn a rank of the group into one)")
    return msg


def run_student(worker, world_size: int, *args, name: str = "your function",
                timeout: float | None = None, **kwargs) -> list:
    """Run `worker` on ranks through launch.run; a rank's failure, or ranks that never finish
    (after `timeout` seconds, `TIMEOUT` unless given), become ExerciseFailed, naming the
    student's source line."""
    timeout = TIMEOUT if timeout is None else timeout
    try:
        return run(_naming_the_run, world_size, worker, *args, timeout=timeout, **kwargs)
    except WorkerTimeout as e:
        message = _timeout_message(e, name, world_size, timeout)
    except WorkerError as e:
        if "NotImplementedError" in str(e).split("\n")[0]:
            raise ExerciseFailed(f"rank {e.rank}: the exercise is not written yet "
                                 "(NotImplementedError)") from None
        message = _error_message(e)
    print(message)
    raise ExerciseFailed(message.split("\n")[0] + " (details above)",
                         message.split("\n")[1:]) from None


_RUN = None   # on a rank: "world" or "group", which run of a check this is (set by my_group)


def _naming_the_run(worker, *args, **kwargs):
    """On a rank: `worker(*args, **kwargs)`; an error it raises after `my_group` says which run
    it came from, the world's or the sub-groups' (a note in its traceback)."""
    global _RUN
    _RUN = None
    try:
        return worker(*args, **kwargs)
    except Exception as e:
        if _RUN == "group":
            e.add_note(f"picolib.grading: in the sub-group run (4 ranks as the groups "
                       f"{' and '.join(map(str, SUBGROUPS))})")
        elif _RUN == "world":
            e.add_note(f"picolib.grading: in the world run ({dist.get_world_size()} ranks, group=None)")
        raise


def my_group(split: bool):
    """On a rank: None (the world) or, when `split`, this rank's group of `SUBGROUPS` (every
    rank creates every group, as torch.distributed requires)."""
    global _RUN
    _RUN = "group" if split else "world"
    if not split:
        return None
    from ..mesh import Mesh
    from ..rank import device
    group = Mesh(device().type, dp=2, tp=2).group("dp")      # SUBGROUPS: the dp groups of 2×2
    assert dist.get_process_group_ranks(group) == members(dist.get_rank())
    return group


def members(rank: int) -> list[int]:
    """The global ranks of `rank`'s group in `SUBGROUPS`."""
    return next(ranks for ranks in SUBGROUPS if rank in ranks)


def on_world_not_group(what: str) -> str:
    return (f"{what} is that of all 4 ranks, not of `group` (2 ranks: {list(SUBGROUPS)}): pass "
            "group=group to every comm call and use dist.get_world_size(group), "
            "dist.get_rank(group)")


def compare(what: str, got, expected, atol: float = 1e-6, rtol: float = 1e-5) -> list[str]:
    """Describe how `got` differs from `expected` (numbers, tensors, sequences); [] if equal."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{what}: expected a tensor, got {type(got).__name__}"]
        if tuple(got.shape) != tuple(expected.shape):
            return [f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"]
        if not torch.allclose(got.double(), expected.double(), atol=atol, rtol=rtol):
            hint = diagnose(got, expected, atol, rtol)
            return [f"{what}: {differing(got, expected, atol, rtol)}" + (f" — {hint}" if hint else "")]
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


def differing(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6,
              rtol: float = 1e-5) -> str:
    """Where two tensors of one shape differ, plainly: how many elements, the first one's index
    with its value and the expected one, and the largest error against the tolerance."""
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    bad = ~torch.isclose(g, e, atol=atol, rtol=rtol)
    if not bad.any():
        return "equal within the tolerance"
    first = tuple(int(i) for i in bad.nonzero()[0])
    err = (g - e).abs().nan_to_num(float("inf")).max().item()
    at = f"[{', '.join(map(str, first))}]" if first else ""
    if g.numel() == 1:
        return f"got {g[first].item():.6g}, expected {e[first].item():.6g}"
    return (f"{int(bad.sum())} of {g.numel()} elements wrong, the first at {at}: got "
            f"{g[first].item():.6g}, expected {e[first].item():.6g} (largest error {err:.3g}, "
            f"tolerance {atol:g})")


def compare_parameters(what: str, got: torch.Tensor, want: torch.Tensor, model,
                       atol: float = 1e-6, rtol: float = 1e-5) -> list[str]:
    """compare() of `model`'s parameters flattened into one vector (got and want), the first
    wrong element named by its parameter and index, as `model.named_parameters()` names them."""
    wrong = compare(what, got, want, atol=atol, rtol=rtol)
    if not wrong:
        return []
    bad = ~torch.isclose(got.double(), want.double(), atol=atol, rtol=rtol)
    first = offset = int(bad.nonzero()[0])
    hint = wrong[0].split(" — ", 1)[1] if " — " in wrong[0] else ""
    for name, p in model.named_parameters():
        if offset < p.numel():
            index = [int(v) for v in torch.unravel_index(torch.tensor(offset), p.shape)]
            return [f"{what}: {int(bad.sum())} of {want.numel()} values wrong, the first "
                    f"{name}{index}: got {got[first].item():.6g}, expected {want[first].item():.6g}"
                    + (f" — {hint}" if hint else "")]
        offset -= p.numel()
    return wrong


def explain(fitting: list[str]) -> str:
    """The diagnosis from the known mistakes that reproduce the student's answers (`fitting`,
    each a line naming one): that line when exactly one does; every one of them, said as
    candidates, when several do — a hint that also fits another mistake names both."""
    if len(fitting) <= 1:
        return fitting[0] if fitting else ""
    return ("your answers fit each of these mistakes, check which you made: "
            + "; or ".join(fitting))


def fits(rule, cases, close) -> bool:
    """Whether `rule(*args)` reproduces every answer: `cases` is [(args, got)], `close(got,
    value)` the comparison; a rule that raises fits nothing."""
    try:
        return all(close(got, rule(*args)) for args, got in cases)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return False


def diagnose(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6,
             rtol: float = 1e-5) -> str:
    """One line naming a common mistake when `got` is `expected` off by a uniform factor
    (forgot to average over N ranks, or to divide by k micro-batches: got = N·expected) or
    is a permutation of it (right values, wrong order; only when they are distinct); "" when
    neither fits."""
    g, e = got.double().flatten(), expected.double().flatten()
    big = e.abs() > atol
    if big.any() and (g.abs() > atol).any():        # all zeros: no factor to speak of
        ratio = (g[big] / e[big]).median().item()
        if abs(ratio - 1) > 1e-3 and torch.allclose(g, ratio * e, atol=atol, rtol=rtol):
            whole = round(ratio) if abs(ratio - round(ratio)) < 1e-3 else None
            if g.numel() == 1 and not whole and not (ratio and abs(1 / ratio - round(1 / ratio)) < 1e-3):
                return ""                    # one number: any two differ "by a factor"
            inverse = round(1 / ratio) if ratio and abs(1 / ratio - round(1 / ratio)) < 1e-3 else None
            if whole and whole > 1:
                return (f"every value is {whole}× too large: a sum where a mean was wanted "
                        f"(a division by {whole} missing?)")
            if inverse and inverse > 1:
                return f"every value is {inverse}× too small: divided once too often?"
            return f"every value is off by the same factor {ratio:.4g}"
    # a permutation only says something when the values are distinct: any two masks with as
    # many Trues "are permutations" of each other
    if (e.unique().numel() == e.numel() > 1
            and torch.allclose(g.sort().values, e.sort().values, atol=atol, rtol=rtol)):
        return "the right values in the wrong order (a permutation: check the rank or chunk order)"
    return ""


def _telling(p: str) -> int:
    """Sort key: a line that names a cause (" — ", "hint") before a bare difference."""
    return 0 if (" — " in p or p.startswith("hint") or ": the " in p and "elements wrong" not in p) else 1


def report(title: str, problems: list[str], passed: int | None = None) -> None:
    """Print the verdict in at most `SHOWN` lines, the diagnosed problems first; raise
    ExerciseFailed with a one-line message (the lines are above, and in `.problems`)."""
    if problems:
        seen, unique = set(), []
        for p in problems:
            if p not in seen:
                seen.add(p)
                unique.append(p)
        ordered = sorted(unique, key=_telling)
        shown = ordered if len(ordered) <= SHOWN else ordered[:SHOWN - 1]
        lines = "\n".join(f"  ✗ {p}" for p in shown)
        more = f"\n  … and {len(ordered) - len(shown)} more" if len(ordered) > len(shown) else ""
        print(f"{title}: {len(ordered)} problem(s)\n{lines}{more}")
        raise ExerciseFailed(f"{title}: {len(ordered)} problem(s), listed above", ordered)
    print(f"✓ {title}" + (f": all {passed} checks passed" if passed else ""))


def world_calls(ledger) -> list[str]:
    """On a rank whose world is split into groups: the picolib.comm collectives in `ledger`
    that ran on every rank of the world (group=None) rather than on a sub-group."""
    n = dist.get_world_size()
    return sorted({r.op for r in ledger.records if r.group_size == n and n > 1
                   and r.op not in ("send", "recv", "isend")})
