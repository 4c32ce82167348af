"""Checks for lesson 01 (memory on one device): the parameter count of the tiny Llama, the
bytes of training state per parameter, the activation formula, gradient accumulation."""
from __future__ import annotations

import random

import torch

from ..memory import SavedActivations, activation_bytes, bytes_per_param, model_state_bytes
from ..model import LlamaConfig, TinyLlama, param_count, random_tokens
from ._core import ExerciseFailed, call_student, compare, compare_parameters, explain, report


def _random_configs(n: int, seed: int = 1):
    rng = random.Random(seed)
    for _ in range(n):
        heads = rng.choice([1, 2, 4, 8])
        kv = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
        yield LlamaConfig(vocab_size=rng.randint(17, 300), hidden=heads * rng.choice([4, 6, 8]),
                          n_layers=rng.randint(1, 3), n_heads=heads, n_kv_heads=kv,
                          ffn_hidden=rng.randint(5, 40))


def _param_terms(cfg) -> dict[str, int]:
    """Pieces a count commonly gets wrong, each with the number of parameters it is worth."""
    h, d, f, v, L = cfg.hidden, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size, cfg.n_layers
    return {
        "the output head (v·h) is missing: it is not tied to the embedding": -v * h,
        "the final norm (h) is missing": -h,
        "one norm per layer is missing: each block has two (2h per layer)": -L * h,
        "W_K and W_V counted with n_heads heads: grouped-query attention gives them n_kv_heads":
            2 * L * h * (cfg.n_heads - cfg.n_kv_heads) * d,
        "biases counted: the tiny Llama's linear layers have none":
            L * (cfg.n_heads * d + 2 * cfg.n_kv_heads * d + h + 2 * f + h),
        "the MLP counted with two matrices: SwiGLU has three (gate, up, down)": -L * h * f,
    }


def check_param_count(fn) -> None:
    """`fn(cfg) -> int`: the number of parameters of TinyLlama(cfg), by formula."""
    problems, configs, diffs = [], list(_random_configs(6)), []
    for cfg in configs:
        counted = sum(p.numel() for p in TinyLlama(cfg).parameters())
        assert counted == param_count(cfg)
        got = call_student(fn, cfg)
        line = compare(f"h={cfg.hidden} v={cfg.vocab_size} L={cfg.n_layers} heads={cfg.n_heads} "
                       f"kv_heads={cfg.n_kv_heads} ffn={cfg.ffn_hidden}", got, counted)
        if line:
            problems += line
            diffs.append((cfg, got, counted))
    if problems:
        try:
            hint = explain([name for name in _param_terms(configs[0]) if all(
                got - counted == _param_terms(cfg)[name] != 0 for cfg, got, counted in diffs)])
        except TypeError:
            hint = ""
        if hint:
            problems = [f"{hint} — {problems[0]}"]
        else:
            problems = [f"{len(problems)} of {len(configs)} configurations differ, e.g. "
                        f"{problems[0]}"]
    report("parameter count", problems, passed=len(configs))


def _same(a, b) -> bool:
    try:
        return abs(float(a) - float(b)) < 0.5
    except (TypeError, ValueError):
        return False


def check_bytes_per_param(fn) -> None:
    """`fn(n_params, precision, fp32_grad_accum) -> bytes` of weights, gradients and Adam
    state (precision 'fp32' or 'bf16' mixed precision with fp32 master weights)."""
    problems, cases, hints = [], 0, {}
    for precision, acc in (("fp32", False), ("bf16", False), ("bf16", True)):
        what = precision + (" + fp32 grad accumulation" if acc else "")
        parts = bytes_per_param(precision, acc)
        per, wrong = sum(parts.values()), None
        for n in (1e9, 7e9, 70e9, 405e9):
            cases += 1
            got = call_student(fn, n, precision, acc)
            if compare("", got, float(model_state_bytes(n, precision, acc)), atol=0.5, rtol=1e-9):
                wrong = (n, got)
                break
        if wrong is None:
            continue
        n, got = wrong
        try:
            got_per = float(got) / n
        except (TypeError, ValueError):
            problems.append(f"{what}: expected a number of bytes, got {got!r}")
            continue
        missing = {"the fp32 master weights (4)": parts.get("master", 0),
                   "the fp32 gradient accumulation buffer (4)": parts.get("fp32_grads", 0),
                   "Adam's two moments m and v (4 + 4)": parts["optimizer"],
                   "one of Adam's moments (4)": 4,
                   f"the weights ({parts['params']})": parts["params"],
                   f"the gradients ({parts['grads']})": parts["grads"]}
        extra = got_per - per
        if acc and abs(extra + 4) < 1e-9 and _same(call_student(fn, n, precision, False), got):
            hint = ("fp32_grad_accum=True changes nothing: it adds an fp32 buffer that "
                    "accumulates gradients (4 bytes)")
        elif abs(extra - 4) < 1e-9 and precision == "bf16" and not acc:
            hint = ("4 bytes too many: the fp32 gradient accumulation buffer counted although "
                    "fp32_grad_accum=False")
        elif abs(extra - 4) < 1e-9 and precision == "fp32":
            hint = ("a stray fp32 buffer: an fp32 model has no master copy" +
                    ("" if acc else " and no extra gradient buffer"))
        elif abs(extra + 4) < 1e-9 and precision == "bf16" and "fp32_grads" not in parts:
            hint = ("missing the fp32 master weights (4), or Adam's moments kept in bf16 "
                    "(2 + 2; they are fp32: 4 + 4)")
        elif (acc and hints.get(precision) and extra < 0
              and _same(float(got) - float(call_student(fn, n, precision, False)), 4 * n)):
            # the buffer's 4 bytes are added: what is missing is what was missing without it
            hint = f"{-extra:g} bytes short, as without accumulation: {hints[precision]}"
        else:
            hint = explain([f"missing {k}" for k, v in missing.items() if v and abs(-extra - v) < 1e-9])
        if not hint and abs(abs(extra) - 2) < 1e-9 and precision == "bf16":
            hint = ("bf16 weights and gradients are 2 bytes per value, the fp32 master and "
                    "Adam's moments 4")
        if not hint and abs(got_per * 2 - per) < 1e-9:
            hint = "half the expected bytes: a value counted as 2 bytes where fp32 takes 4?"
        hints[precision] = hints.get(precision) or hint
        problems.append(f"{what}: {got_per:g} bytes per parameter, expected {per}"
                        + (f" — {hint}" if hint else "") + f" (e.g. {n / 1e9:g}B params)")
    report("bytes of training state", problems, passed=cases)


def check_activation_bytes(fn) -> None:
    """`fn(L, s, b, h, a, flash=False) -> bytes`: activation memory in mixed precision."""
    rng, problems, cases, wrong = random.Random(2), [], 0, []
    variants = {
        "the per-layer constant is 34 (bytes per token and hidden unit), not 3/4":
            lambda L, s, b, h, a, fl: L * s * b * h * (0.75 + (0 if fl else 5 * a * s / h)),
        "with flash=True the s×s scores are never stored: drop the 5·a·s/h term":
            lambda L, s, b, h, a, fl: L * s * b * h * (34 + 5 * a * s / h),
        "the scores are s×s per head: the attention term grows with s², not s":
            lambda L, s, b, h, a, fl: L * s * b * h * (34 + (0 if fl else 5 * a / h)),
        "missing the factor L: every layer saves its own activations":
            lambda L, s, b, h, a, fl: s * b * h * (34 + (0 if fl else 5 * a * s / h)),
        "softmax output, dropout mask and dropout output per score: 2 + 1 + 2 = 5 bytes":
            lambda L, s, b, h, a, fl: L * s * b * h * (34 + (0 if fl else 2 * a * s / h)),
    }
    for _ in range(8):
        L, s, b, a = rng.randint(1, 80), rng.choice([128, 2048, 8192]), rng.randint(1, 8), rng.choice([8, 32, 64])
        h = a * rng.choice([64, 128])
        for flash in (False, True):
            got = call_student(fn, L, s, b, h, a, flash=flash)
            line = compare(f"L={L} s={s} b={b} h={h} a={a} flash={flash}", got,
                           float(activation_bytes(L, s, b, h, a, flash)), atol=0.5, rtol=1e-9)
            if line:
                problems += line
                wrong.append(((L, s, b, h, a, flash), got))
            cases += 1
    if problems:
        def fits(rule):
            try:
                return all(abs(float(got) - rule(*args)) <= 1e-6 * abs(rule(*args)) + 0.5
                           for args, got in wrong)
            except (TypeError, ValueError):
                return False
        hint = explain([k for k, rule in variants.items() if fits(rule)]) or _constants_hint(wrong, fn)
        problems = [(f"{hint} — " if hint else f"{len(problems)} of {cases} cases differ, e.g. ")
                    + problems[0]]
    report("activation bytes", problems, passed=cases)


# what one layer's forward saves, as the statement lists it: (the tensor, bytes per sbh) for c₁,
# (the tensor, bytes per a·s·s·b) for c₂; activations are 2 bytes per value, masks 1
_C1_TERMS = [("the QKV projection's input", 2), ("Q", 2), ("K", 2), ("V", 2),
             ("the output projection's input", 2), ("the attention output's dropout mask", 1),
             ("the first MLP linear's input", 2), ("the GeLU's input", 8),
             ("the second MLP linear's input", 8), ("the MLP's dropout mask", 1),
             ("the first LayerNorm's input", 2), ("the second LayerNorm's input", 2)]
_C2_TERMS = [("the softmax output", 2), ("the scores' dropout mask", 1), ("the dropout output", 2)]


def _term_slips(terms) -> dict[float, list[str]]:
    """Each value of the constant one slip in counting `terms` gives, with every slip that
    gives it: a tensor left out, a mask at 2 bytes, an activation at 4, all values at 4 bytes,
    values counted instead of bytes (tensors that give the same value named together)."""
    right, masks = sum(b for _, b in terms), sum(b == 1 for _, b in terms)
    grouped = {}
    for name, b in terms:
        grouped.setdefault((right - b, "left out"), []).append(name)
        grouped.setdefault((right + b, "at 4 bytes per value (activations are 2 in mixed "
                            "precision)") if b > 1 else (right + 1, "at 2 bytes per value (a mask "
                                                         "is 1)"), []).append(name)
    out = {}
    for (value, how), names in grouped.items():
        who = names[0] if len(names) == 1 else f"one of {', '.join(names[:-1])} or {names[-1]}"
        out.setdefault(value, []).append(f"{who} {how}")
    if masks > 1:
        out.setdefault(right - masks, []).append("both dropout masks left out")
    out.setdefault(2 * right - masks, []).append("the activations at 4 bytes (fp32), not 2")
    out.setdefault(2 * right + 2 * masks, []).append("every value at 4 bytes, masks too")
    out.setdefault((right + masks) / 2, []).append("values counted, not bytes")
    return out


def _constants_hint(wrong, fn) -> str | None:
    """Fit the student's answers to L·s·b·h·(c₁ + c₂·a·s/h) and, when one pair fits every case,
    name the constants and each slip in the statement's list that gives them (all of them
    when several do: a constant alone cannot tell which tensor was miscounted)."""
    try:
        c1s, c2s = set(), set()
        for (L, s, b, h, a, flash), _ in wrong + [((2, 128, 1, 512, 8, True), None)]:
            per = float(call_student(fn, L, s, b, h, a, flash=True)) / (L * s * b * h)
            full = float(call_student(fn, L, s, b, h, a, flash=False)) / (L * s * b * h)
            c1s.add(round(per, 6))
            c2s.add(round((full - per) * h / (a * s), 6))
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    if len(c1s) != 1 or len(c2s) != 1:
        return None
    c1, c2 = c1s.pop(), c2s.pop()
    why = []
    for c, right, terms, which in ((c1, 34, _C1_TERMS, "c₁"), (c2, 5, _C2_TERMS, "c₂")):
        slips = _term_slips(terms).get(c, []) if c != right else []
        if len(slips) == 1:
            why.append(f"{which}: {slips[0]}")
        elif slips:
            why.append(f"{which} fits each of: " + "; or ".join(slips))
    return (f"your answers are L·s·b·h·(c₁ + c₂·a·s/h) with c₁ = {c1:g}, c₂ = {c2:g}; expected "
            f"34 and 5" + "".join(f"; {w}" for w in why))


def _rows(batch, full) -> list[int]:
    """The index in `full` of each row of `batch` (-1 for a row that is none of them)."""
    out = []
    for row in batch:
        out.append(next((i for i in range(len(full)) if row.shape == full[i].shape
                         and torch.equal(row, full[i])), -1))
    return out


def _micro_batches(model, x, y):
    """Record, for every forward of `model`, which samples of x it ran on, and for every
    loss, which samples of y were its targets."""
    seen, targets = [], []
    hooks = [model.register_forward_pre_hook(
                 lambda mod, args: seen.append(_rows(args[0], x)) if args else None),
             model.loss_fn.register_forward_pre_hook(
                 lambda mod, args: targets.append(_rows(args[1], y)) if len(args) > 1 else None)]
    return seen, targets, hooks


def _slicing_problem(k, m, seen, targets, n) -> str:
    """One line on micro-batches that are not k slices of m samples covering the batch once."""
    counts = [0] * n
    for call in seen:
        for i in call:
            if i >= 0:
                counts[i] += 1
    twice = [i for i, c in enumerate(counts) if c > 1]
    never = [i for i, c in enumerate(counts) if c == 0]
    sizes = [len(c) for c in seen]
    if twice or never:
        return (f"k={k}: micro-batches {[sorted(c) for c in seen]} of the batch's samples 0…{n - 1}: "
                + (f"samples {twice} are in more than one" if twice else "")
                + (" and " if twice and never else "")
                + (f"samples {never} are in none" if never else "")
                + f" — micro-batch i is tokens[i·m:(i+1)·m] with m = len(tokens)//k = {m}")
    if len(seen) != k:
        return (f"k={k}: {len(seen)} forward pass(es) of sizes {sizes}, expected k = {k} "
                f"micro-batches of {m} sequences")
    if targets and len(targets) == len(seen) and any(sorted(t) != sorted(c) for t, c in zip(targets, seen)):
        j = next(j for j, (t, c) in enumerate(zip(targets, seen)) if sorted(t) != sorted(c))
        return (f"k={k}: micro-batch {j} has the tokens of samples {seen[j]} but the targets of "
                f"samples {targets[j]}: slice tokens and targets the same way")
    return ""


def _divisor_problem(k, m, n, got, want, last) -> tuple[str, float | None]:
    """Name a gradient that is the right one times a factor (the loss divided by the wrong
    number) or only the last micro-batch's; also return the divisor d when one fits."""
    if torch.allclose(got, last, atol=1e-6, rtol=1e-4) or torch.allclose(got, last / k, atol=1e-6, rtol=1e-4):
        return (f"k={k}: .grad holds only the last micro-batch's gradient — zero_grad() (or a "
                ".grad reset) inside the loop wipes the others: let backward() add them up"), None
    r = (got @ want / (want @ want)).item()
    if not (r > 0 and torch.allclose(got, r * want, atol=1e-6, rtol=1e-4)):
        return "", None
    d = k / r
    named = [(1, f"the micro-batch losses are summed, not averaged: divide each by k = {k}"),
             (m, f"each micro-batch's loss divided by its size m = {m}, not by the number of "
                 f"micro-batches k = {k} (model.loss is already a mean over its sequences)"),
             (n, f"each micro-batch's loss divided by the batch size {n}, not by k = {k} "
                 "(model.loss is already a mean over its sequences)"),
             (k * k, f"divided by k twice (k² = {k * k}): divide each micro-batch's loss by k once")]
    # m = k² at k = 2: both named; at m = 1 dividing by m is summing, the first slip
    why = explain([w for i, (v, w) in enumerate(named) if abs(d - v) < 1e-3 * v and v != k
                   and not (i == 1 and m == 1)])
    return (f"k={k}: every gradient is {r:.4g}× the right one — " + why if why else ""), d


def check_grad_accumulation(fn) -> None:
    """`fn(model, tokens, targets, k)`: leave in `.grad` the gradient of the mean loss over
    the whole batch, computed in k micro-batches of len(tokens)//k sequences each. Runs
    k = 2, 4 and 8 on a batch of 8, recording which samples every forward ran on."""
    cfg = LlamaConfig(n_layers=2)
    n = 8
    x, y = random_tokens(n, 32, cfg.vocab_size, seed=3)
    ref = TinyLlama(cfg)
    with SavedActivations(ref) as big:
        loss = ref.loss(x, y)
    loss.backward()
    want = torch.cat([q.grad.flatten() for q in ref.parameters()])
    problems, divisors = [], {}
    for k in (2, 4, 8):
        m = n // k
        last_model = TinyLlama(cfg)
        last_model.loss(x[n - m:], y[n - m:]).backward()
        last = torch.cat([q.grad.flatten() for q in last_model.parameters()])
        model = TinyLlama(cfg)
        seen, targets, hooks = _micro_batches(model, x, y)
        raised = None
        try:
            with SavedActivations(model) as act:
                call_student(fn, model, x, y, k)
        except ExerciseFailed:
            raise
        except Exception as e:   # e.g. an empty slice: say what the micro-batches were
            raised = f"k={k}: your function raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        finally:
            for hk in hooks:
                hk.remove()
        slicing = _slicing_problem(k, m, seen, targets, n) if seen else ""
        if raised:
            problems.append(slicing or raised)
            continue
        missing = [name for name, p in model.named_parameters() if p.grad is None]
        if slicing:
            problems.append(slicing)
        elif missing:
            problems.append(f"k={k}: {len(missing)} parameters have no gradient (e.g. {missing[0]}): "
                            "call backward() on each micro-batch's loss")
        else:   # all gradients as one vector (fp32 sums in a different order: 1e-6 absolute)
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            line = compare_parameters(f"k={k}: the gradients", got, want, model, atol=1e-6, rtol=1e-4)
            divisors[k] = None if line else k
            if line:
                why, divisors[k] = _divisor_problem(k, m, n, got.double(), want.double(), last.double())
                problems += [why] if why else line
        if act.peak >= big.peak and not slicing:
            problems.append(f"k={k}: peak saved activations {act.peak} B, not below the full "
                            f"batch's {big.peak} B (run one micro-batch's backward before the next forward)")
    ds = [d for d in divisors.values() if d is not None]
    if len(ds) == 3 and max(ds) - min(ds) < 1e-3 * max(ds) and min(abs(ds[0] - 1), abs(ds[0] - n)) > 1e-3:
        problems.insert(0, f"each micro-batch's loss is divided by {ds[0]:.4g} whatever k is "
                        "(k = 2, 4, 8): is k hard-coded? divide by the argument k")
        problems = [p for p in problems if "every gradient is" not in p and "values wrong" not in p]
    report("gradient accumulation", problems)


__all__ = ["check_param_count", "check_bytes_per_param", "check_activation_bytes",
           "check_grad_accumulation", "ExerciseFailed"]
