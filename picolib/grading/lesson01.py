"""Checks for lesson 01 (memory on one device): the parameter count of the tiny Llama, the
bytes of training state per parameter, the activation formula, gradient accumulation."""
from __future__ import annotations

import random

import torch

from ..memory import SavedActivations, activation_bytes, model_state_bytes
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


def check_param_count(fn) -> None:
    """`fn(cfg) -> int`: the number of parameters of TinyLlama(cfg), by formula."""
    problems, configs = [], list(_random_configs(6))
    for cfg in configs:
        counted = sum(p.numel() for p in TinyLlama(cfg).parameters())
        assert counted == param_count(cfg)
        got = call_student(fn, cfg)
        problems += compare(f"h={cfg.hidden} v={cfg.vocab_size} L={cfg.n_layers} "
                            f"heads={cfg.n_heads} kv_heads={cfg.n_kv_heads} ffn={cfg.ffn_hidden}",
                            got, counted)
    report("parameter count", problems, passed=len(configs))


def check_bytes_per_param(fn) -> None:
    """`fn(n_params, precision, fp32_grad_accum) -> bytes` of weights, gradients and Adam
    state (precision 'fp32' or 'bf16' mixed precision with fp32 master weights)."""
    problems, cases = [], 0
    for n in (1e9, 7e9, 70e9, 405e9):
        for precision, acc in (("fp32", False), ("bf16", False), ("bf16", True)):
            got = call_student(fn, n, precision, acc)
            expected = float(model_state_bytes(n, precision, acc))
            what = f"{n / 1e9:g}B params, {precision}" + (" + fp32 grad accumulation" if acc else "")
            problems += compare(what + " (bytes)", got, expected, atol=0.5, rtol=1e-9)
            cases += 1
    report("bytes of training state", problems, passed=cases)


def check_activation_bytes(fn) -> None:
    """`fn(L, s, b, h, a, flash=False) -> bytes`: activation memory in mixed precision."""
    rng, problems, cases = random.Random(2), [], 0
    for _ in range(8):
        L, s, b, a = rng.randint(1, 80), rng.choice([128, 2048, 8192]), rng.randint(1, 8), rng.choice([8, 32, 64])
        h = a * rng.choice([64, 128])
        for flash in (False, True):
            got = call_student(fn, L, s, b, h, a, flash=flash)
            problems += compare(f"L={L} s={s} b={b} h={h} a={a} flash={flash}",
                                got,
                                float(activation_bytes(L, s, b, h, a, flash)), atol=0.5, rtol=1e-9)
            cases += 1
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
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if p.grad is None:
                problems.append(f"k={k}: {name} has no gradient")
            else:  # fp32 sums in a different order: 1e-6 absolute
                problems += compare(f"k={k}: grad of {name}", p.grad, q.grad, atol=1e-6, rtol=1e-4)
        if act.peak >= big.peak:
            problems.append(f"k={k}: peak saved activations {act.peak} B, not below the full "
                            f"batch's {big.peak} B (run one micro-batch's backward before the next forward)")
    report("gradient accumulation", problems[:8] + ([f"... and {len(problems) - 8} more"]
                                                    if len(problems) > 8 else []))


__all__ = ["check_param_count", "check_bytes_per_param", "check_activation_bytes",
           "check_grad_accumulation", "ExerciseFailed"]
