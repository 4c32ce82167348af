"""Lesson 10's try-it: the state bytes it shows equal the trainer's measured `state_bytes`
(4 real ranks: DDP and ZeRO-1/2/3 with TP, SP and PP), its activations equal a forward
measured in one process, its verdict follows a budget set from those measurements, and every
knob combination of the lesson's cell runs (or is refused with the trainer's error)."""
import itertools

import matplotlib
import pytest

from picolib.launch import run
from picolib.memory import SavedActivations
from picolib.model import TinyLlama, random_tokens
from picolib.train import TrainConfig, train
from picolib.tryit.lesson10 import memory_budget

matplotlib.use("Agg")

SEQ = 32
CONFIGS = [dict(dp=2, tp=1, pp=2, zero=1, micro_batches=2), dict(dp=2, tp=2, pp=1, zero=2, micro_batches=1),
           dict(dp=1, tp=2, pp=2, sp=True, zero=0, micro_batches=2),
           dict(dp=4, tp=1, pp=1, zero=3, micro_batches=1), dict(dp=2, tp=1, pp=2, zero=2, micro_batches=1)]


def _measure(configs):
    out = []
    for c in configs:
        cfg = TrainConfig(**c, batch=c["dp"] * c["micro_batches"], seq=SEQ, preset="small",
                          steps=1, data="random", progress=False, peak_tflops=1.0)
        out.append(train(cfg)[0]["state_bytes"])
    return out


def test_state_bytes_equal_the_trainers_measurement():
    measured = run(_measure, 4, CONFIGS, timeout=180)[0]
    for c, want in zip(CONFIGS, measured):
        shown = memory_budget(**c, preset="small", seq=SEQ, micro_batch_size=1, plot=False)
        assert shown["state_bytes"] == want > 0, c


@pytest.mark.parametrize("mbs", [1, 2])
def test_activations_equal_a_measured_forward_and_the_verdict_follows_the_budget(mbs, capsys):
    one = dict(dp=1, tp=1, pp=1, zero=0, micro_batches=1, preset="small", seq=SEQ,
               micro_batch_size=mbs, plot=False)
    shown = memory_budget(**one)
    model = TinyLlama(shown["config"].model_config())
    # tokens and targets in storages of their own, as a data loader hands them (the counter
    # counts a storage once: views of one buffer would be counted together)
    x, y = (t.clone() for t in random_tokens(mbs, SEQ, model.cfg.vocab_size))
    with SavedActivations(model) as act:
        model.loss(x, y)
    assert shown["ranks"][0]["activations"] == act.bytes > 0
    total = shown["state_bytes"] + act.bytes
    assert memory_budget(**one | dict(budget_mb=total / 1e6))["fits"]
    assert not memory_budget(**one | dict(budget_mb=(total - 1) / 1e6))["fits"]
    assert "does NOT fit" in capsys.readouterr().out


def test_every_knob_combination_runs(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)
    fits = set()
    for i, (dp, tp, pp, zero, m) in enumerate(itertools.product([2, 1, 4], [2, 1, 4], [2, 1, 4],
                                                                [1, 0, 2, 3], [4, 1])):
        knobs = dict(dp=dp, tp=tp, pp=pp, zero=zero, micro_batches=m, plot=i % 25 == 0)
        if zero == 3 and pp > 1:
            with pytest.raises(ValueError, match="ZeRO-3 × pipeline parallelism is not supported"):
                memory_budget(**knobs)
            continue
        out = memory_budget(**knobs)
        assert len(out["ranks"]) == pp and out["peak"] == max(r["total"] for r in out["ranks"])
        fits.add(out["fits"])
        plt.close("all")
    assert fits == {True, False}          # the default budget is crossed by the knobs
    with pytest.raises(ValueError, match="tp=3"):
        memory_budget(tp=3)
    with pytest.raises(ValueError, match="budget_mb must be positive"):
        memory_budget(budget_mb=0)
