"""Claims of lessons 01, 01b and 03 (issue 31), settled outside the notebooks as well.

Lesson 01: from the second step on, a training step's model state falls to 12Ψ (weights +
Adam) after zero_grad() and reaches 16Ψ when the last gradient lands; the total peaks at the
end of the forward. Lesson 01b: full recomputation's extra FLOPs are one forward less the LM
head and each block's last matmul (counted per module by FlopCounterMode).
Lesson 03: with m micro-batches under no_sync(), ZeRO-2 and -3 hold whole gradients until the
last backward, and ZeRO-3 sends (2m+1) ring passes per step — bytes counted on picolib's rings.
"""
from contextlib import nullcontext
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from picolib import comm
from picolib.comm import Ledger
from picolib.launch import run
from picolib.memory import MemoryTrace
from picolib.model import LlamaConfig, TinyLlama, param_count, random_tokens
from picolib.zero import ZeRO, padded_numel, unit_numels

SMALL = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                    ffn_hidden=23, max_seq=16)


def test_trace_floor_is_12n_and_peak_is_the_end_of_the_forward():
    cfg = LlamaConfig(hidden=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64)
    n = param_count(cfg)
    model = TinyLlama(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with MemoryTrace(model, opt) as trace:
        for step in range(3):
            model.loss(*random_tokens(2, 32, cfg.vocab_size, seed=step)).backward()
            opt.step()
            opt.zero_grad()
    s = trace.samples
    later = range([x.event for x in s].index("zero_grad") + 1, len(s))
    state = [x.params + x.grads + x.optimizer for x in s]
    assert min(state[i] for i in later) == 12 * n
    assert max(state[i] for i in later) == 16 * n
    top = max(later, key=lambda i: s[i].total)
    assert s[top].event == "forward" and s[top].grads == 0
    assert s[top].total == 12 * n + max(s[i].activations for i in later)


def test_full_recomputation_skips_the_head_and_each_blocks_last_matmul():
    cfg, b, s = LlamaConfig(hidden=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64), 2, 32
    x, y = random_tokens(b, s, cfg.vocab_size, seed=1)

    def count(c):
        with FlopCounterMode(display=False) as fc:
            loss = TinyLlama(c).loss(x, y)
            fwd = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
            loss.backward()
        return fwd, fc.get_total_flops()

    (fwd, plain), (_, full) = count(cfg), count(cfg.replace(recompute="full"))
    head = fwd["TinyLlama.lm_head"]
    last = sum(v for k, v in fwd.items() if k.endswith("mlp.w_down"))
    assert head > 0 and last > 0
    assert full - plain == fwd["Global"] - head - last
    assert full / plain < 4 / 3


def _replay(calls):
    n = dist.get_world_size()
    with Ledger() as led:
        for op, nbytes in calls:
            buf = torch.ones(nbytes // 4)
            if op == "reduce_scatter":
                comm.ring_reduce_scatter(buf)
            else:
                comm.ring_all_gather(buf[: buf.numel() // n])
    assert all(r.measured for r in led.records)
    return sum(r.sent_bytes for r in led.records)


def _accumulate(stage, m):
    model = TinyLlama(SMALL)
    zero = ZeRO(model, stage, optimizer="adam", lr=1e-3)
    x, y = random_tokens(2 * m, 8, SMALL.vocab_size, seed=dist.get_rank())
    held = []
    with Ledger() as led:
        for i in range(m):
            with zero.no_sync() if i < m - 1 else nullcontext():
                (model.loss(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) / m).backward()
            held.append(zero.memory()["grads"])
        zero.step()
    return held, _replay([(r.op, r.nbytes) for r in led.records])


def test_zero_under_gradient_accumulation_holds_whole_gradients_and_zero3_regathers():
    n, m = 2, 3
    units = unit_numels(TinyLlama(SMALL))
    psi, pad = sum(units), sum(padded_numel(u, n) for u in units)
    one_pass = Fraction(n - 1, n) * 4 * pad
    for stage in (2, 3):
        for held, sent in run(_accumulate, n, stage, m):
            assert held == [4 * psi + 4 * pad // n] * (m - 1) + [4 * pad // n], stage
            assert sent == (2 * m + 1 if stage == 3 else 2) * one_pass, stage


def test_gradient_accumulation_peak_holds_the_gradient_buffer():
    """Lesson 01 §4: with m > 1 micro-batches the gradients of the first are alive during
    the next forward, so the peak holds 16Ψ of model state (12Ψ without accumulation)."""
    cfg = LlamaConfig(hidden=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64)
    psi = param_count(cfg)
    x, y = random_tokens(4, 32, cfg.vocab_size, seed=3)
    tops = {}
    for k in (1, 2):
        model = TinyLlama(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with MemoryTrace(model, opt) as trace:
            for _ in range(2):
                for i in range(k):
                    mb = 4 // k
                    (model.loss(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / k).backward()
                opt.step()
                opt.zero_grad()
        later = trace.samples[[s.event for s in trace.samples].index("zero_grad") + 1:]
        tops[k] = max(later, key=lambda s: s.total)
    assert tops[1].grads == 0 and tops[1].params + tops[1].optimizer == 12 * psi
    assert tops[2].grads == 4 * psi and tops[2].event == "forward"
