"""What a lesson shows of the library's own code: the `show(...)` calls of its code cells.

    python tools/shown_core.py notebooks/03_zero.ipynb [...]

A lesson that imports `show` from `picolib.source` shows code with it. Each argument of a `show(...)` call is resolved the way the notebook would resolve it: the
lesson's import statements are run (nothing else of the lesson is) and the argument, a name or
a dotted name, is evaluated against them. For every shown object: its qualified name, its file
and lines, its non-blank lines, and whether the lesson also runs it (its name, or its class's,
appears in the lesson's code outside the `show` calls). Used by tests/repo/test_shown_core.py
and tools/reading_time.py.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shown:
    expr: str           # as the lesson writes it: ZeRO.step
    qualname: str       # module-qualified: picolib.zero.ZeRO.step
    path: str           # picolib/zero.py
    first: int
    last: int
    lines: int          # non-blank lines shown
    cell: int           # index of the code cell that shows it


def _code_cells(nb: dict):
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            # IPython magics and shell lines are not Python
            src = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
            yield index, src


def _parse(src: str):
    try:
        return ast.parse(src)
    except SyntaxError:
        return None


def show_calls(nb: dict) -> list[tuple[int, ast.Call, str]]:
    """(cell index, call, the cell's source) of every `show(...)` call in the code cells."""
    calls = []
    for index, src in _code_cells(nb):
        tree = _parse(src)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "show":
                calls.append((index, node, src))
    return calls


def _namespace(nb: dict) -> dict:
    """The lesson's imports, run in a fresh namespace (a failing optional import is left out)."""
    ns: dict = {}
    for _, src in _code_cells(nb):
        tree = _parse(src)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), "<lesson imports>", "exec"), ns)
                except ImportError:
                    pass
    return ns


def shown(path: str | Path) -> list[Shown]:
    """Every object the lesson at `path` shows, in order."""
    from picolib.source import source_of
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    calls = show_calls(nb)
    if not calls:
        return []
    ns = _namespace(nb)
    from picolib.source import show
    if ns.get("show") is not show:          # a lesson's own `show` (07 has one) is not this
        return []
    found = []
    for index, call, _ in calls:
        for arg in call.args:
            expr = ast.unparse(arg)
            if not re.fullmatch(r"[A-Za-z_][\w.]*", expr):
                raise ValueError(f"{Path(path).name}, cell {index}: show({expr}) — pass a name or a dotted name")
            try:
                obj = eval(expr, dict(ns))
            except (NameError, AttributeError) as e:
                raise ValueError(f"{Path(path).name}, cell {index}: show({expr}) does not resolve: {e}") from None
            text, file, first, last = source_of(obj)
            target = obj.fget if isinstance(obj, property) else obj
            qual = f"{target.__module__}.{target.__qualname__}"
            found.append(Shown(expr, qual, file, first, last,
                               sum(1 for line in text.splitlines() if line.strip()), index))
    return found


def run_elsewhere(path: str | Path, item: Shown) -> bool:
    """Whether the lesson's code, outside its `show` calls, names the shown function or its class
    (the lesson runs what it shows, or a method of the class it shows)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    names = set(item.qualname.split(".")[-2:])
    names.discard("__init__")
    used = set()
    for _, src in _code_cells(nb):
        tree = _parse(src)
        if tree is None:
            continue
        skip = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "show":
                skip.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
    return bool(names & used)


def main(paths: list[str]) -> None:
    for path in paths:
        items = shown(path)
        total = sum(s.lines for s in items)
        print(f"{Path(path).name}: {len(items)} shown, {total} lines")
        for s in items:
            print(f"  cell {s.cell:3d}  {s.qualname:60} {s.path}:{s.first}-{s.last} ({s.lines} lines)"
                  f"{'' if run_elsewhere(path, s) else '  NOT RUN BY THE LESSON'}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
