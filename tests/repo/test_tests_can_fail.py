"""Every test can fail: a scan of tests/**/*.py (ast) for a test function that checks nothing,
and for asserts that compare a thing with itself.

A test checks something when its body (nested functions included: a rank's function asserts
inside `run`) has an `assert`, a `raise`, a `pytest.raises`/`warns`/`fail`, a call of a
function named `assert…` (`torch.testing.assert_close`, `np.testing.assert_allclose`), or of
one whose job is to raise on a wrong value — `check_…`, `check`, `validate…`
(`picolib.grading.check_*` raises when an answer is wrong, `compose.check_config` on a bad
configuration, the schedules' `validate` on a bad schedule) — or `subprocess.run(check=True)`,
or uses a function of its own module, `tests/helpers.py` or a conftest
that does one of these (called or handed to `run`), or a fixture that does.

An assert is flagged when it compares (==, is, <=, >=, `pytest.approx`, `torch.equal`,
`assert_close`…) two sides that are the same expression: a name or constant with itself, two
constants, or — best effort — an expression with the same expression recomputed, after each
name is replaced by the one value the test assigned it (`want = a * b; assert want == a * b`).
Two equal calls are allowed where they read the world or a seed (a call without arguments, a
clock, a random draw, `seed=`): that checks state or determinism (same seed, same weights),
which can fail."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAISING = {"raises", "warns", "fail", "deprecated_call"}          # pytest.<these>
SAME = (ast.Eq, ast.Is, ast.LtE, ast.GtE)
PURE = {"abs", "divmod", "float", "int", "len", "list", "max", "min", "pow", "range", "round",
        "sorted", "str", "sum", "tuple"}
READS = ("rand", "random", "time", "perf_counter", "pid", "seed")
PAIR_CALLS = {"equal", "allclose", "isclose", "assert_close", "assert_allclose", "assert_equal",
              "assert_array_equal", "assert_almost_equal", "assert_array_almost_equal"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    test: str
    why: str

    def __str__(self):
        return f"{self.path}:{self.line} {self.test}: {self.why}"


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _checks_directly(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, (ast.Assert, ast.Raise)):
            return True
        if isinstance(n, ast.Call):
            name = _name(n.func)
            if name.startswith(("assert", "check_", "validate")) or name == "check" or (
                    name in RAISING and isinstance(n.func, ast.Attribute)
                    and _name(n.func.value) == "pytest"):
                return True
            if any(k.arg == "check" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in n.keywords):
                return True
    return False


def _used_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def asserting_helpers(trees: list[ast.Module]) -> set[str]:
    """Names of the functions (module level or in a class) that check something, directly or
    through another such function, anywhere in `trees`."""
    defs = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, []).append(node)
    found = {name for name, nodes in defs.items() if any(_checks_directly(n) for n in nodes)}
    while True:
        more = {name for name, nodes in defs.items() if name not in found
                and any(_used_names(n) & found for n in nodes)}
        if not more:
            return found
        found |= more


def _args(test: ast.FunctionDef) -> set[str]:
    a = test.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def _assignments(test: ast.FunctionDef) -> dict[str, ast.expr]:
    """name -> value for the names the test assigns exactly once, by a plain `name = value`,
    and never hands to a call or reaches into (`shown.append`: it may change)."""
    values, count = {}, {}
    for n in ast.walk(test):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
            n, (ast.AugAssign, ast.AnnAssign, ast.For, ast.NamedExpr)) else []
        for t in targets:
            for name in (x.id for x in ast.walk(t) if isinstance(x, ast.Name)):
                count[name] = count.get(name, 0) + 1
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(t, ast.Name):
                    values[name] = n.value
    handed = {x.id for n in ast.walk(test) if isinstance(n, ast.Call)
              for a in [*n.args, *(k.value for k in n.keywords)] for x in [a] if isinstance(x, ast.Name)}
    handed |= {n.value.id for n in ast.walk(test)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    return {k: v for k, v in values.items() if count[k] == 1 and k not in handed}


class _Inline(ast.NodeTransformer):
    def __init__(self, values):
        self.values, self.depth = values, 0

    def visit_Name(self, node):
        if node.id in self.values and self.depth < 8:
            self.depth += 1
            out = self.visit(ast.parse(ast.unparse(self.values[node.id]), mode="eval").body)
            self.depth -= 1
            return out
        return node


def _unwrap(e: ast.expr) -> ast.expr:
    if isinstance(e, ast.Call) and _name(e.func) == "approx" and e.args:
        return e.args[0]
    return e


def _inline(e: ast.expr, values: dict[str, ast.expr]) -> ast.expr:
    return _Inline(values).visit(ast.parse(ast.unparse(e), mode="eval").body)


def _same(a: ast.expr, b: ast.expr, values: dict[str, ast.expr]) -> str | None:
    a, b = _unwrap(a), _unwrap(b)
    if isinstance(a, ast.Constant) and isinstance(b, ast.Constant):
        return "compares two constants"
    if ast.dump(a) == ast.dump(b) and not any(isinstance(n, ast.Call) for n in ast.walk(a)):
        return f"compares {ast.unparse(a)!r} with itself"
    whole = _inline(a, values)
    if ast.dump(whole) != ast.dump(_inline(b, values)) or _may_differ(whole):
        return None
    return f"compares {ast.unparse(a)!r} with {ast.unparse(b)!r}, the same expression"


def _may_differ(e: ast.expr) -> bool:
    """Whether two evaluations of `e` could differ: it reads the world (a call without
    arguments, `child_pids()`; a clock; a random draw) or is seeded (`seed=...`): two equal
    calls of those are a check of state or of determinism, which can fail."""
    for n in ast.walk(e):
        if isinstance(n, ast.Call) and not (_name(n.func) in PURE or (
                isinstance(n.func, ast.Attribute) and _name(n.func.value) == "math")):
            if not n.args and not n.keywords or any(w in _name(n.func).lower() for w in READS) or \
                    any("seed" in ast.unparse(a) for a in [*n.args, *n.keywords]):
                return True
    return False


def _self_comparisons(test: ast.FunctionDef) -> list[tuple[int, str]]:
    values, out = _assignments(test), []
    for n in ast.walk(test):
        pairs = []
        if isinstance(n, ast.Assert) and isinstance(n.test, ast.Compare):
            sides = [n.test.left, *n.test.comparators]
            pairs = [(l, r) for l, r, op in zip(sides, sides[1:], n.test.ops) if isinstance(op, SAME)]
        elif isinstance(n, ast.Call) and _name(n.func) in PAIR_CALLS and len(n.args) >= 2:
            pairs = [(n.args[0], n.args[1])]
        for left, right in pairs:
            why = _same(left, right, values)
            if why:
                out.append((n.lineno, why))
    return out


def _fixtures(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "fixture" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = node
    return out


def _tests(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            yield from (m for m in node.body if isinstance(m, ast.FunctionDef) and m.name.startswith("test"))


def scan(files: dict[str, str], shared: list[str] = ()) -> list[Finding]:
    """Findings in `files` ({path: source}); `shared` are sources whose helpers and fixtures
    every file may use (tests/helpers.py, the conftests)."""
    shared_trees = [ast.parse(s) for s in shared]
    shared_fixtures = {k: v for t in shared_trees for k, v in _fixtures(t).items()}
    out = []
    for path, source in sorted(files.items()):
        tree = ast.parse(source)
        helpers = asserting_helpers([tree, *shared_trees])
        fixtures = {**shared_fixtures, **_fixtures(tree)}
        for test in _tests(tree):
            body = ast.Module(body=test.body, type_ignores=[])
            checked = _checks_directly(body) or bool(_used_names(body) & helpers) or any(
                a in fixtures and (_checks_directly(fixtures[a]) or _used_names(fixtures[a]) & helpers)
                for a in _args(test))
            if not checked:
                out.append(Finding(path, test.lineno, test.name, "asserts nothing that can fail"))
            out += [Finding(path, line, test.name, why) for line, why in _self_comparisons(test)]
    return out


def _suite() -> tuple[dict[str, str], list[str]]:
    files = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
             for p in sorted((ROOT / "tests").rglob("*.py"))}
    shared = [s for p, s in files.items() if p.endswith(("conftest.py", "helpers.py"))]
    shared.append((ROOT / "conftest.py").read_text(encoding="utf-8"))
    return files, shared


def test_every_test_in_the_suite_can_fail():
    files, shared = _suite()
    found = scan(files, shared)
    assert not found, f"{len(found)} test(s) that cannot fail:\n" + "\n".join(f"  {f}" for f in found)


PLANTED = '''
import pytest, torch
from picolib.launch import run

def _rank_checks(x):
    assert x.sum() > 0

def _wraps_a_check(x):
    _rank_checks(x)

def test_runs_and_looks_at_nothing():                  # 1: no assert
    out = run(lambda: 1, 2)
    print(out)

def test_name_with_itself():                           # 2
    x = torch.ones(3)
    assert x == x

def test_constant_with_constant():                     # 3
    assert 4 == 4

def test_formula_recomputed():                         # 4
    n, b = 4, 1024
    want = 2 * (n - 1) / n * b
    assert want == pytest.approx(2 * (n - 1) / n * b)

def test_assert_close_with_itself():                   # 5
    t = torch.randn(3)
    torch.testing.assert_close(t, t)

def test_result_via_name_and_recomputed():             # 6
    got = sum(range(10))
    assert got == sum(range(10))

def test_formula_compared_with_itself():              # 7
    want = ring_bytes(4, 1024)
    assert want == pytest.approx(ring_bytes(4, 1024))

def test_fine_state_before_and_after():
    before = child_pids()
    run(_rank_checks, 2, torch.ones(2))
    assert child_pids() == before

def test_fine_helper_hands_a_checking_function_to_run():
    run(_wraps_a_check, 2, torch.ones(2))

def test_fine_raises():
    with pytest.raises(ValueError):
        int("x")

def test_fine_same_seed_same_numbers():
    torch.manual_seed(0)
    first = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(first, torch.rand(3))
'''


def test_planted_cases_are_reported():
    found = scan({"planted.py": PLANTED})
    by_test = {f.test: f.why for f in found}
    assert by_test.pop("test_runs_and_looks_at_nothing") == "asserts nothing that can fail"
    assert "itself" in by_test.pop("test_name_with_itself")
    assert by_test.pop("test_constant_with_constant") == "compares two constants"
    assert "the same expression" in by_test.pop("test_formula_recomputed")
    assert "itself" in by_test.pop("test_assert_close_with_itself")
    assert "the same expression" in by_test.pop("test_result_via_name_and_recomputed")
    assert "the same expression" in by_test.pop("test_formula_compared_with_itself")
    assert by_test == {}, by_test          # the four fine tests are not reported
