"""Lessons 01 and 01b's try-it functions: lesson 01's trace peaks and lesson 01b's bars are
picolib.memory's measurements of the tiny Llama."""
import matplotlib
import pytest

matplotlib.use("Agg")

from picolib.model import LlamaConfig, param_count  # noqa: E402
from picolib.tryit.lesson01 import memory_bars, step_trace  # noqa: E402


def test_the_trace_peak_holds_the_gradients_only_under_accumulation():
    """Lesson 01's try-it: from step 2 on, one pass peaks at the end of the forward with weights
    and Adam's moments (12 bytes a parameter) and no gradient; with micro-batches the first
    micro-batch's gradients (4 more) are alive at the peak, and the saved activations are fewer."""
    n = param_count(LlamaConfig())
    peaks = {k: step_trace(8, k, plot=False) for k in (1, 2, 4)}
    assert peaks[1].grads == 0 and peaks[1].params + peaks[1].optimizer == 12 * n
    assert peaks[1].event == "forward"
    for k in (2, 4):
        assert peaks[k].grads == 4 * n and peaks[k].params + peaks[k].optimizer == 12 * n
    assert peaks[1].activations > peaks[2].activations > peaks[4].activations > 0
    longer = step_trace(8, 1, seq=128, plot=False)
    assert longer.activations > peaks[1].activations and longer.params == peaks[1].params


def test_the_trace_refuses_micro_batches_that_do_not_divide_the_batch_and_draws():
    import matplotlib.pyplot as plt
    with pytest.raises(ValueError, match="micro_batches must divide batch"):
        step_trace(8, 3, plot=False)
    with pytest.raises(ValueError, match="steps"):
        step_trace(8, 1, steps=1, plot=False)
    step_trace(4, 2, seq=32)
    assert plt.gcf().axes[0].get_ylabel() == "MiB"
    plt.close("all")


def test_the_peak_holds_weights_and_moments_but_no_gradient_and_the_bound_adds_them():
    """Lesson 01b's bars: the step's peak (end of the forward) holds 12 bytes a counted parameter
    and no gradient; the sum of each kind's maximum adds the 4 bytes of gradients."""
    from picolib.tryit.lesson01 import step_peak
    n = param_count(LlamaConfig())
    bd = memory_bars(2, 64, plot=False)
    assert (bd.params, bd.grads, bd.optimizer) == (4 * n, 0, 8 * n) and bd.event == "forward"
    peak, bound = step_peak(LlamaConfig(), 2, 64)
    assert (bound.params, bound.grads, bound.optimizer) == (4 * n, 4 * n, 8 * n)
    assert bound.activations == peak.activations == bd.activations > 0
    assert bound.total == peak.total + 4 * n
    small = memory_bars(1, 32, plot=False)          # activations small: the peak moves into the backward
    assert small.event == "backward" and 0 < small.grads < 4 * n
    with pytest.raises(ValueError, match="steps"):
        step_peak(LlamaConfig(), 1, 32, steps=1)


def test_activations_grow_linearly_in_batch_and_recomputation_cuts_them():
    acts = [memory_bars(b, 32, plot=False).activations for b in (2, 4, 6)]
    assert acts[2] - acts[1] == acts[1] - acts[0] > 0
    by_mode = {r: memory_bars(2, 64, r, plot=False).activations for r in ("none", "selective", "full")}
    assert by_mode["full"] < by_mode["selective"] < by_mode["none"]


def test_bad_recompute_is_an_error_and_the_plot_draws():
    import matplotlib.pyplot as plt
    with pytest.raises(ValueError, match="recompute"):
        memory_bars(1, 32, "sometimes", plot=False)
    memory_bars(1, 32)
    plt.close("all")


def test_pure_bf16_stalls_where_fp32_masters_do_not():
    """Lesson 01's mixed-precision run, shortened: bf16 rounds away most first-step updates,
    the fp32 masters keep all of them and track fp32."""
    from picolib.tryit.lesson01 import precision_runs
    runs = precision_runs(steps=20, lr=1e-5, batch=2, seq=32)
    assert runs["fp32"]["unchanged"] == runs["bf16 + fp32 master"]["unchanged"] == 0
    assert runs["bf16"]["unchanged"] > 0.5
    drop = {m: r["losses"][0] - min(r["losses"][-5:]) for m, r in runs.items()}
    assert drop["fp32"] > 0 and abs(drop["bf16 + fp32 master"] - drop["fp32"]) < 0.2 * drop["fp32"]
    last = {m: sum(r["losses"][-5:]) / 5 for m, r in runs.items()}
    assert last["bf16"] - last["fp32"] > 5 * abs(last["bf16 + fp32 master"] - last["fp32"])


def test_a_bf16_gradient_sum_drifts_and_an_fp32_one_does_not():
    from picolib.tryit.lesson01 import accumulation_error
    err = accumulation_error(micro_batches=16)
    assert err["bf16"] > 1e-3 > 1e-6 > err["fp32"]
