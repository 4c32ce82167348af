"""No lesson over about 75 minutes for a first reading (issue 46), by tools/reading_time.py's
one estimate; the estimator itself is checked on made-up lessons counted by hand."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import reading_time  # noqa: E402

LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
LIMIT_MIN = 75


def _lesson(tmp_path, cells) -> str:
    path = tmp_path / "99_made_up.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return str(path)


def md(text):
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def code(text):
    return {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": text}


def test_the_estimate_counts_prose_code_and_figures(tmp_path):
    words = " ".join(["word"] * 260)                                    # 2 minutes of prose
    body = "\n".join(f"x{i} = {i}" for i in range(59)) + "\n\n"         # 10 minutes of code
    cells = [md(words), code(body + "fig, ax = plt.subplots()\nplt.show()"),
             code('say(f"""' + " ".join(["said"] * 130) + ' {x0:.2f}""")'),   # a say() is prose: 131 words
             code("plot_loss(x0)")]                                     # a figure helper: one figure
    e = reading_time.estimate(_lesson(tmp_path, cells))
    assert (e["words"], e["lines"], e["figures"]) == (260 + 131, 59 + 2 + 1, 2)
    assert e["minutes"] == pytest.approx(391 / 130 + 62 / 5.9 + 2 + 1)


def test_a_lesson_grown_past_the_limit_is_reported(tmp_path):
    cells = json.loads(LESSONS[0].read_text(encoding="utf-8"))["cells"]
    grown = cells + [md(" ".join(["more"] * 130 * LIMIT_MIN))]
    assert reading_time.estimate(_lesson(tmp_path, grown))["minutes"] > LIMIT_MIN


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_reads_in_about_75_minutes(lesson):
    e = reading_time.estimate(str(lesson))
    assert e["minutes"] <= LIMIT_MIN, (
        f"{lesson.name}: about {e['minutes']:.0f} min for a first reading ({e['words']} words, {e['lines']} code "
        f"lines, {e['figures']} figures); split or trim it (issue 46: ≤ {LIMIT_MIN})")
