"""Lesson 08's try-it function: its times are the latency formula, the slicer (the paper's
dynamic program) is never worse than the uniform cut, every knob value runs, bad input raises;
its two panels share one time axis."""
import matplotlib
import pytest

matplotlib.use("Agg")

from picolib.terapipe_slicer import pipeline_latency, uniform_slices  # noqa: E402
from picolib.tryit.lesson08 import SEQ, slicing_gantt, toy_cost  # noqa: E402


@pytest.mark.parametrize("n_slices, p, w", [(1, 4, 0.0), (4, 4, 1.0), (8, 2, 2.0), (16, 8, 0.5)])
def test_times_are_the_formula(n_slices, p, w):
    got = slicing_gantt(n_slices, p, w, plot=False)
    cost = toy_cost(w)
    assert got["uniform"] == pytest.approx(pipeline_latency(uniform_slices(SEQ, n_slices), cost, p))
    assert got["slicer"] == pytest.approx(pipeline_latency(got["slicer_slices"], cost, p))
    assert got["slicer"] <= got["uniform"] + 1e-9


def test_one_slice_idles_p_minus_one_of_p():
    """One slice, no context cost: every stage works t and the step takes p·t."""
    got = slicing_gantt(1, 4, 0.0, plot=False)
    assert got["uniform"] == pytest.approx(4 * toy_cost(0.0)(SEQ, 0))


def test_every_knob_value_runs():
    for n in (1, 2, 4, 8, 16):
        for p in (2, 4, 8):
            got = slicing_gantt(n, p, 1.0, plot=False)
            assert got["slicer"] <= got["uniform"] + 1e-9 and sum(got["slicer_slices"]) == SEQ


def test_it_draws_and_refuses_bad_input():
    import matplotlib.pyplot as plt
    plt.close("all")
    slicing_gantt(4, 4, 1.0)
    assert len(plt.get_fignums()) <= 1
    from picolib.figure_check import problems
    fig = plt.figure(plt.get_fignums()[-1])
    top, bottom = fig.axes[:2]
    assert top.get_xlim() == bottom.get_xlim()            # one time axis for both panels
    assert problems(fig) == []
    with pytest.raises(ValueError, match="context_cost=-1"):
        slicing_gantt(4, 4, -1)
    with pytest.raises(ValueError, match="need 1 ≤ slices ≤ 1024"):
        slicing_gantt(2000, 4, 1.0, plot=False)


@pytest.mark.parametrize("p", [4, 2, 8])
def test_the_hint_w0_near_uniform_w4_short_last_slices(p):
    """The try-it hint: at context_cost 0 the slicer settles for (near-)uniform slices; at 4 the
    last slices get short — down to the slicer's unit of 64 tokens, a fraction of the first."""
    flat = slicing_gantt(4, p, 0.0, plot=False)["slicer_slices"]
    assert max(flat) - min(flat) <= 64
    steep = slicing_gantt(4, p, 4.0, plot=False)["slicer_slices"]
    assert steep[-1] == 64 and steep[0] >= 4 * steep[-1]
    assert list(steep) == sorted(steep, reverse=True)
