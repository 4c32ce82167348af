"""Lesson 07b checks: each accepts right answers (two written differently) and rejects wrong
ones, each with its one-line diagnosis."""
import contextlib
import re

import pytest
import torch
import torch.nn.functional as F

from picolib.grading import (ExerciseFailed, check_backward_input, check_split_backward,
                             check_zb_h1_ops)
from picolib.pipeline_schedules import zb_h1


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


# --- the split backward: right answers ---------------------------------------------------------

def b_hooks(mlp, x, dy):
    """B as picolib's executor does it: hooks record each Linear's input and output gradient."""
    saved = []

    def record(linear, args, out):
        entry = [linear, args[0].detach(), None]
        saved.append(entry)
        out.register_hook(lambda g: entry.__setitem__(2, g))

    handles = [m.register_forward_hook(record) for m in (mlp.w_gate, mlp.w_up, mlp.w_down)]
    y = mlp(x)
    for h in handles:
        h.remove()
    dx, = torch.autograd.grad(y, x, dy)
    return dx, saved


def w_hooks(mlp, saved):
    grads = {id(lin.weight): g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]) for lin, x, g in saved}
    return [grads[id(w)] for w in mlp.parameters()]


def b_by_hand(mlp, x, dy):
    """B written out: the SwiGLU's backward for x only, three matmuls."""
    with torch.no_grad():
        a, b = x @ mlp.w_gate.weight.T, x @ mlp.w_up.weight.T
        h = F.silu(a) * b
        dh = dy @ mlp.w_down.weight
        sig = torch.sigmoid(a)
        da = dh * b * sig * (1 + a * (1 - sig))
        db = dh * F.silu(a)
        dx = da @ mlp.w_gate.weight + db @ mlp.w_up.weight
    return dx, (x.detach(), h, dy, da, db)


def w_by_hand(mlp, saved):
    x, h, dy, da, db = (t.reshape(-1, t.shape[-1]) for t in saved)
    return [da.T @ x, db.T @ x, dy.T @ h]


def test_right_answers_pass():
    check_backward_input(b_hooks)
    check_backward_input(b_by_hand)
    check_split_backward(b_hooks, w_hooks)
    check_split_backward(b_by_hand, w_by_hand)


# --- the split backward: wrong answers ----------------------------------------------------------

def b_full_backward(mlp, x, dy):          # B that runs the whole backward
    y = mlp(x)
    y.backward(dy)
    return x.grad, None


def b_grad_of_everything(mlp, x, dy):     # B that asks autograd for the weights' gradients too
    y = mlp(x)
    dx, *_ = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    return dx, None


def b_keeps_graph(mlp, x, dy):            # B right, but W will redo part of it
    y = mlp(x)
    dx, = torch.autograd.grad(y, x, dy, retain_graph=True)
    return dx, (y, dy)


def w_from_graph(mlp, saved):             # W by autograd on the kept graph: recomputes ∂ℒ/∂h
    y, dy = saved
    return list(torch.autograd.grad(y, list(mlp.parameters()), dy))


def test_b_that_computes_weight_gradients_fails():
    with fails(r"B left a gradient in w_gate.weight.grad, w_up.weight.grad, w_down.weight.grad — B computes ∂ℒ/∂x only"):
        check_backward_input(b_full_backward)
    with fails(r"B ran 9 matmuls where the forward and ∂ℒ/∂x need 6 — it computed weight gradients"):
        check_backward_input(b_grad_of_everything)


def test_b_with_a_wrong_input_gradient_fails():
    with fails(r"∂ℒ/∂x from B: .* elements wrong"):
        check_backward_input(lambda mlp, x, dy: (dy.clone(), None))     # forgets the layers
    with fails(r"must return \(dx, saved\)"):
        check_backward_input(lambda mlp, x, dy: b_hooks(mlp, x, dy)[0])


def test_w_that_redoes_b_fails():
    check_backward_input(b_keeps_graph)                                # B itself is right
    with fails(r"W ran 4 matmuls where gᵀx of the 3 Linears needs 3 — it redoes work B did"):
        check_split_backward(b_keeps_graph, w_from_graph)


def test_w_with_wrong_gradients_fails():
    with fails(r"∂ℒ/∂w_gate.weight is transposed"):
        check_split_backward(b_hooks, lambda mlp, saved: [g.T for g in w_hooks(mlp, saved)])
    with fails(r"the gradient in w_gate.weight.s place is ∂ℒ/∂w_up.weight — return them in mlp.parameters\(\) order"):
        check_split_backward(b_hooks, lambda mlp, saved: [w_hooks(mlp, saved)[i] for i in (1, 0, 2)])
    with fails(r"∂ℒ/∂w_down.weight from W: .* elements wrong"):              # only the first sequence
        check_split_backward(b_hooks, lambda mlp, saved: [g[0].T @ x[0] for _, x, g in
                                                          sorted(saved, key=lambda e: [mlp.w_gate, mlp.w_up, mlp.w_down].index(e[0]))])
    with fails(r"must return a list of 3 tensors"):
        check_split_backward(b_hooks, lambda mlp, saved: None)


def test_unwritten_exercises_fail():
    def todo(*args):
        raise NotImplementedError
    with fails(r"not written yet"):
        check_backward_input(todo)
    with fails(r"not written yet"):
        check_split_backward(b_hooks, todo)


# --- the ZB-H1 op list ----------------------------------------------------------------------

def zb_picolib(rank, p, m):
    return [(op.kind, op.mb) for op in zb_h1(p, m).ops[rank]]


def zb_by_phases(rank, p, m):
    """ZB-H1 written differently: the micro-batch of each op computed from its position."""
    ops, f = [], min(p - rank, m)
    ops += [("F", i) for i in range(f)]
    late = min(rank, m - f)
    for i in range(late):
        ops += [("B", i), ("F", f + i)]
    b, w = late, 0
    for mb in range(f + late, m):
        ops += [("B", b), ("W", w), ("F", mb)]
        b, w = b + 1, w + 1
    for mb in range(b, m):
        ops += [("B", mb), ("W", w)]
        w += 1
    return ops + [("W", i) for i in range(w, m)]


def test_zb_h1_right_answers_pass():
    check_zb_h1_ops(zb_picolib)
    check_zb_h1_ops(zb_by_phases)


def one_f_one_b_split(rank, p, m):             # 1F1B with B W back to back: no W deferred
    warm = min(p - 1 - rank, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i), ("W", i)]
    for i in range(m - warm, m):
        ops += [("B", i), ("W", i)]
    return ops


def test_zb_h1_wrong_answers_fail():
    with fails(r"rank 0, p=2, m=2: idles 2 on ideal devices at F=1, B=1, W=1, more than ZB-H1's \(p−1\)\(F\+B−W\) = 1"):
        check_zb_h1_ops(one_f_one_b_split)
    with fails(r"rank 0, p=2, m=3: 3 micro-batches alive at once \(F done, W not yet\); ZB-H1 keeps at most p = 2"):
        check_zb_h1_ops(lambda r, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
                        + [("W", i) for i in range(m)])                       # all forwards first
    with fails(r"rank 0, p=1, m=1: W0 missing"):
        check_zb_h1_ops(lambda r, p, m: [op for op in zb_picolib(r, p, m) if op != ("W", m - 1)])
    with fails(r"op kind 'BW' — ZB-H1 splits every backward into B and W"):
        check_zb_h1_ops(lambda r, p, m: [("F", i) for i in range(m)] + [("BW", i) for i in range(m)])
    with fails(r"the validator rejects your schedule: .*before its B"):   # W before its B
        check_zb_h1_ops(lambda r, p, m: [("F", i) for i in range(m)]
                        + [op for i in range(m) for op in (("W", i), ("B", i))])
    deadlock = {0: [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)],   # waits for B0 before sending F1
                1: [("F", 0), ("F", 1), ("B", 1), ("W", 1), ("B", 0), ("W", 0)]}   # waits for F1 before sending B0
    with fails(r"p=2, m=2: the validator rejects your schedule: .*deadlock"):
        check_zb_h1_ops(lambda r, p, m: deadlock[r] if (p, m) == (2, 2) else zb_picolib(r, p, m))
    with fails(r"expected a list of \(kind, mb\) pairs"):
        check_zb_h1_ops(lambda r, p, m: "F0 B0 W0")
    with fails(r"not written yet"):
        check_zb_h1_ops(lambda r, p, m: (_ for _ in ()).throw(NotImplementedError()))


def test_zb_h1_micro_batch_outside_the_range_fails():
    with fails(r"rank 0, p=1, m=1: F0 missing"):          # every micro-batch shifted by one
        check_zb_h1_ops(lambda r, p, m: [(k, mb + 1) for k, mb in zb_picolib(r, p, m)])
