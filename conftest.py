"""Every figure a lesson draws is looked at as it is displayed (picolib.figure_check): under
`pytest --nbval-lax`, each notebook's kernel reports the problems of each figure it shows
(an empty panel, data squeezed by a shared axis or cut off by the limits, text under 9 pt),
and the cell that drew it fails, naming the lesson, the cell and the panel.

`--figures=check` (the default) fails such a cell; `--figures=report` prints the problems and
lets the cell pass; `--figures=off` does not look."""
import os
import tempfile

import pytest

_INSTALL = """
from picolib.figure_check import watch as _picolib_watch
def _picolib_report(line, _path={path!r}):
    with open(_path, "a", encoding="utf-8") as f:
        f.write(line + "\\n")
_picolib_watch(_picolib_report)
del _picolib_watch
"""


def pytest_addoption(parser):
    parser.addoption("--figures", choices=("check", "report", "off"), default="check",
                     help="look at every figure a notebook displays (default: check)")


def _is_notebook_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and getattr(item.parent, "kernel", None) is not None


def _report_file(item) -> str:
    notebook = item.parent
    path = getattr(notebook, "_picolib_figures", None)
    if path is None:
        fd, path = tempfile.mkstemp(prefix="picolib-figures-", suffix=".txt")
        os.close(fd)
        notebook._picolib_figures = path
        kernel = notebook.kernel
        msg_id = kernel.execute_cell_input(_INSTALL.format(path=path), allow_stdin=False)
        kernel.await_reply(msg_id, timeout=60)
        kernel.await_idle(msg_id, timeout=60)
    return path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    mode = item.config.getoption("--figures", default="off")
    if mode == "off" or not _is_notebook_cell(item):
        return (yield)
    path = _report_file(item)
    result = yield
    with open(path, encoding="utf-8") as f:
        found = [line.strip() for line in f if line.strip()]
    open(path, "w").close()
    if found:
        index = next((i for i, c in enumerate(item.parent.nb.cells) if c is item.cell), "?")
        where = f"{os.path.basename(str(item.parent.fspath))}, cell {index} ({item.name.lower()})"
        text = f"{where}: a figure a reader cannot see properly:\n  " + "\n  ".join(found)
        if mode == "check":
            raise AssertionError(text)
        print("\n[figures] " + text)
    return result


# What each lesson cell printed, kept for tests/repo/test_prose_numbers.py: the prose of a
# lesson is checked against the outputs of the very run nbval just made (issue 44).
def _printed(outputs) -> str:
    import sys
    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from prose_numbers import output_text
    return output_text(outputs)


@pytest.hookimpl(wrapper=True)   # a first-result hook: a plain implementation would never run
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and type(item).__name__ == "IPyNbCell":
        index = next((i for i, c in enumerate(item.parent.nb.cells) if c is item.cell), None)
        if index is not None:
            store = item.config.__dict__.setdefault("_picolib_outputs", {})
            store.setdefault(os.path.realpath(str(item.parent.fspath)), {})[index] = _printed(
                getattr(item, "test_outputs", None))
    return report


def pytest_collection_modifyitems(session, config, items):
    """The prose check reads what the lessons printed: it runs after every notebook."""
    last = [it for it in items if "test_prose_numbers.py::test_every_lesson" in it.nodeid]
    items[:] = [it for it in items if it not in last] + last


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers. Each file's tests go to one worker (a
    notebook's cells share one kernel, in order; a module's fixtures are built once), and the
    lessons with the prose checks form one unit, run first and in order: the checks read
    what that worker's lessons printed."""
    from xdist.scheduler import LoadScopeScheduling

    class LessonsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith("notebooks/") or "test_prose_numbers.py::test_every_lesson" in nodeid:
                return "lessons"
            return path

    return LessonsTogether(config, log)
