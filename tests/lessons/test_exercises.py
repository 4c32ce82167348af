"""The exercise pipeline: exercises/ is generated from solutions/ and kept in sync; the
generated exercises fail every check; notebooks are stored without outputs."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_exercises  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_strip_solution_replaces_the_block_and_keeps_indentation():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\nprint(1)"
    assert make_exercises.strip_solution(src) == (
        "def f(x):\n    raise NotImplementedError(\"exercise: write this part\")\nprint(1)")
    with pytest.raises(ValueError):
        make_exercises.strip_solution("### BEGIN SOLUTION\nx = 1")


def test_exercises_are_in_sync_with_solutions():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_exercises.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("folder", ["notebooks", "solutions", "exercises"])
def test_notebooks_are_stored_without_outputs(folder):
    for path in (ROOT / folder).glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert not cell["outputs"] and cell["execution_count"] is None, path.name


def check_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "check_" in c.source
            and "import" not in c.source.split("check_")[0].split("\n")[-1]]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solutions_hold_at_least_three_exercises(solution):
    nb = nbformat.read(solution, as_version=4)
    assert len(check_cells(nb)) >= 3
    assert sum(c.source.count("### BEGIN SOLUTION") for c in nb.cells) >= 3


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_unsolved_exercises_fail_every_check(solution):
    """Run the generated exercise notebook, continuing past errors: every check cell must fail."""
    nb = nbformat.read(ROOT / "exercises" / solution.name, as_version=4)
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "exercises")}}).execute()
    for i in check_cells(nb):
        errors = [o for o in nb.cells[i].outputs if o.output_type == "error"]
        assert errors, f"check cell {i} of {solution.name} passed without a solution"
        assert errors[0].ename in ("ExerciseFailed", "NotImplementedError", "AssertionError"), \
            (errors[0].ename, errors[0].evalue)


def test_every_check_of_every_lesson_is_exported():
    """The export list of picolib.grading is explicit; a check added to a lesson module but
    not to the list would be missing from notebooks."""
    import importlib
    import pkgutil

    import picolib.grading as grading
    defined = set()
    for info in pkgutil.iter_modules(grading.__path__):
        if info.name.startswith("lesson"):
            module = importlib.import_module(f"picolib.grading.{info.name}")
            defined |= {n for n in vars(module) if n.startswith("check_")}
    assert defined and defined <= set(grading.__all__)
    assert all(callable(getattr(grading, n)) for n in grading.__all__)
