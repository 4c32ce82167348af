"""Checks for lesson 07b (zero bubble and DualPipe).

- `check_backward_input(backward_input)`: B alone (below).
- `check_split_backward(backward_input, backward_weight)`: the split backward of a SwiGLU
  MLP (`picolib.model.SwiGLU`: w_gate, w_up, w_down). `backward_input(mlp, x, dy)` → (dx,
  saved) is B: it runs the forward and returns ∂ℒ/∂x for ℒ = Σ mlp(x)·dy, computing no weight
  gradient; `backward_weight(mlp, saved)` → [∂ℒ/∂W for each weight, in `mlp.parameters()`
  order] is W: one matmul per weight from what B kept, without redoing B's work. Together
  they must equal one full backward. Matmuls are counted as they run (aten mm/bmm/addmm).
- `check_zb_h1_ops(fn)`: `fn(rank, p, m)` → rank's ZB-H1 op list [("F"|"B"|"W", mb), ...]:
  every F, B and W once, a schedule the validator accepts (dependencies, no deadlock), at most
  p micro-batches alive on a rank (F done, W not yet), and for m ≥ p each rank idling at most
  (p−1)(F+B−W) on ideal devices (W ≤ B).
"""
from __future__ import annotations

import copy
import itertools

import torch
from ..torch_compat import TorchDispatchMode

from ..model import LlamaConfig, SwiGLU
from ..pipeline_schedules import Op, Schedule
from ..pipeline_simulator import ScheduleError, simulate, validate
from ._core import call_student, compare, report

__all__ = ["check_backward_input", "check_split_backward", "check_zb_h1_ops"]

_MATMULS = ("mm", "bmm", "addmm", "baddbmm")


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products that run (forward and backward kernels alike)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _MATMULS:
            self.n += 1
        return func(*args, **(kwargs or {}))


# (hidden, ffn_hidden, b, s, seed): uneven sizes, none a multiple of another
_MLPS = [(24, 40, 3, 5, 1), (16, 56, 2, 7, 2), (8, 12, 1, 3, 3)]


def _case(hidden, ffn, b, s, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden=hidden, n_layers=1, n_heads=1, n_kv_heads=1, ffn_hidden=ffn, max_seq=s)
    mlp = SwiGLU(cfg)
    x, dy = torch.randn(b, s, hidden), torch.randn(b, s, hidden)
    ref = copy.deepcopy(mlp)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    return mlp, x, dy, xr.grad, [p.grad for p in ref.parameters()]


def _run_b(backward_input, case, problems):
    """B on one case: `saved` for W, or None after noting what is wrong."""
    hidden, ffn, b, s, seed = case
    where = f"hidden={hidden}, ffn={ffn}, x of shape ({b}, {s}, {hidden})"
    mlp, x0, dy, dx_ref, dw_ref = _case(*case)
    n_linear = len(dw_ref)
    x = x0.clone().requires_grad_()
    with _CountMatmuls() as count:
        out = call_student(backward_input, mlp, x, dy.clone())
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        problems.append(f"{where}: backward_input must return (dx, saved), got {type(out).__name__}")
        return None
    dx, saved = out
    wrong = compare(f"{where}: ∂ℒ/∂x from B", dx, dx_ref, atol=1e-5)
    touched = [n for n, p in mlp.named_parameters() if p.grad is not None]
    if touched:
        wrong.append(f"{where}: B left a gradient in {', '.join(f'{n}.grad' for n in touched)} — "
                     "B computes ∂ℒ/∂x only; the weight gradients are W's")
    elif count.n > 2 * n_linear:
        wrong.append(f"{where}: B ran {count.n} matmuls where the forward and ∂ℒ/∂x need "
                     f"{2 * n_linear} — it computed weight gradients too")
    problems += wrong
    return None if wrong else (where, mlp, saved, dw_ref)


def check_backward_input(backward_input) -> None:
    """B of a SwiGLU MLP on three uneven sizes: ∂ℒ/∂x equal to one full backward's, and no
    weight gradient computed (at most the forward's 3 matmuls and ∂ℒ/∂x's 3)."""
    problems = []
    for case in _MLPS:
        _run_b(backward_input, case, problems)
    report("B: the input gradient alone", problems, len(_MLPS))


def check_split_backward(backward_input, backward_weight) -> None:
    """B, then W, of a SwiGLU MLP against one full backward, on three uneven sizes; W may run
    one matmul per weight (3)."""
    problems, checks = [], 0
    for case in _MLPS:
        checks += 1
        got_b = _run_b(backward_input, case, problems)
        if got_b is None:
            continue
        where, mlp, saved, dw_ref = got_b
        names = [n for n, _ in mlp.named_parameters()]
        n_linear = len(names)
        with _CountMatmuls() as count:
            dws = call_student(backward_weight, mlp, saved)
        if not (isinstance(dws, (list, tuple)) and len(dws) == n_linear
                and all(isinstance(g, torch.Tensor) for g in dws)):
            problems.append(f"{where}: backward_weight must return a list of {n_linear} tensors "
                            f"(∂ℒ/∂W of {', '.join(names)}), got {dws!r:.80}")
            continue
        for name, got, want in zip(names, dws, dw_ref):
            if tuple(got.shape) == tuple(want.shape[::-1]) and torch.allclose(got.T, want, atol=1e-5):
                problems.append(f"{where}: ∂ℒ/∂{name} is transposed — a weight's gradient has the "
                                f"weight's shape {tuple(want.shape)}: gᵀx, not xᵀg")
                continue
            other = [n for n, w in zip(names, dw_ref) if n != name and w.shape == got.shape
                     and torch.allclose(got, w, atol=1e-5)]
            if other:
                problems.append(f"{where}: the gradient in {name}'s place is ∂ℒ/∂{other[0]} — return "
                                f"them in mlp.parameters() order ({', '.join(names)})")
                continue
            problems += compare(f"{where}: ∂ℒ/∂{name} from W", got, want, atol=1e-5)
        if count.n > n_linear:
            problems.append(f"{where}: W ran {count.n} matmuls where gᵀx of the {n_linear} Linears "
                            f"needs {n_linear} — it redoes work B did (keep each Linear's input "
                            "and output gradient in `saved`)")
    report("split backward (B, then W)", problems, checks)


def _grid():
    for p in range(1, 6):
        for m in sorted({1, 2, p, p + 1, 2 * p + 3}):
            yield p, m


def _alive(row) -> int:
    return max(itertools.accumulate((k == "F") - (k == "W") for k, _ in row), default=0)


def _rows(fn, p, m, problems):
    """The student's lists for every rank as [(kind, mb)], or None after noting why not."""
    rows = []
    for r in range(p):
        got = call_student(fn, r, p, m)
        try:
            row = [(str(k), int(mb)) for k, mb in got]
        except (TypeError, ValueError):
            problems.append(f"rank {r}, p={p}, m={m}: expected a list of (kind, mb) pairs, got {got!r:.80}")
            return None
        rows.append(row)
    return rows


def _complete(row, r, p, m) -> str | None:
    kinds = {k for k, _ in row} - {"F", "B", "W"}
    if kinds:
        return (f"rank {r}, p={p}, m={m}: op kind {sorted(kinds)[0]!r} — ZB-H1 splits every "
                "backward into B and W, so its ops are F, B and W")
    for kind in ("F", "B", "W"):
        for mb in range(m):
            n = row.count((kind, mb))
            if n != 1:
                return f"rank {r}, p={p}, m={m}: {kind}{mb} " + ("missing" if n == 0 else f"{n} times")
    extra = [f"{k}{mb}" for k, mb in row if not 0 <= mb < m]
    if extra:
        return f"rank {r}, p={p}, m={m}: {extra[0]} names a micro-batch outside 0..{m - 1}"
    return None


def check_zb_h1_ops(fn) -> None:
    """On p = 1..5 ranks and m from 1 to 2p+3 micro-batches (m < p, m = p, uneven m): every
    op once, a valid schedule, at most p micro-batches alive, and for m ≥ p ZB-H1's idle time
    per rank at F = B = W and at two unequal costs with W ≤ B."""
    problems, checks = [], 0
    costs = ({"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 1.5, "W": 0.5}, {"F": 1.3, "B": 1.0, "W": 0.7})
    for p, m in _grid():
        rows = _rows(fn, p, m, problems)
        checks += 1
        if rows is None:
            break
        wrong = [w for r, row in enumerate(rows) if (w := _complete(row, r, p, m))]
        if wrong:
            problems.append(wrong[0])
            continue
        sched = Schedule("student", m, tuple(range(p)), [[Op(k, r, mb) for k, mb in row]
                                                          for r, row in enumerate(rows)])
        try:
            validate(sched)
        except ScheduleError as e:
            problems.append(f"p={p}, m={m}: the validator rejects your schedule: {e}")
            continue
        alive = [_alive(row) for row in rows]
        heavy = [r for r, a in enumerate(alive) if a > p]
        if heavy:
            r = heavy[0]
            problems.append(f"rank {r}, p={p}, m={m}: {alive[r]} micro-batches alive at once (F done, "
                            f"W not yet); ZB-H1 keeps at most p = {p}")
            continue
        if m < p:
            continue
        for cost in costs:
            F, B, W = cost["F"], cost["B"], cost["W"]
            bound = (p - 1) * (F + B - W)
            events = simulate(sched, cost, check=False)
            end = max(e["end"] for e in events)
            idle = [end - sum(e["end"] - e["start"] for e in events if e["rank"] == r) for r in range(p)]
            worst = max(range(p), key=lambda r: idle[r])
            if idle[worst] > bound + 1e-9:
                problems.append(f"rank {worst}, p={p}, m={m}: idles {idle[worst]:.3g} on ideal devices at "
                                f"F={F:g}, B={B:g}, W={W:g}, more than ZB-H1's (p−1)(F+B−W) = {bound:.3g}")
                break
        if len(problems) > 6:
            break
    report("ZB-H1 op lists", problems, checks)
