"""Lessons 11 and 11b's try-its. Lesson 11's `rooflines`: every setting its hint suggests
shows what the hint says, the numbers are picolib.hardware's, and the figure passes the
checker. Lesson 11b's: the calculator's bytes equal a TinyLlama's measured in one process
(parameters, gradients, Adam state after a step; saved activations), and every knob
combination of the lesson's cell runs, and every setting the lesson's hint suggests shows what
the hint says."""
import itertools

import matplotlib
import pytest
import torch

from picolib.memory import SavedActivations, grad_bytes, optimizer_state_bytes, param_bytes
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.planner import Parallelism, memory
from picolib.tryit.lesson11 import (HINTS, MODELS, ROOFLINE_HINTS, measured_block_bytes,
                                    plan_calculator, rooflines)

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
            with pytest.raises(ValueError, match="ZeRO-3 × pipeline parallelism is not supported"):
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


def test_every_hint_runs_and_shows_what_it_says():
    """The hint: 405B on 1,024 GPUs, tp 8 — pp 4 does not fit, pp 8 and 16 do (each halving
    the parameters and gradients), micro-batch size 2 doubles 1F1B's in-flight activations
    past 80 GB, full recomputation fits again at a lower MFU."""
    out = [plan_calculator(plot=False, **settings) for settings, _ in HINTS]
    worst = [max(r["total"] for r in o["ranks"]) for o in out]
    acts = [max(r["activations"] for r in o["ranks"]) for o in out]
    assert [o["fits"] for o in out] == [False, True, True, False, True]
    assert [round(w / 1e9) for w in worst[:3]] == [103, 76, 64]
    for a, b in ((out[0], out[1]), (out[1], out[2])):
        assert b["ranks"][0]["params"] / a["ranks"][0]["params"] == pytest.approx(0.5, rel=0.03)
    assert acts[3] / acts[2] == pytest.approx(2, rel=1e-3)
    assert out[4]["time"]["mfu"] < out[3]["time"]["mfu"] < out[2]["time"]["mfu"]
    for (settings, says), o, w in zip(HINTS, out, worst):
        assert ("does not fit" in says) == (not o["fits"])
        if "about" in says:
            assert f"about {round(w / 1e9)} GB" in says


@pytest.mark.parametrize("cfg, c", [(MODELS["Llama-3-70B"], 48), (MODELS["Llama-3-405B"], 46)])
def test_llama_block_saves_more_than_34_sh(cfg, c):
    """Measured on a block with the model's proportions, and the planner's count at full size:
    2·(10 + 4F/h)·s·h bytes (SwiGLU, GQA K/V after the repeat), not GPT's 34·s·h."""
    par = Parallelism(seq=4096, activations="picolib", recompute="selective")
    from picolib.planner import layer_activation_bytes
    full = layer_activation_bytes(cfg, par) / (4096 * cfg.hidden)
    assert full == pytest.approx(c, abs=0.01)
    assert measured_block_bytes(cfg) == pytest.approx(full, abs=0.1)


def test_every_roofline_hint_shows_what_it_says(capsys):
    """Lesson 11's hint: H100 at 1,024 GPUs (DP 1,236, MoE 4,945 at EP 64); EP 8 needs 8x the
    tokens; GB200 NVL72 lifts DP to 1,389 and caps TP at 6; F = 8,192 caps TP at 4."""
    out = [rooflines(plot=False, **settings) for settings, _ in ROOFLINE_HINTS]
    moe = [v for o in out for k, v in o["tokens"].items() if k.startswith("MoE")]
    dp = [o["tokens"]["DP, 1,024 GPUs"] for o in out]
    assert [round(d) for d in dp] == [1236, 1236, 1389, 1236]
    assert round(moe[0]) == 4945 and moe[1] / moe[0] == pytest.approx(8)
    assert [o["tp"] for o in out] == [8, 8, 6, 4]
    for (settings, says), o in zip(ROOFLINE_HINTS, out):
        numbers = {f"{round(v):,}" for v in o["tokens"].values()}
        quoted = [part.split()[0].rstrip(",;") for part in says.split("about ")[1:]]
        assert all(q in numbers for q in quoted), (quoted, numbers, says)
        assert quoted or "-way" in says, says
        if "-way" in says:
            assert f"{o['tp']}-way" in says
    assert "tokens per GPU" in capsys.readouterr().out


def test_rooflines_figure_passes_the_checker():
    import matplotlib.pyplot as plt

    from picolib.figure_check import problems
    fig, ax = plt.subplots(figsize=(8, 3))
    rooflines("GB200-NVL72", ep=8, ax=ax)
    assert len(ax.patches) == 4 and ax.get_xscale() == "log"
    assert problems(fig) == []
    plt.close(fig)
    with pytest.raises(ValueError, match="must divide n_gpus"):
        rooflines(n_gpus=1000, ep=64, plot=False)


def test_tokens_through_a_stage_copy_counts_each_schedules_forwards():
    """1F1B sends every micro-batch through each stage once; DualPipe holds each stage twice and
    sends half the micro-batches through each copy."""
    from picolib.tryit.lesson11 import tokens_through_a_stage_copy
    assert tokens_through_a_stage_copy("1f1b", 4, 8, 10) == 8 * 10
    assert tokens_through_a_stage_copy("dualpipe", 4, 8, 10) == 4 * 10


def test_price_table4_brackets_each_run():
    """Interleaving shrinks the bubble, and counting the whole s×s square gives more FLOPs a token
    than the causal half, which gives more than 6 × parameters."""
    from picolib.tryit.lesson11 import TABLE4, price_table4
    priced = price_table4()
    assert priced.keys() == TABLE4.keys()
    for published, per_gpu in priced.values():
        assert published in {430, 400, 380} and per_gpu[1]["causal"] < per_gpu[2]["causal"]
        for v in (1, 2):
            assert per_gpu[v]["dense"] < per_gpu[v]["causal"] < per_gpu[v]["square"]
