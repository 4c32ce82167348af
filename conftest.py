"""Each notebook (notebooks/*.ipynb, solutions/*.ipynb) is one test: it is executed once per
run by the executor `make site` uses (tools/site.py `ensure_executed`: nbclient, a fresh
kernel per notebook, a lock per notebook, build/executed/<name>.ipynb reused while its stamp
is current), and the test fails on the first cell that raises or runs past `--cell-timeout`
seconds, naming the notebook, the cell, its first line and the end of the traceback. The
asserts inside the cells are the checks. The prose check (tests/repo/test_prose_numbers.py)
and `make site`/`make slides` read the same executed files.

Every figure a notebook shows is looked at as it is displayed (picolib.figure_check, inside
that same run): `--figures=check` (the default) fails the notebook's test on an empty panel,
data squeezed by a shared axis or cut off by the limits, or text under 9 pt, naming the cell
and the panel; `--figures=report` lists the problems at the end of the run and passes;
`--figures=off` ignores them. `--executed DIR` keeps the executed notebooks elsewhere
(`make test-torch` uses one folder per torch version)."""
import importlib.util
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("picolib_tools_site", ROOT / "tools" / "site.py")
executor = importlib.util.module_from_spec(_spec)   # tools/site.py: not the standard `site`
_spec.loader.exec_module(executor)


def pytest_addoption(parser):
    parser.addoption("--figures", choices=("check", "report", "off"), default="check",
                     help="look at every figure a notebook displays (default: check)")
    parser.addoption("--executed", default=str(executor.EXECUTED),
                     help="folder of the executed notebooks (default: build/executed)")
    parser.addoption("--cell-timeout", type=float, default=300,
                     help="seconds a notebook cell may run before its test fails (default: 300)")


def pytest_configure(config):
    # one id per `pytest` run, shared with its xdist workers: runs.log counts each notebook's
    # executions in this run, and a notebook that failed is not run again for the prose check
    config.picolib_run = getattr(config, "workerinput", {}).get("picolib_run") or uuid.uuid4().hex[:12]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["picolib_run"] = node.config.picolib_run


def executed_folder(config) -> Path:
    return (ROOT / config.getoption("--executed")).resolve()


def executed(config, src: Path) -> Path:
    """The executed copy of `src`, for this run (executing it if it is missing or stale)."""
    return executor.ensure_executed(src, executed_folder(config), config.getoption("--cell-timeout"),
                                    run=config.picolib_run)


class NotebookFailed(Exception):
    pass


class NotebookFile(pytest.File):
    def collect(self):
        yield NotebookRun.from_parent(self, name="run")


class NotebookRun(pytest.Item):
    def runtest(self):
        try:
            path = executed(self.config, self.path)
        except executor.LessonFailed as err:
            raise NotebookFailed(f"{self.path.parent.name}/{err}") from None
        mode = self.config.getoption("--figures")
        found = executor.nbformat.read(path, as_version=4).metadata.get("figures", [])
        if mode == "off" or not found:
            return
        text = f"{self.path.parent.name}/{self.path.name}: a figure a reader cannot see properly:\n" + \
            "\n".join(f"  cell {f['cell']}: {f['problem']}" for f in found)
        if mode == "check":
            raise NotebookFailed(text)
        self.user_properties.append(("figures", text))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, NotebookFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.path.parent.name}/{self.path.name}"


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".ipynb" and file_path.parent.name in ("notebooks", "solutions") \
            and file_path.parent.parent == ROOT:
        return NotebookFile.from_parent(parent, path=file_path)
    return None


def pytest_terminal_summary(terminalreporter, config):
    """The figure reports (`--figures=report`), and how often each notebook ran in this run:
    once, or not at all when its executed copy was current (none may run twice)."""
    if hasattr(config, "workerinput"):
        return
    for report in terminalreporter.getreports("passed"):
        for key, text in getattr(report, "user_properties", []):
            if key == "figures":
                terminalreporter.write_line("[figures] " + text)
    counts = executor.runs(executed_folder(config), config.picolib_run)
    if counts:
        twice = sorted(name for name, n in counts.items() if n > 1)
        terminalreporter.write_line(
            f"notebooks executed in this run: {len(counts)} ({executed_folder(config)}/runs.log, "
            f"run {config.picolib_run}); executed more than once: {', '.join(twice) or 'none'}")
