"""The try-it function of lessons 07 and 07b: its bubble is the published closed form where there is one,
every combination the lesson's knobs offer runs or explains itself, bad names raise."""
import matplotlib
import pytest

matplotlib.use("Agg")

from picolib.pipeline_schedules import bubble_formula, make_schedule  # noqa: E402
from picolib.tryit.lesson07 import schedule_gantt  # noqa: E402

KNOB_SCHEDULES = ["1f1b", "afab", "interleaved",          # lesson 07's knobs
                  "zb_h1", "dualpipe", "dualpipev"]           # lesson 07b's (and 1f1b)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 12), (8, 16)])
def test_the_bubble_is_the_closed_form(p, m):
    assert schedule_gantt("1f1b", p, m, plot=False) == pytest.approx(bubble_formula(p, m))
    assert schedule_gantt("afab", p, m, plot=False) == pytest.approx((p - 1) / m)
    assert schedule_gantt("zb_h1", p, m, plot=False) == pytest.approx(
        bubble_formula(p, m, schedule="zb_h1"))
    assert schedule_gantt("zb_h1", p, m, plot=False) == pytest.approx((p - 1) / (3 * m))
    assert schedule_gantt("interleaved", p, m, plot=False) == pytest.approx(bubble_formula(p, m, 2))
    assert schedule_gantt("interleaved", p, m, v=4, plot=False) == pytest.approx(
        (p - 1) / (4 * m))
    for name in ("dualpipe", "dualpipev"):
        assert schedule_gantt(name, p, m, plot=False) == pytest.approx(
            bubble_formula(p, m, schedule=name))
    # DualPipe, F = B = W = 1, no overlap speed-up: (p/2−1)·2 idle per rank, m·3 busy
    assert schedule_gantt("dualpipe", p, m, plot=False) == pytest.approx((p / 2 - 1) * 2 / (3 * m))


def test_zb_greedy_has_no_closed_form_but_runs():
    assert bubble_formula(4, 8, schedule="zb_greedy") is None
    assert schedule_gantt("zb_greedy", 4, 8, plot=False) == pytest.approx(2 * 3 / (3 * 8))


def test_every_knob_combination_runs_or_says_why(capsys):
    for name in KNOB_SCHEDULES:
        for p in range(2, 9):
            for m in range(8, 17):
                got = schedule_gantt(name, p, m, plot=False)
                try:
                    make_schedule(name, p, m, 2 if name in ("interleaved", "dualpipev") else 1)
                    assert 0 <= got < 1, (name, p, m)
                except ValueError as e:
                    assert got is None
                    assert str(e) in capsys.readouterr().out


def test_it_draws():
    import matplotlib.pyplot as plt
    plt.close("all")
    schedule_gantt("dualpipev", 4, 8)
    schedule_gantt("interleaved", 4, 6)            # refused: no figure, a message
    assert len(plt.get_fignums()) <= 1


def test_bad_names_raise():
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_gantt("gpipe2", 4, 8)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_gantt("ZB-H1", 4, 8)


def test_each_suggestion_in_the_hint_shows_what_it_says(capsys):
    """The try-it cells of lessons 07 and 07b list things to try; each one, run as written."""
    one = schedule_gantt("1f1b", 4, 8, plot=False)
    assert one == pytest.approx(0.375)
    assert schedule_gantt("afab", 4, 8, plot=False) == pytest.approx(one)
    assert schedule_gantt("dualpipev", 4, 8, plot=False) == pytest.approx(0.125)
    assert schedule_gantt("dualpipe", 4, 8, plot=False) == pytest.approx(1 / 12)
    assert schedule_gantt("1f1b", 4, 16, plot=False) == pytest.approx(0.1875) == pytest.approx(one / 2)
    for p, m in ((4, 8), (8, 16), (3, 12)):
        assert schedule_gantt("zb_h1", p, m, plot=False) == pytest.approx(
            schedule_gantt("1f1b", p, m, plot=False) / 3)
    assert schedule_gantt("interleaved", 4, 8, plot=False) == pytest.approx(0.1875) == pytest.approx(one / 2)
    assert schedule_gantt("dualpipe", 8, 16, plot=False) == pytest.approx(0.125)
    assert schedule_gantt("1f1b", 8, 16, plot=False) == pytest.approx(0.4375)
    capsys.readouterr()
    assert schedule_gantt("dualpipe", 5, 16, plot=False) is None
    assert "even p" in capsys.readouterr().out
    assert schedule_gantt("dualpipev", 8, 15, plot=False) is None
    assert "m ≥ 2p" in capsys.readouterr().out
    assert schedule_gantt("interleaved", 4, 10, plot=False) is None
    assert "multiple of p" in capsys.readouterr().out
