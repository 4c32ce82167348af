"""Read the technique: a lesson shows the library's own code, never a copy of it.

    from picolib.source import show
    show(ZeRO.step)

`show` displays the source of each function or class as it is in picolib — highlighted in a
notebook, plain text elsewhere — headed by its file and lines. The code a learner reads is the
code the lesson then runs, and the trainer too, so it cannot drift from it. Which functions each
technique lesson shows is listed in `tests/repo/test_shown_core.py`; `tools/reading_time.py`
counts the shown lines as code to read.
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

__all__ = ["show", "source_of"]

_PACKAGE = Path(__file__).resolve().parent


def source_of(obj) -> tuple[str, str, int, int]:
    """(dedented source, file relative to the repository, first line, last line) of a picolib
    function, method or class. Anything defined outside picolib is refused: a lesson shows the
    library, not a helper of its own or PyTorch's."""
    target = inspect.unwrap(obj.fget if isinstance(obj, property) else obj)
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        raise TypeError(f"show() takes functions, methods and classes, not {type(obj).__name__}")
    module = getattr(target, "__module__", "") or ""
    if module != "picolib" and not module.startswith("picolib."):
        raise ValueError(f"show() reads picolib's own source; {target.__qualname__} is from {module!r}")
    lines, first = inspect.getsourcelines(target)
    path = Path(inspect.getsourcefile(target)).resolve()
    return textwrap.dedent("".join(lines)), str(path.relative_to(_PACKAGE.parent)), first, first + len(lines) - 1


def show(*objs) -> None:
    """Display the source of each of `objs` (picolib functions, methods or classes), each headed
    `# picolib/file.py, lines a–b`."""
    if not objs:
        raise TypeError("show() needs at least one function")
    parts = []
    for obj in objs:
        text, path, first, last = source_of(obj)
        parts.append(f"# {path}, lines {first}–{last}\n{text}")
    text = "\n".join(parts).rstrip("\n")
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:                      # a script, a worker: plain text
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Code(text, language="python"))
