"""No function of the library is longer than a reader can follow (issue 56): at most
`LIMIT` lines from its `def` to its last line, docstring included. The check itself is tried
on a made-up module with one function over the limit."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 80


def long_functions(source: str, name: str = "<module>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > LIMIT:
                found.append(f"{name}:{node.lineno} {node.name}() is {lines} lines (limit {LIMIT})")
    return found


def test_no_library_function_over_the_limit():
    found = []
    for path in sorted((ROOT / "picolib").rglob("*.py")):
        found += long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert found == []


def test_the_check_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    source = f"def short():\n    return 1\n\n\ndef long():\n{body}\n"
    assert long_functions(source) == [f"<module>:5 long() is {LIMIT + 1} lines (limit {LIMIT})"]
