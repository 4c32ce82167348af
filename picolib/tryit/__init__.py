""""Try it" cells: each lesson ends with a plain function of two or three numbers that
draws or prints something (tested in tests/, like any library function), and `knobs`,
which puts sliders and menus on it in the notebook.

    from picolib.tryit import knobs
    from picolib.tryit.lesson00 import ring_time
    knobs(ring_time, n=(2, 64, 1), nbytes=[1e6, 1e8, 1e9])

The functions live in one module per lesson (`picolib/tryit/lessonNN.py`).
"""
from __future__ import annotations

__all__ = ["knobs"]


def knobs(fn, **choices):
    """Call `fn` with knobs: a (low, high, step) tuple is a slider, a list a menu. The first
    call uses each knob's first value (a slider starts at `low`); with ipywidgets (installed
    with the notebooks extra) every change calls `fn` again, without it `fn` runs once.
    Returns what that first call returned."""
    first = {}
    for name, choice in choices.items():
        if isinstance(choice, tuple) and len(choice) == 3:
            first[name] = choice[0]
        elif isinstance(choice, list) and choice:
            first[name] = choice[0]
        else:
            raise ValueError(f"knob {name!r}: give a (low, high, step) tuple or a non-empty list, "
                             f"not {choice!r}")
    try:
        import ipywidgets
        from IPython import get_ipython
    except ImportError:
        ipywidgets = None
    if ipywidgets is None or get_ipython() is None:
        return fn(**first)
    widgets = {}
    for name, choice in choices.items():
        if isinstance(choice, tuple):
            low, high, step = choice
            kind = ipywidgets.IntSlider if all(isinstance(v, int) for v in choice) else ipywidgets.FloatSlider
            widgets[name] = kind(value=low, min=low, max=high, step=step, description=name,
                                 continuous_update=False)
        else:
            widgets[name] = ipywidgets.Dropdown(options=choice, value=choice[0], description=name)
    from IPython.display import display
    out = ipywidgets.Output()

    def draw(**values):
        failed = []
        with out:                      # the widget would swallow an exception: keep it
            out.clear_output(wait=True)
            try:
                failed.append(("ok", fn(**values)))
            except Exception as e:     # noqa: BLE001 — re-raised below, outside the widget
                failed.append(("error", e))
        kind, value = failed[0]
        if kind == "error":
            raise value
        return value

    def changed(_):
        draw(**{n: w.value for n, w in widgets.items()})

    for w in widgets.values():
        w.observe(changed, names="value")
    display(ipywidgets.HBox(list(widgets.values())), out)
    return draw(**first)
