"""Lesson 01's try-it function: its bars are picolib.memory's measurements of the tiny Llama."""
import matplotlib
import pytest

matplotlib.use("Agg")

from picolib.model import LlamaConfig, param_count  # noqa: E402
from picolib.tryit.lesson01 import memory_bars  # noqa: E402


def test_model_state_is_16_bytes_per_counted_parameter():
    n = param_count(LlamaConfig())
    bd = memory_bars(1, 32, plot=False)
    assert (bd.params, bd.grads, bd.optimizer) == (4 * n, 4 * n, 8 * n)


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
