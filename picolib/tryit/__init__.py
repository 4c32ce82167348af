""""Try it" cells: each lesson ends with a plain function of two or three numbers that
draws or prints something (tested in tests/, like any library function), and `knobs`,
which puts sliders and menus on it in the notebook.

    from picolib.tryit import knobs
    from picolib.tryit.lesson00 import ring_time
    knobs(ring_time, n=(2, 64, 1), nbytes=[1e6, 1e8, 1e9]);

A try-it cell that ends on `knobs(...)` ends with `;`: IPython prints a cell's last value
(`Out[..]`) unless the line ends with a semicolon, and here that value is the first call's
result, which stays as it was under a figure that changes when the knobs move.

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
    Returns what that first call returned, for code (`bars = knobs(...)`); a cell that ends on
    the call ends it with `;` (module docstring)."""
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

