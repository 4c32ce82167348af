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
         'knobs(f, n=(2, 8, 1));',                 # a try-it cell as the lessons write it
         'shown = knobs(f, n=[3, 4])\nshown;',     # the value kept for code, not printed
         'shown',                                  # a later cell prints it as usual
         'knobs(f, n=[5]);\n7']                    # anything else the cell ends on still shows


@pytest.mark.parametrize("setup", ["widgets", "no widgets", "no semicolons"])
def test_a_try_it_cell_shows_only_its_live_output(setup):
    """Run in a real kernel (as Jupyter and nbval do): IPython prints a cell's last value
    unless it is None or the cell ends with `;`; a try-it cell's would be the first call's
    result, which no longer matches the live output once a knob moves. 'no semicolons' is
    the cells written without `;`: the check sees the echoed values."""
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient
    first = {"widgets": "", "no widgets": "import sys; sys.modules['ipywidgets'] = None\n",
             "no semicolons": ""}
    cells = [c.replace(";", "") if setup == "no semicolons" else c for c in CELLS[1:]]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(first[setup] + CELLS[0])]
                                  + [nbformat.v4.new_code_cell(c) for c in cells])
    root = Path(__file__).resolve().parents[2]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(root)}}).execute()
    results = [[o.data["text/plain"] for o in c.outputs if o.output_type == "execute_result"]
               for c in nb.cells]
    if setup == "no semicolons":
        assert results[1:3] == [["{'n': 2}"], ["{'n': 3}"]]
        return
    assert results[1:] == [[], [], ["{'n': 3}"], ["7"]]
    live = nb.cells[1].outputs
    if setup == "widgets":      # the sliders and the output area the calls draw into
        assert [o.output_type for o in live] == ["display_data"] * 2
        assert all("application/vnd.jupyter.widget-view+json" in o.data for o in live)
    else:                       # no widgets: the one call's own output
        assert [o.get("text") for o in live] == ["live 2\n"]


def echoed_knobs(source: str) -> bool:
    """True if a cell ends on a `knobs(...)` call that IPython would print (no `;`)."""
    import ast
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    last = body[-1] if body else None
    is_knobs = (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                and getattr(last.value.func, "id", None) == "knobs")
    return is_knobs and not source.rstrip().endswith(";")


def test_every_lessons_try_it_cell_ends_with_a_semicolon():
    """What the kernel test above shows for one notebook, for every lesson's cells: a cell
    ending on `knobs(...)` ends with `;`. The planted cells are one without and one with."""
    import json
    from pathlib import Path
    assert echoed_knobs("knobs(f, n=[1, 2])") and not echoed_knobs("knobs(f, n=[1, 2]);")
    assert not echoed_knobs("bars = knobs(f, n=[1])") and not echoed_knobs("knobs(f, n=[1]);\nx")
    root = Path(__file__).resolve().parents[2]
    echoed = [f"{path.name}, cell {i}" for path in sorted((root / "notebooks").glob("*.ipynb"))
              for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"])
              if cell["cell_type"] == "code" and echoed_knobs("".join(cell["source"]))]
    assert echoed == [], f"end these try-it cells with ';' (IPython prints their value): {echoed}"

