"""A lesson's measurement plumbing (drawing, ledgers, timelines, checks), one module per lesson
(`picolib/tryit/lessonNN.py`); the techniques themselves run in the lessons' cells. `knobs` puts
sliders and menus on a "try it" function: `knobs(ring_cost, n=[8, 2, 64], nbytes=[1e6, 1e9]);`
— the cell ends with `;`, or IPython would print the first call's result under a figure that
changes when the knobs move.
"""
from __future__ import annotations

__all__ = ["knobs", "replay"]


def replay(calls) -> list:
    """Run each recorded (op, buffer bytes, …) call again on picolib's own rings (built from
    send/recv, lesson 00) with a buffer of the same size; return the bytes this rank really
    sent, one entry per call. Every rank of the group calls it with the same list."""
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..comm import Ledger

    rings = {"all_reduce": comm.ring_all_reduce, "reduce_scatter": comm.ring_reduce_scatter,
             "all_gather": lambda buf: comm.ring_all_gather(buf[: buf.numel() // dist.get_world_size()])}
    with Ledger() as led:                       # an all-gather's buffer is its gathered output
        for op, nbytes, *_ in calls:
            if op not in rings:
                raise ValueError(f"cannot replay {op!r}")
            rings[op](torch.ones(nbytes // 4))
    if not all(r.measured for r in led.records):
        raise AssertionError("a replayed call was not counted on picolib's rings")
    return [r.sent_bytes for r in led.records]


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

