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
    for n in range(13):
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
    from picolib.memory import Breakdown
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
             "runs": {"fp32": {"losses": [5.6, 5.5, 5.4]}, "bf16": {"losses": [5.6, 5.6, 5.6]}},
             "table": {"RMSNorm": {"eager_bytes": 6.0, "fused_bytes": 2.0, "eager_s": 3.0, "compiled_s": 1.0}},
             "outliers": [1, 10, 100], "errors": {"tensor": [0.02, 0.05, 0.2], "tile": [0.02, 0.02, 0.02]},
             "counts": {"naive": (39,), 1: (39,), 65536: (13,), 2**20: (1,)}, "caps": [1, 65536, 2**20],
             "rows": {"b=1": (Breakdown(4, 0, 8, 3), Breakdown(4, 4, 8, 3))},
             "traffic": [{"hierarchical": (0, 0, 512), "flat ring": (0, 0, 1792)},
                         {"hierarchical": (0, 0, 512), "flat ring": (0, 0, 0)}],
             "per_node": 2, "nbytes": 1024, "seen": {"hierarchical": 4e11, "flat ring": 5e10}}
    args = {k: given[k] for k in needs if k in given}
    assert set(needs) <= set(args), f"give the test arguments for {helper.__name__}: {needs}"
    helper(ax=ax, **args)
    assert shown == [], f"{helper.__name__} showed the figure it was handed"
    assert plt.fignum_exists(fig.number), f"{helper.__name__} closed the figure it was handed"
    axes = ax if panels > 1 else [ax]
    assert all(a.patches or a.lines or a.collections or a.images for a in axes), "nothing drawn"
    plt.close("all")


CELLS = ['from picolib.tryit import knobs\n'
         'def f(n):\n'
         '    print("live", n)\n'
         '    return {"n": n}',
         'knobs(f, n=(2, 8, 1))',                  # a try-it cell as the lessons write it
         'shown = knobs(f, n=[3, 4])\nshown',      # the value kept for code, not printed
         'shown',                                  # a later cell prints it as usual
         'knobs(f, n=[5])\n7']                     # anything else the cell ends on still shows


@pytest.mark.parametrize("setup", ["widgets", "no widgets", "echoing (the old knobs)"])
def test_a_try_it_cell_shows_only_its_live_output(setup):
    """Run in a real kernel (as Jupyter and nbval do): IPython prints a cell's last value
    unless it is None; a try-it cell's would be the first call's result, which no longer
    matches the live output once a knob moves. 'echoing' puts the old behaviour back, to
    show the check sees an echoed value."""
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient
    first = {"widgets": "", "no widgets": "import sys; sys.modules['ipywidgets'] = None\n",
             "echoing (the old knobs)": "import picolib.tryit as t; t._not_echoed = lambda v: v\n"}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(first[setup] + CELLS[0])]
                                  + [nbformat.v4.new_code_cell(c) for c in CELLS[1:]])
    root = Path(__file__).resolve().parents[2]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(root)}}).execute()
    results = [[o.data["text/plain"] for o in c.outputs if o.output_type == "execute_result"]
               for c in nb.cells]
    if setup.startswith("echoing"):
        assert results[1:3] == [["{'n': 2}"], ["{'n': 3}"]]
        return
    assert results[1:] == [[], [], ["{'n': 3}"], ["7"]]
    live = nb.cells[1].outputs
    if setup == "widgets":      # the sliders and the output area the calls draw into
        assert [o.output_type for o in live] == ["display_data"] * 2
        assert all("application/vnd.jupyter.widget-view+json" in o.data for o in live)
    else:                       # no widgets: the one call's own output
        assert [o.get("text") for o in live] == ["live 2\n"]
