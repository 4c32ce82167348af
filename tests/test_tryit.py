"""`knobs`: the first call uses each knob's first value and returns its result; bad knobs
are clear errors. (Outside a notebook there are no widgets: the function runs once.)"""
import pytest

from picolib.tryit import knobs


def test_knobs_calls_the_function_with_the_first_values():
    calls = []

    def f(n, size):
        calls.append((n, size))
        return n * size

    assert knobs(f, n=(2, 8, 1), size=[10.0, 20.0]) == 20.0
    assert calls == [(2, 10.0)]


@pytest.mark.parametrize("bad", [[], (1, 2), 5])
def test_a_bad_knob_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="knob 'n'"):
        knobs(lambda n: n, n=bad)


def _helpers_that_take_an_ax():
    import importlib
    import inspect
    found = []
    for n in range(12):
        module = importlib.import_module(f"picolib.tryit.lesson{n:02d}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and "ax" in inspect.signature(fn).parameters:
                found.append(pytest.param(fn, id=f"{n:02d}.{name}"))
    return found


@pytest.mark.parametrize("helper", _helpers_that_take_an_ax())
def test_a_helper_handed_an_ax_draws_into_it_and_never_shows_it(helper, monkeypatch):
    """A try-it helper given a panel of a bigger figure draws into that panel and leaves the
    figure to its caller: showing it would display the figure before its other panels are
    drawn (lesson 06's zig-zag panel was empty that way)."""
    import inspect

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = []
    monkeypatch.setattr(plt, "show", lambda *a, **k: shown.append(1))
    panels = 2 if "tp_layer_bytes" in helper.__name__ else 1
    fig, ax = plt.subplots(1, panels)
    needs = [k for k, p in inspect.signature(helper).parameters.items()
             if k != "ax" and p.default is p.empty]
    given = {"groups": {"N = 2": {"DP": {"params": 4.0, "grads": 4.0, "optimizer": 8.0},
                                  "ZeRO-1": {"params": 4.0, "grads": 4.0, "optimizer": 4.0}}},
             "runs": {"fp32": {"losses": [5.6, 5.5, 5.4]}, "bf16": {"losses": [5.6, 5.6, 5.6]}}}
    args = {k: given[k] for k in needs if k in given}
    assert set(needs) <= set(args), f"give the test arguments for {helper.__name__}: {needs}"
    helper(ax=ax, **args)
    assert shown == [], f"{helper.__name__} showed the figure it was handed"
    assert plt.fignum_exists(fig.number), f"{helper.__name__} closed the figure it was handed"
    axes = ax if panels > 1 else [ax]
    assert all(a.patches or a.lines or a.collections or a.images for a in axes), "nothing drawn"
    plt.close("all")
