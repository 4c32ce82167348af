""""Try it" cells: each lesson ends with a plain function of two or three numbers that
draws or prints something (tested in tests/, like any library function), and `knobs`,
which puts sliders and menus on it in the notebook.

    from picolib.tryit import knobs
    from picolib.tryit.lesson00 import ring_time
    knobs(ring_time, n=(2, 64, 1), nbytes=[1e6, 1e8, 1e9])

The functions live in one module per lesson (`picolib/tryit/lessonNN.py`).
"""
from __future__ import annotations

__all__ = ["knobs", "rank_bars"]

_PARTS = {"params": "#2a9d8f", "grads": "#f4a261", "optimizer": "#e76f8a", "activations": "#8e6cc0"}


def rank_bars(ranks, unit: float, unit_name: str, limit: float, limit_label: str, title: str, ax=None):
    """Stacked bars of each pipeline rank's parameters, gradients, optimizer state and
    activations (bytes / `unit`), with a dashed line at `limit` (lessons 10 and 11)."""
    import matplotlib.pyplot as plt
    created = ax is None
    if created:
        _, ax = plt.subplots(figsize=(7.6, 3.4))
    bottom = [0.0] * len(ranks)
    for part, color in _PARTS.items():
        vals = [r[part] / unit for r in ranks]
        ax.bar(range(len(ranks)), vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(limit, color="k", ls="--", lw=1, label=limit_label)
    ax.set(xlabel="pipeline rank", ylabel=f"{unit_name} per rank", xticks=range(len(ranks)), title=title)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    if created:                 # a helper handed an ax draws into it and never shows it
        ax.figure.tight_layout()
        plt.show()
    return ax


def knobs(fn, **choices):
    """Call `fn` with knobs: a (low, high, step) tuple is a slider, a list a menu. The first
    call uses each knob's first value (a slider starts at `low`); with ipywidgets (installed
    with the notebooks extra) every change calls `fn` again, without it `fn` runs once.
    Returns what that first call returned, for code (`bars = knobs(...)`); a notebook cell
    does not also print it as its result (see `_not_echoed`)."""
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
        return _not_echoed(fn(**first))
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
    return _not_echoed(draw(**first))


def _not_echoed(value):
    """`value`, which the running notebook cell will not print as its result.

    IPython prints a cell's last expression (`Out[10]: ...`) unless it is None. For a try-it
    cell that is the first call's value: it stays as it was when the knobs move, under a
    figure that changes, and soon contradicts it. So while this cell runs, the display hook
    skips this very object (anything else still shows); IPython puts its own hook back when
    the cell ends. Outside a running cell nothing changes."""
    import sys
    try:
        from IPython import get_ipython
    except ImportError:
        return value
    trap = getattr(get_ipython(), "display_trap", None)
    if trap is None or not trap.is_active:
        return value
    echo = sys.displayhook

    def displayhook(result):
        if result is not value:
            echo(result)

    sys.displayhook = displayhook
    return value
