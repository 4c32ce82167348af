"""The repository stands alone: no lesson, solution, exercise or page sends a learner to
material outside it, and every lesson has its learning goals, a "try it" cell and its
takeaways."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb"),
                *ROOT.glob("exercises/*.ipynb"), ROOT / "README.md", ROOT / "CONTRIBUTING.md",
                *ROOT.glob("docs/*.md")])
OUTSIDE = re.compile(r"seeds/|\b[Ss]eed 0\d|\b[Tt]he notes?\b|CLAIMS\.md|\.\./shared|/work/")


def _text(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_to_material_outside_the_repository(path):
    hits = [m.group(0) for m in OUTSIDE.finditer(_text(path))]
    assert not hits, f"{path.name} refers outside the repository: {sorted(set(hits))}"


@pytest.mark.parametrize("path", sorted(ROOT.glob("notebooks/*.ipynb")), ids=lambda p: p.name)
def test_every_lesson_has_goals_a_try_it_cell_and_takeaways(path):
    cells = json.loads(path.read_text())["cells"]
    md = ["".join(c["source"]).lower() for c in cells if c["cell_type"] == "markdown"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert "goal" in md[0] or "you will" in md[0], "the first cell states the learning goals"
    assert any("knobs(" in c for c in code), "a try-it cell with knobs"
    assert any("takeaway" in m for m in md[-4:]), "a takeaways cell at the end (Next, a summary, the exercises may follow)"
