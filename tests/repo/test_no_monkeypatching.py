"""The library changes no one else's code at run time (issue 56): it uses the hooks PyTorch,
IPython and picolib's own classes document (CONTRIBUTING.md, "No monkeypatching"). Found in
picolib/**/*.py, by reading the code:
- an assignment to, or `del` of, an attribute of an imported name (a module or class:
  `torch.x = ...`, `dist.all_gather = ...`, `FigureCanvasBase.print_figure = ...`,
  `sys.displayhook = ...`), or `setattr`/`delattr` on one;
- a function of its own put on another object's attribute (`wrapper.method = local_def` or a
  lambda): an instance patched in place of the hook its class offers.
`ALLOWED` names the exceptions, each with why. The check is tried on the five patches the
library used to make, and on code it must allow."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches(source: str, name: str = "<module>") -> list[tuple[str, str]]:
    """(what is patched, a line saying where and how) per run-time patch in `source`."""
    tree = ast.parse(source)
    imported = _imported(tree)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            value = getattr(node, "value", None)
            for t in targets:
                if not isinstance(t, ast.Attribute):
                    continue
                base = _root(t)
                own_function = isinstance(value, ast.Lambda) or (
                    isinstance(value, ast.Name) and value.id in functions)
                if base in imported:
                    found.append((ast.unparse(t), f"{name}:{node.lineno} sets {ast.unparse(t)}, "
                                  f"an attribute of the imported {base}"))
                elif own_function and base not in ("self", "cls", None):
                    found.append((ast.unparse(t), f"{name}:{node.lineno} puts a function on "
                                  f"{ast.unparse(t)}: use a hook its class offers"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args
              and _root(node.args[0]) in imported):
            found.append((ast.unparse(node.args[0]), f"{name}:{node.lineno} {node.func.id}("
                          f"{ast.unparse(node.args[0])}, ...) on an imported name"))
    return found


ALLOWED = {   # (file, what is set): why no documented hook replaces it
    ("picolib/memory.py", "opt.zero_grad"):
        "torch.optim.Optimizer has no zero_grad hook; MemoryTrace wraps its own optimizer's on "
        "the instance inside its block and removes it on exit (tests/lib/test_memory.py)",
    ("picolib/rank.py", "sys.stdout"):
        "a rank's own forked process sends its prints to the caller: Python's documented way "
        "to redirect its standard streams, for the life of that process",
    ("picolib/rank.py", "sys.stderr"): "as sys.stdout",
}


def test_the_library_patches_nothing():
    found = []
    for path in sorted((ROOT / "picolib").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        found += [line for target, line in patches(path.read_text(encoding="utf-8"), where)
                  if (where, target) not in ALLOWED]
    assert found == [], "\n".join(found)


PLANTED = {   # the patches picolib made before issue 56, each one line of its own
    "figure_check": "from matplotlib.backend_bases import FigureCanvasBase\n"
                    "def print_figure(self): pass\nFigureCanvasBase.print_figure = print_figure\n",
    "tryit": "import sys\ndef f(): sys.displayhook = print\n",
    "grading 03": "import torch.distributed as dist\nfor n in ['all_gather']:\n"
                  "    setattr(dist, n, print)\n",
    "dry_run": "def run(wrappers):\n    for w in wrappers:\n        def sampled(on): pass\n"
               "        w.set_requires_gradient_sync = sampled\n",
    "a torch class": "import torch\ntorch.nn.Module.__call__ = lambda self: None\n",
}


def test_the_check_finds_each_old_patch():
    for what, source in PLANTED.items():
        assert len(patches(source)) == 1, (what, patches(source))


def test_the_check_allows_ordinary_code():
    source = ("import torch\nfrom torch import nn\n"
              "class Net(nn.Module):\n"
              "    def __init__(self):\n        super().__init__()\n        self.forward_hook = None\n"
              "def swap(module, child, new):\n    setattr(module, child, new)\n"
              "def f(ctx, t):\n    ctx.saved = t\n    def check(): pass\n    check.marked = True\n")
    assert patches(source) == []
