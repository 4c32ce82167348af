"""Checks for lesson 01 (memory on one device): the parameter count of the tiny Llama, the
bytes of training state per parameter, the activation formula, gradient accumulation."""
from __future__ import annotations

import random

import torch

from ..memory import SavedActivations, activation_bytes, bytes_per_param, model_state_bytes
from ..model import LlamaConfig, TinyLlama, param_count, random_tokens
from ._core import ExerciseFailed, call_student, compare, report


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
        for name in _param_terms(configs[0]):
            try:
                if all(got - counted == _param_terms(cfg)[name] != 0 for cfg, got, counted in diffs):
                    problems = [f"{name} — {problems[0]}"]
                    break
            except TypeError:
                break
        else:
            problems = [f"{len(problems)} of {len(configs)} configurations differ, e.g. "
                        f"{problems[0]}"]
    report("parameter count", problems, passed=len(configs))


def check_bytes_per_param(fn) -> None:
    """`fn(n_params, precision, fp32_grad_accum) -> bytes` of weights, gradients and Adam
    state (precision 'fp32' or 'bf16' mixed precision with fp32 master weights)."""
    problems, cases = [], 0
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
        missing = {"fp32 master weights (4)": parts.get("master", 0),
                   "fp32 gradient accumulation buffer (4)": parts.get("fp32_grads", 0),
                   "Adam's two moments m and v (4 + 4)": parts["optimizer"],
                   "one of Adam's moments (4)": 4}
        hint = next((f"missing the {k}" for k, v in missing.items() if v and abs(per - got_per - v) < 1e-9),
                    "a stray fp32 buffer: an fp32 model has no master copy and no extra gradient "
                    "buffer" if abs(got_per - per - 4) < 1e-9 else
                    "bf16 is 2 bytes per value, fp32 4" if abs(got_per - per) in (2, 4) else "")
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
        hint = next((k for k, rule in variants.items() if fits(rule)), None)
        problems = [(f"{hint} — " if hint else f"{len(problems)} of {cases} cases differ, e.g. ")
                    + problems[0]]
    report("activation bytes", problems, passed=cases)


def check_grad_accumulation(fn) -> None:
    """`fn(model, tokens, targets, k)`: leave in `.grad` the gradient of the mean loss over
    the whole batch, computed in k micro-batches of len(tokens)//k sequences each."""
    cfg = LlamaConfig(n_layers=2)
    x, y = random_tokens(8, 32, cfg.vocab_size, seed=3)
    ref = TinyLlama(cfg)
    with SavedActivations(ref) as big:
        loss = ref.loss(x, y)
    loss.backward()
    problems = []
    for k in (2, 4):
        model = TinyLlama(cfg)
        with SavedActivations(model) as act:
            call_student(fn, model, x, y, k)
        missing = [name for name, p in model.named_parameters() if p.grad is None]
        if missing:
            problems.append(f"k={k}: {len(missing)} parameters have no gradient (e.g. {missing[0]}): "
                            "call backward() on each micro-batch's loss")
        else:   # all gradients as one vector: one line names a uniform factor (fp32 sums in
            # a different order: 1e-6 absolute)
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            want = torch.cat([q.grad.flatten() for q in ref.parameters()])
            problems += compare(f"k={k}: the gradients", got, want, atol=1e-6, rtol=1e-4)
        if act.peak >= big.peak:
            problems.append(f"k={k}: peak saved activations {act.peak} B, not below the full "
                            f"batch's {big.peak} B (run one micro-batch's backward before the next forward)")
    report("gradient accumulation", problems)


__all__ = ["check_param_count", "check_bytes_per_param", "check_activation_bytes",
           "check_grad_accumulation", "ExerciseFailed"]
