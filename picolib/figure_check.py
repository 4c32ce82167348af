"""Look at a figure the way a learner at the back of a classroom would (issue: figures whose
panels are empty, squeezed or clipped; the test suite runs every lesson through this).

`problems(fig)` draws the figure and returns one line per thing a reader could not see:
- a panel with nothing drawn in it (no line, bar, patch, image, collection or text);
- a panel whose data fill under `min_fill` of an axis it shares with another panel (the
  limits of the other panel squeezed it into a corner);
- data that run past the axis limits by more than `overrun` of the axis (cut off);
- text smaller than `min_points` at the saved size (unreadable when projected);
- a figure taller than `max_height` inches (it does not fit on a projected screen: split it);
- a panel with data but no title, in a figure without an overall title.
Each line names the panel (its index in the figure and its title).

`watch(report)` makes every figure be checked as IPython displays it: each problem is passed
to `report`, with the figure's own panels named. A drawing helper that shows a figure before
its second panel is drawn is caught this way: the figure shown has an empty panel.

The hook is IPython's display formatter API (nothing of matplotlib's is replaced): a
mime-bundle formatter registered for `Figure` (`display_formatter.mimebundle_formatter.for_type`)
runs each time a figure is displayed, before the image formatters; it checks the figure and
returns nothing, so the image is made as before. Not the `image/png` formatter: the inline
backend sets its own for `Figure` whenever it is configured (`%matplotlib inline`, the first
`import matplotlib.pyplot` in a kernel), which would drop ours.
"""
from __future__ import annotations

import math

__all__ = ["problems", "watch", "MIN_POINTS"]

MIN_POINTS = 9.0


def _name(i: int, ax) -> str:
    title = ax.get_title() or ax.get_title("left") or ax.get_ylabel() or ""
    return f"panel {i}" + (f" ({title!r})" if title else "")


def _has_marks(ax) -> bool:
    lines = any(len(ln.get_xdata()) > 0 and ln.get_visible() for ln in ax.lines)
    patches = any(p.get_visible() for p in ax.patches)
    collections = any(c.get_visible() and (len(c.get_offsets()) > 0 or len(c.get_paths()) > 0)
                      for c in ax.collections)
    images = bool(ax.images)
    texts = any(t.get_visible() and t.get_text().strip() for t in ax.texts)
    tables = bool(ax.tables)
    return lines or patches or collections or images or texts or tables


def _data_extent(ax, axis: int):
    """(low, high) of the panel's data along x (0) or y (1) in display pixels, or None."""
    lim = ax.dataLim
    if not (math.isfinite(lim.x0) and math.isfinite(lim.x1) and math.isfinite(lim.y0)
            and math.isfinite(lim.y1)) or lim.width < 0 or lim.height < 0:
        return None
    if lim.x0 == lim.x1 == 0 and lim.y0 == lim.y1 == 0 and not _has_marks(ax):
        return None
    try:
        corners = ax.transData.transform([[lim.x0, lim.y0], [lim.x1, lim.y1]])
    except ValueError:            # e.g. non-positive data on a log axis
        return None
    lo, hi = sorted(corners[:, axis])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return lo, hi


def _panel_box(ax, axis: int):
    box = ax.get_window_extent()
    return (box.x0, box.x1) if axis == 0 else (box.y0, box.y1)


def _shared(ax, axis: int) -> bool:
    group = ax.get_shared_x_axes() if axis == 0 else ax.get_shared_y_axes()
    return len(group.get_siblings(ax)) > 1


def problems(fig, min_points: float = MIN_POINTS, min_fill: float = 0.05,
             overrun: float = 0.02, max_height: float = 10.0) -> list[str]:
    """What a reader of `fig` could not see, one line each (empty when the figure is fine)."""
    fig.canvas.draw()
    found = []
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]
    height = fig.get_size_inches()[1]
    if height > max_height:
        found.append(f"the figure is {height:.1f} in tall, more than a screen ({max_height:g} in): split it")
    titled = bool(fig._suptitle is not None and fig._suptitle.get_text().strip())
    for i, ax in enumerate(panels):
        if not titled and ax.axison and _has_marks(ax) and not any(
                ax.get_title(loc).strip() for loc in ("center", "left", "right")):
            found.append(f"panel {i} has no title, and the figure none")
    for i, ax in enumerate(panels):
        name = _name(i, ax)
        if not _has_marks(ax):
            if ax.axison:
                found.append(f"{name} is empty")
            continue
        if not ax.axison or ax.name == "polar":
            continue
        for axis, letter in ((0, "x"), (1, "y")):
            extent = _data_extent(ax, axis)
            if extent is None:
                continue
            lo, hi = _panel_box(ax, axis)
            width = hi - lo
            if width <= 0:
                continue
            if _shared(ax, axis) and (extent[1] - extent[0]) < min_fill * width \
                    and len(ax.lines) + len(ax.patches) + len(ax.collections) > 0:
                siblings = ax.get_shared_x_axes() if axis == 0 else ax.get_shared_y_axes()
                spans = []
                for other in siblings.get_siblings(ax):
                    e = _data_extent(other, axis)
                    if e is not None:
                        spans.append(e[1] - e[0])
                if max(spans, default=0) >= 4 * max(extent[1] - extent[0], 1e-9):
                    found.append(f"{name}: its data fill {(extent[1] - extent[0]) / width:.1%} of "
                                 f"the {letter} axis it shares with another panel")
            past = max(0.0, lo - extent[0]) + max(0.0, extent[1] - hi)
            if past > overrun * width:
                found.append(f"{name}: data run {past / width:.0%} of the {letter} axis past its limits")
    small = {}
    for text in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text")):
        if not text.get_visible() or not str(text.get_text()).strip():
            continue
        if text.get_fontsize() < min_points - 1e-6:
            where = next((_name(i, ax) for i, ax in enumerate(panels) if text in ax.findobj()), "the figure")
            small.setdefault(where, []).append((text.get_fontsize(), str(text.get_text())[:20]))
    for where, texts in small.items():
        size, sample = min(texts)
        found.append(f"{where}: {len(texts)} text(s) under {min_points:g} pt "
                     f"(smallest {size:g} pt: {sample!r})")
    return found


def watch(report) -> None:
    """Check every figure as IPython displays it (module docstring); call `report(line)` for
    each problem found, once per figure. Call it in an IPython kernel; a second call changes
    nothing."""
    import weakref

    from IPython import get_ipython
    from matplotlib.figure import Figure

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("figure_check.watch checks figures as IPython displays them: "
                           "call it inside IPython (a notebook's kernel)")
    bundles = shell.display_formatter.mimebundle_formatter
    if getattr(bundles.type_printers.get(Figure), "_picolib_watch", False):
        return
    checked = weakref.WeakSet()

    def check(fig, *_, **__):
        if fig not in checked:
            checked.add(fig)
            for line in problems(fig):
                report(line)
        return None                  # no bundle of its own: the image formatters run as before

    check._picolib_watch = True
    bundles.for_type(Figure, check)
