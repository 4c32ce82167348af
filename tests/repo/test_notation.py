"""One letter, one meaning: every lesson's maths and symbol tables use the course notation
(docs/glossary.md, ## notation), as tools/notation.py reads them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import notation  # noqa: E402

LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_the_lesson_uses_the_course_notation(lesson):
    problems = notation.check_notebook(lesson)
    assert not problems, "\n".join(map(str, problems))


def test_the_course_table_has_one_row_per_symbol_and_key_words():
    symbols, ops = notation.course_table()
    for letter in ("N", "Ψ", "B", "b", "s", "h", "a", "L", "t", "p", "m", "v", "k", "E", "α", "β", "C"):
        assert letter in symbols, letter
    assert {"F", "B", "W", "BW"} <= set(ops)
    doubled = notation.GLOSSARY.read_text(encoding="utf-8").replace(
        "| k | **experts**", "| k | **micro-batches** again |\n| k | **experts**")
    with pytest.raises(SystemExit, match="'k' has two rows"):
        notation.course_table(doubled)


def notebook(tmp_path: Path, name: str, cells: list[tuple[str, str]]) -> Path:
    nb = {"cells": [{"cell_type": kind, "metadata": {}, "source": source.splitlines(True),
                     **({"outputs": [], "execution_count": None} if kind == "code" else {})}
                    for kind, source in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / f"{name}.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def found(path: Path) -> set[tuple[int, str]]:
    return {(p.cell, p.symbol) for p in notation.check_notebook(path)}


def test_a_second_meaning_of_a_letter_in_a_symbol_table_is_reported(tmp_path):
    lesson = notebook(tmp_path, "98_planted", [
        ("markdown", "| symbol | meaning |\n|---|---|\n| $k$ | experts each token is routed to (top-k) |\n"
                     "| $N$ | ranks in the group |\n"),
        ("markdown", "| symbol | meaning | symbol | meaning |\n|---|---|---|---|\n"
                     "| b | micro-batch size | k | micro-batches of gradient accumulation |\n"),
    ])
    assert found(lesson) == {(1, "k")}
    line = str(notation.check_notebook(lesson)[0])
    assert line.startswith("98_planted cell 1: symbol 'k': declared as 'micro-batches"), line


def test_several_symbols_in_a_row_are_matched_to_their_own_meanings(tmp_path):
    right = notebook(tmp_path, "97_right", [("markdown", "| symbol | meaning |\n|---|---|\n"
                                                         "| $b$, $s$ | micro-batch size (sequences), sequence length |\n")])
    swapped = notebook(tmp_path, "96_swapped", [("markdown", "| symbol | meaning |\n|---|---|\n"
                                                             "| $s$, $b$ | micro-batch size (sequences), sequence length |\n")])
    assert found(right) == set()
    assert found(swapped) == {(0, "s"), (0, "b")}


def test_a_symbol_missing_from_the_course_table_is_reported_in_maths_and_in_say(tmp_path):
    lesson = notebook(tmp_path, "95_missing", [
        ("markdown", "The ring sends $2(N-1)B/N$ bytes; with $\\zeta$ and $q_{\\rm extra}$ it is $$\\zeta B$$."),
        ("code", 'from picolib.prose import say\nx = 3\nsay(f"so $Z = {x}\\\\Psi$ bytes, $sbh$ elements")'),
        ("markdown", "| symbol | meaning |\n|---|---|\n| $Z$ | a new letter |\n| bubble | a term, skipped |\n"),
    ])
    assert found(lesson) == {(0, "ζ"), (0, "q_extra"), (1, "Z"), (2, "Z")}   # Z: in no row (G is lesson 00's)


def test_schedule_ops_are_names_not_symbols(tmp_path):
    ops = notebook(tmp_path, "94_ops", [("markdown", "| symbol | meaning |\n|---|---|\n"
                                                     "| **B** | the input-gradient half of BW |\n"
                                                     "| **W** | the weight-gradient half |\n"
                                                     "| $B$ | the bytes of a buffer |\n")])
    assert found(ops) == set()
    confused = notebook(tmp_path, "93_confused", [("markdown", "| symbol | meaning |\n|---|---|\n"
                                                               "| B | the input-gradient half of a backward |\n"
                                                               "| **W** | memory bandwidth |\n")])
    assert found(confused) == {(0, "B"), (0, "W")}


def test_maths_is_read_as_letters_with_subscripts():
    names = {"cf", "ep", "dp"}
    assert notation.symbols_in(r"2\,sbh\,\Psi / t", names) == ["s", "b", "h", "Ψ", "t"]
    assert notation.symbols_in(r"QK^\top/\sqrt{d} + \text{bytes} + \log x_i", names) == ["Q", "K", "d", "x"]
    assert notation.symbols_in(r"\lceil cf\cdot Tk/E\rceil, E/ep", names) == ["cf", "T", "k", "E", "E", "ep"]
    assert notation.symbols_in(r"B_{\rm mem} + W_{QKV} + \hat m + \Psi'", names) == ["B_mem", "W_QKV", "m̂", "Ψ"]
