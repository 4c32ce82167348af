"""Lesson 11's try-it: the calculator's bytes equal a TinyLlama's measured in one process
(parameters, gradients, Adam state after a step; saved activations), and every knob
combination of the lesson's cell runs."""
import itertools

import matplotlib
import pytest
import torch

from picolib.memory import SavedActivations, grad_bytes, optimizer_state_bytes, param_bytes
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.planner import Parallelism, memory
from picolib.tryit.lesson11 import MODELS, plan_calculator

matplotlib.use("Agg")

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def test_calculator_bytes_equal_a_measured_step():
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    opt = torch.optim.Adam(model.parameters())
    x, y = random_tokens(2, 16, CFG.vocab_size)
    with SavedActivations(model) as act:
        loss = model.loss(x, y)
    loss.backward()
    opt.step()
    out = plan_calculator(CFG, n_gpus=1, tp=1, pp=1, zero=0, seq=16, micro_batch_size=2,
                          global_batch=2, plot=False)
    plan = out["ranks"][0]
    assert (plan["params"], plan["grads"], plan["optimizer"]) == (
        param_bytes(model) // 2, grad_bytes(model) // 2, optimizer_state_bytes(opt) * 12 // 8)
    exact = memory(CFG, Parallelism(seq=16, micro_batch_size=2, precision="fp32",
                                    activations="picolib", flash=False))
    assert exact["activations"] == act.bytes
    assert (exact["params"], exact["grads"], exact["optimizer"]) == (
        param_bytes(model), grad_bytes(model), optimizer_state_bytes(opt))


def test_every_knob_combination_runs(monkeypatch, capsys):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)
    fits = set()
    for model, tp, pp, zero, rec in itertools.product(MODELS, [8, 4], [1, 4, 16], [1, 0, 3],
                                                      ["none", "full"]):
        if zero == 3 and pp > 1:
            with pytest.raises(ValueError, match="ZeRO-3 with pp > 1"):
                plan_calculator(model, 1024, tp, pp, zero, rec, global_batch=1024)
            continue
        out = plan_calculator(model, 1024, tp, pp, zero, rec, global_batch=1024)
        assert 0 < out["time"]["mfu"] < 1 and len(out["ranks"]) == pp
        fits.add(out["fits"])
        plt.close("all")
    assert fits == {True, False}        # the knobs reach both sides of the 80 GB line
    assert "does NOT fit" in capsys.readouterr().out
    with pytest.raises(ValueError, match="must divide n_gpus = 640"):
        plan_calculator("Llama-3-70B", 640, 8, 3)
