"""picolib's import graph (issue 48): the modules form layers — no module imports, at any
depth or inside a function, a module that imports it back — and no module reaches into
another module's private names (`from X import _name`, `module._name`). Both are read from
the source (ast), so a test here can fail on a planted case."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    """picolib/grading/lesson03.py → picolib.grading.lesson03; picolib/x/__init__.py → picolib.x."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path, package: str = "picolib") -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def imports(root: Path, package: str = "picolib") -> dict[str, dict[str, list]]:
    """{module: {imported module of the package: [(line, imported names or None)]}}, every
    import statement counted (top level or inside a function)."""
    mods = modules(root, package)
    out: dict[str, dict[str, list]] = {m: {} for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(name, path, node)
                for a in node.names:          # `from . import comm`: the module comm
                    sub = f"{base}.{a.name}"
                    targets.append((sub, None) if sub in mods else (base, a.name))
            for target, what in targets:
                if target in mods and target != name:
                    out[name].setdefault(target, []).append((node.lineno, what))
    return out


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(root: Path, package: str = "picolib") -> list[str]:
    """`from X import _name` and `X._name` where X is another module of the package.
    A private *module* (grading/_core.py) is its own package's: importing its public names
    from inside that package is not a reach."""
    mods = modules(root, package)
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        bound = {}                                   # local name → module of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _base(name, path, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        bound[a.asname or a.name] = sub
                    elif base in mods and base != name and _private(a.name):
                        found.append(f"{path.relative_to(root)}:{node.lineno} from {base} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and isinstance(node.value, ast.Name) and bound.get(node.value.id, name) != name):
                found.append(f"{path.relative_to(root)}:{node.lineno} "
                             f"{bound[node.value.id]}.{node.attr}")
        for node in ast.walk(tree):              # mock.patch.object(module, "_name")
            if (isinstance(node, ast.Call) and len(node.args) >= 2
                    and isinstance(node.args[0], ast.Name) and bound.get(node.args[0].id, name) != name
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                    and _private(node.args[1].value)):
                found.append(f"{path.relative_to(root)}:{node.lineno} "
                             f"{bound[node.args[0].id]}.{node.args[1].value} (by name)")
    return found


def test_picolib_imports_form_no_circle():
    assert cycles(imports(ROOT)) == []


def test_no_module_reaches_into_another_modules_private_names():
    assert private_reaches(ROOT) == []


def _plant(tmp_path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "picolib" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_a_planted_circle_is_found(tmp_path):
    """a → b at the top, b → c inside a function, c → a: one circle of three; d only imports."""
    root = _plant(tmp_path, {
        "__init__.py": "", "a.py": "from . import b\n",
        "b.py": "def f():\n    from .c import g\n    return g\n",
        "c.py": "from picolib.a import x\n", "d.py": "from .a import b\n"})
    assert cycles(imports(root)) == [["picolib.a", "picolib.b", "picolib.c"]]
    (root / "picolib" / "c.py").write_text("x = 1\n")
    assert cycles(imports(root)) == []


def test_planted_private_reaches_are_found(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "", "a.py": "_x = 1\ny = 2\n",
        "b.py": "from .a import _x, y\nfrom . import a\nz = a._x + a.y\n",
        "c.py": "from unittest import mock\nfrom . import a as m\nmock.patch.object(m, '_x', 3)\n",
        "pkg/__init__.py": "", "pkg/_core.py": "def f():\n    pass\n",
        "pkg/one.py": "from ._core import f\nfrom . import _core\n_core.f()\n"})
    assert private_reaches(root) == [
        "picolib/b.py:1 from picolib.a import _x", "picolib/b.py:3 picolib.a._x",
        "picolib/c.py:3 picolib.a._x (by name)"]
