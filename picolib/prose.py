"""Prose that states a result is rendered from the value that holds it.

A lesson computes a number in one cell and talks about it in the text around it. Typed by
hand, the text drifts from the output (a rerun on another machine, a changed knob, an edited
formula). So a sentence that states a computed result is written as the cell's output:

    say(f"SP costs TP8 {-change:.0%} of its tokens per second here, and stretches the "
        f"longest sequence {longest_sp / longest_tp:.1f}× ({longest_tp:,} → {longest_sp:,} tokens).")

`say` shows the text as Markdown under the cell: in JupyterLab, on the static site, and again
after a learner turns a knob and reruns the cell, it always holds the numbers just computed.
Such cells carry the tag `prose`; the site shows their output only, JupyterLab collapses their
source. `tools/prose_numbers.py` (and `tests/repo/test_prose_numbers.py`) checks the rest:
every number left in a lesson's markdown is printed or used by the code of its section, cited
to a named source, or quoted from the statement a lesson corrects. Lesson 00 explains the rule.
"""
from __future__ import annotations

import textwrap

__all__ = ["say", "pct", "signed"]


def say(text: str) -> None:
    """Display `text` (Markdown) as this cell's output; plain print outside a notebook."""
    text = textwrap.dedent(text).strip()
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:                      # picolib without IPython: a script, a worker
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))


def pct(x: float, digits: int = 0) -> str:
    """A fraction as a percentage with a narrow space, the course's style: 0.183 → '18 %'."""
    return f"{100 * x:.{digits}f} %"


def signed(x: float, digits: int = 0) -> str:
    """A relative change as a signed percentage with a real minus sign: -0.031 → '−3 %'."""
    s = f"{100 * x:+.{digits}f} %"
    return s.replace("-", "−")
