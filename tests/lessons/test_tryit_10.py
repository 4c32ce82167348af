"""Lesson 10's try-it: the state bytes it shows equal the trainer's measured `state_bytes`
(4 real ranks: DDP and ZeRO-1/2/3 with TP, SP and PP), its activations equal a forward
measured in one process, its verdict follows a budget set from those measurements, and every
knob combination of the lesson's cell runs (or is refused with the trainer's error).
Lesson 10b's: the learning rate it draws is the one the trainer's steps log, and its hints
show what the lesson says."""
import itertools

import matplotlib
import pytest

from picolib.launch import run
from picolib.memory import SavedActivations
from picolib.model import TinyLlama, random_tokens
from picolib.train import TrainConfig, train
from picolib.tryit.lesson10 import lr_schedule, memory_budget

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
    assert memory_budget(**one | dict(budget_mib=total / 2**20))["fits"]
    assert not memory_budget(**one | dict(budget_mib=(total - 1) / 2**20))["fits"]
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
    with pytest.raises(ValueError, match="budget_mib must be positive"):
        memory_budget(budget_mib=0)


def _lesson_text(name="10_5d_parallelism"):
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).parents[2] / f"notebooks/{name}.ipynb").read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_the_hints_run_and_show_what_they_say():
    """Each suggestion of the lesson's try-it text (and of section 3's bubble remark), run."""
    text = _lesson_text()
    # 1. zero=2, micro_batches 1 → 4: a shard (half, dp = 2), then the shard plus a whole
    #    gradient, more than zero=1 holds
    assert "`zero=2`, then `micro_batches` 1 → 4" in text
    one, four = (memory_budget(zero=2, micro_batches=m, plot=False) for m in (1, 4))
    z1 = memory_budget(zero=1, micro_batches=4, plot=False)
    for r1, r4, w in zip(one["ranks"], four["ranks"], z1["ranks"]):
        assert r1["grads"] * 2 == pytest.approx(w["grads"], rel=0.01)      # half, dp = 2
        assert r4["grads"] == r1["grads"] + w["grads"] > w["grads"]
    # 2. the deep pipeline: rank 0 busiest, over the 4 MiB budget
    assert "`dp=1, tp=1, pp=4, zero=0, micro_batches=8`" in text
    deep = memory_budget(dp=1, tp=1, pp=4, zero=0, micro_batches=8, plot=False)
    assert deep["busiest"] == 0 and not deep["fits"]
    assert memory_budget(dp=1, tp=1, pp=4, zero=0, micro_batches=1, plot=False)["fits"]
    # 3. zero=3 with pp=2: refused with the trainer's reason
    assert "`zero=3` with `pp=2`: refused" in text
    with pytest.raises(ValueError, match="ZeRO-3 × pipeline parallelism is not supported"):
        memory_budget(zero=3, pp=2, plot=False)


def test_section_3s_bubble_remark():
    """micro_batches=4 with batch=32: every layout of the grid is accepted, and the bubble
    falls to 0.25 (1F1B) and 0.125 (interleaved, printed 0.12)."""
    from picolib.compose import check_config
    from picolib.pipeline_schedules import make_schedule
    from picolib.pipeline_simulator import simulate
    from picolib.timeline import bubble_ratio
    assert "`micro_batches=4` and `batch=32`" in _lesson_text()
    grid = [dict(dp=8), dict(dp=4, tp=2, zero=3), dict(dp=2, pp=2, tp=2, sp=True, zero=1),
            dict(dp=2, cp=2, tp=2, zero=2), dict(pp=2, dp=2, cp=2, schedule="interleaved")]
    for opts in grid:
        check_config(TrainConfig(batch=32, seq=32, micro_batches=4, **opts), 8)
    cost = {"F": 1, "B": 2, "W": 0}
    assert bubble_ratio(simulate(make_schedule("1f1b", 2, 4), cost)) == pytest.approx(0.25)
    assert bubble_ratio(simulate(make_schedule("interleaved", 2, 4, 2), cost)) == pytest.approx(0.125)


# ------------------------------------------------- lesson 10's figures (issue: figures that show)

def _fake_runs():
    ref = [{"loss": 3.0 - 0.1 * i} for i in range(10)]
    runs = {"exact": [dict(r) for r in ref],
            "close": [{"loss": r["loss"] + (1e-6 if i % 2 else 0.0)} for i, r in enumerate(ref)]}
    return ref, runs


def test_loss_difference_draws_zeros_at_zero_and_the_bound():
    import matplotlib.pyplot as plt

    from picolib.figure_check import problems
    from picolib.tryit.lesson10 import plot_loss_curves

    ref, runs = _fake_runs()
    fig = plot_loss_curves(ref, runs, bound=2e-5)
    dx = fig.axes[1]
    assert dx.get_yscale() == "symlog"
    exact = [ln for ln in dx.lines if ln.get_label() == "exact"][0]
    assert list(exact.get_ydata()) == [0.0] * 10                  # exact zeros drawn as 0, no +1e-9
    assert any(list(ln.get_ydata()) == [2e-5, 2e-5] for ln in dx.lines)   # the asserted bound
    assert problems(fig) == []
    plt.close(fig)


def test_bytes_by_kind_figure_uses_the_parallelism_colours():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from picolib.figure_check import problems
    from picolib.style import PARALLELISM
    from picolib.tryit.lesson10 import plot_bytes_by_kind

    MiB = 2 ** 20
    table = {"one process": dict(state=8 * MiB, act=2 * MiB, sent={}, bubble=0.0),
             "dp8": dict(state=8 * MiB, act=MiB, sent={"DP": 14 * MiB}, bubble=0.0),
             "dp2×pp2×tp2": dict(state=2 * MiB, act=MiB, sent={"DP": MiB, "TP": 3 * MiB, "PP": MiB // 8},
                                 bubble=0.5)}
    fig = plot_bytes_by_kind(table)
    ax = fig.axes[0]
    colours = {to_hex(p.get_facecolor()) for p in ax.patches}
    assert colours == {PARALLELISM[k].lower() for k in ("DP", "TP", "PP")}
    widths = sorted(round(p.get_width(), 6) for p in ax.patches if p.get_width() > 0)
    assert widths == sorted([14.0, 1.0, 3.0, 0.125])                # MiB, binary
    assert problems(fig) == []
    plt.close(fig)


# ------------------------------------------------- lesson 10b's try-it: the learning-rate schedule

def _logged_lrs(settings):
    return [[r["lr"] for r in train(TrainConfig(**s, batch=2, seq=8, steps=9, lr=2e-3, preset="small",
                                                data="random", progress=False, peak_tflops=1.0))]
            for s in settings]


SCHEDULES = [dict(lr_schedule=name, warmup=w, min_lr=f) for name, w, f in
             (("cosine", 3, 2e-4), ("constant", 2, 0.0), ("linear", 0, 5e-4), ("wsd", 2, 1e-4))]


def test_lr_schedule_draws_the_rate_the_trainer_uses():
    logged = run(_logged_lrs, 1, SCHEDULES, timeout=180)[0]
    for s, lrs in zip(SCHEDULES, logged):
        shown = lr_schedule(s["lr_schedule"], s["warmup"], s["min_lr"], steps=9, lr=2e-3, plot=False)["lrs"]
        assert shown == pytest.approx(lrs, rel=1e-12, abs=0), s
    assert len(set(map(tuple, logged))) == len(SCHEDULES)          # the settings differ in the log
    with pytest.raises(ValueError, match="--min-lr"):
        lr_schedule(min_lr=1e-2, plot=False)
    with pytest.raises(ValueError, match="--lr-schedule"):
        lr_schedule("step", plot=False)


def test_lesson_10bs_hints_show_what_they_say(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)
    text = _lesson_text("10b_training_run")
    default = lr_schedule()
    # warmup=0: the first step runs at the peak rate, which warmup keeps it from
    assert "`warmup=0`" in text
    assert lr_schedule(warmup=0)["lrs"][0] == max(default["lrs"]) > 10 * default["lrs"][0]
    # wsd: at the peak for most of the run, decaying linearly to min_lr only near the end
    assert '`schedule="wsd"`' in text
    wsd = lr_schedule("wsd")
    first, last = wsd["peak"]
    assert last - first > len(wsd["lrs"]) / 2 and wsd["lrs"][-1] == pytest.approx(3e-4)
    tail = wsd["lrs"][last + 1:]                                   # after the kink
    steps = [a - b for a, b in zip(tail, tail[1:])]
    assert max(steps) == pytest.approx(min(steps), rel=1e-9)       # linear
    # min_lr equal to the peak: flat after warmup, whatever the schedule
    assert "`min_lr=3e-3`" in text
    for name in ("cosine", "linear", "wsd"):
        flat = lr_schedule(name, min_lr=3e-3)["lrs"]
        assert set(flat[20:]) == {3e-3}, name
    plt.close("all")
