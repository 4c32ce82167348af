"""Every number a lesson's text states is bound to the lesson (tools/prose_numbers.py, issue 44).

The checks read what each cell printed from the lesson's executed copy in build/executed/
(tools/site.py's executor: under `make test` the copy the lesson's own test made in the same
run; a missing or stale copy is made first, under the executor's lock).

The rules themselves are tested on small made-up cells first, then on the real lessons: each
lesson must have no unbound number, and each drift a reader found (issue 44's examples) must be
reported again if it is put back into the lesson it came from. A number that only a literal of
equal value in the code matches is an advisory, counted, not a failure.
"""
from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import prose_numbers as pn  # noqa: E402

LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
SOURCES = ["Korthikanti et al.", "H100 datasheet"]


def md(text):
    return {"cell_type": "markdown", "source": text, "metadata": {}}


def code(text):
    return {"cell_type": "code", "source": text, "metadata": {}, "outputs": []}


def unbound(cells, outputs=None):
    return [u.text for u in pn.check(Path("99_made_up.ipynb"), outputs or {}, sources=SOURCES, cells=cells)]


def advisories(cells, outputs=None):
    tally = pn.Tally()
    pn.check(Path("99_made_up.ipynb"), outputs or {}, sources=SOURCES, cells=cells, tally=tally)
    return [u.text for u in tally.advisories]


# --- the rules, on made-up cells ----------------------------------------------------------------

def test_a_printed_number_binds_and_a_retyped_one_does_not():
    cells = [md("## 1 · A"), code("print(ratio)"), md("The step takes 1.23× as long.")]
    assert unbound(cells, {1: "1.2345\n"}) == []
    cells[2] = md("The step takes 1.25× as long.")
    assert unbound(cells, {1: "1.2345\n"}) == ["1.25×"]


def test_only_the_same_section_binds():
    cells = [md("## 1 · A"), code("print(x)"), md("## 2 · B"), md("It gives 0.173 s.")]
    assert unbound(cells, {1: "0.173 s"}) == ["0.173"]
    cells[3] = md("It gives 0.173 s (§1).")
    assert unbound(cells, {1: "0.173 s"}) == []


def test_precision_about_sign_and_percent():
    cells = [md("## 1 · A"), code("print(change)"), md("SP costs −3 %, about 30 %, and 1.7 here.")]
    assert unbound(cells, {1: "-0.031 -0.29 1.71"}) == []
    cells[2] = md("SP costs −2 %, about 30 %, and about 1.5 here.")
    assert unbound(cells, {1: "-0.031 -0.29 1.71"}) == ["−2 %", "about 1.5"]


def test_a_unit_binds_only_its_own_kind():
    cells = [md("## 1 · A"), code("print(t)"), md("It takes 9 ms.")]
    assert unbound(cells, {1: "9 ms"}) == []
    assert unbound(cells, {1: "9 GB"}) == ["9"]
    assert unbound(cells, {1: "8.9%"}) == ["9"]


def test_a_unit_binds_the_same_quantity_in_base_units():
    cells = [md("## 1 · A"), code("print(rate, spine)"), md("At 400 TFLOP/s and 50 GB/s; 45 TFLOP/s.")]
    assert unbound(cells, {1: "400000000000000.0 50000000000.0"}) == ["45"]


def test_a_code_literal_alone_is_an_advisory_and_a_comment_binds_nothing():
    cells = [md("## 1 · A"), code("gpus = 640  # 2048 would not fit\nassert ratio < 1.5"),
             md("On 640 GPUs the gain stays under 1.5; 2048 would not fit.")]
    assert unbound(cells) == ["2048"]
    assert advisories(cells) == ["640", "1.5"]
    assert advisories(cells, {1: "gpus 640"}) == ["1.5"]          # printed: bound, no advisory
    cells[1] = code("gpus = 640\nassert ratio < 3.3")
    cells[2] = md("On 640 GPUs the gain is about 3×.")              # a coincidence of value
    assert unbound(cells) == [] and advisories(cells) == ["640", "about 3×"]


def test_the_tally_counts_each_way_a_number_is_bound():
    cells = [md("## 1 · A"), code("print(t)\nn = 640"),
             md("It takes 9 ms on 640 GPUs. The H100 datasheet gives 989 TFLOP/s. And 12.5 is new.")]
    tally = pn.Tally()
    found = pn.check(Path("99_made_up.ipynb"), {1: "9 ms"}, sources=SOURCES, cells=cells, tally=tally)
    assert [u.text for u in found] == ["12.5"]
    assert (tally.output, tally.citation, tally.literal, tally.unbound) == (1, 1, 1, 1), tally


def test_citations_quotes_and_structure():
    cells = [md("## 1 · A"),
             md("The H100 datasheet gives 989 TFLOP/s. Korthikanti et al. count $sbh(34 + 5as/h)$.\n\n"
                "Notes say \"the spine carries 25 GB/s\": not so.\n\n"
                "ZeRO-3 on 8 H100s in fp32 and 1F1B, Llama-3-70B, §6 and lesson 05, a 2-core CPU "
                "(Korthikanti et al. 2022), Table 4.\n\n"
                "An unnamed blog gives 989 TFLOP/s.")]
    assert unbound(cells) == ["989"]


def test_vague_amounts_are_flagged():
    cells = [md("## 1 · A"), md("The slicer gains a few per cent, below the noise. "
                                "SwiGLU gains about what its bytes predict.")]
    assert unbound(cells) == ["a few per cent", "below the noise", "about what its bytes predict"]


def test_a_summary_names_its_section():
    cells = [md("## 1 · A"), code("print(x)"), md("## Takeaways\n\n- TP16 loses 30 % (§1).\n- And 0.49×.")]
    assert unbound(cells, {1: "-30%, 0.49"}) == ["0.49×"]
    cells[2] = md("## Takeaways\n\n- TP16 loses 78 % (§1).")
    assert unbound(cells, {1: "-30%, 0.49"}) == ["78 %"]


def test_rendered_prose_is_checked_for_what_it_types_by_hand():
    cells = [md("## 1 · A"), code("x = 0.3\nsay(f'SP costs {x:.0%}, TP16 loses 78 %.')")]
    said = [{"output_type": "display_data",
             "data": {"text/markdown": "SP costs 30%, TP16 loses 78 %.", "text/plain": "<Markdown>"}}]
    printed, _, rendered = pn.output_text(said).partition(pn.RENDERED)
    assert printed == "" and "78 %" in rendered  # what say() shows is prose: in its lesson it binds nothing
    assert unbound(cells, {1: pn.output_text(said)}) == ["78 %"]


# --- the real lessons ---------------------------------------------------------------------------

def _outputs(config, lesson: Path) -> dict[int, str]:
    return pn.executed_outputs(lesson, into=Path(config.getoption("--executed")), run=config.picolib_run)


def _own_outputs(config, lesson: Path) -> dict[int, str]:
    try:
        return _outputs(config, lesson)
    except pn._executor().LessonFailed as err:
        pytest.fail(f"{lesson.name} did not run, so its prose cannot be checked: {str(err)[:300]}", pytrace=False)


_SECTIONS: dict[str, dict[str, list]] = {}


def _sections(config) -> dict[str, list]:
    """Every lesson's sections with what it printed, for a sentence that names another lesson
    (read once per run: the executed copies do not change within it). A lesson whose run failed
    is left out: its own test names the failure, the other lessons' checks go on."""
    if config.picolib_run not in _SECTIONS:
        found = {}
        for lesson in LESSONS:
            try:
                outputs = _outputs(config, lesson)
            except pn._executor().LessonFailed:
                continue
            found[lesson.stem] = pn.sections_of(json.loads(lesson.read_text(encoding="utf-8"))["cells"], outputs)
        _SECTIONS[config.picolib_run] = found
    return _SECTIONS[config.picolib_run]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_states_only_bound_numbers(lesson, request):
    outputs = _own_outputs(request.config, lesson)
    tally = pn.Tally()
    found = pn.check(lesson, outputs, other_lessons=_sections(request.config), tally=tally)
    print(f"{lesson.stem}: {pn.count_numbers(lesson)} numbers in the prose: {tally}")
    assert not found, f"{len(found)} number(s) in {lesson.name}'s text are not bound to the lesson:\n" + \
        "\n".join(f"  {u}" for u in found)


# Each drift issue 44 lists, as a reader found it: (lesson, where it stood, the old text).
# `where` is the section it was in ("6" for "## 6 · ...") or "Takeaways". Three of the issue's
# examples are a right number said of the wrong thing, which no number check can see; they
# are settled in their lessons instead: 03's cap (two reduce-scatters in flight, not two units'
# gradients) and 01's mixed-precision step (20Ψ, not 16Ψ) are rendered from the values the
# cells assert, and lesson 10 §5 reads the spine from `superpod_levels()` (lesson 00's function)
# and prices the preset's 25 GB/s beside it, so "25 GB/s" is printed there, rightly, as the
# comparison.
EXAMPLES = [
    ("05", "Takeaways", "- TP16 across nodes loses 78 % (§8)."),
    ("05", "Takeaways", "- A 70B layer's four collectives take ~9 ms over InfiniBand (§6)."),
    ("05", "Takeaways", "- SP costs TP8 −2 % of its throughput (§8)."),
    ("05", "Takeaways", "- SP without recomputation runs 1.25× the tokens/s at 16k (§8)."),
    ("06", "7", "The zig-zag forward ends first, here by about 1.5."),
    ("11b", "Takeaways", "- At 131k tokens the planner's step changes by −17 % (§3)."),
    ("11b", "Takeaways", "- The 131k plan needs 440–585 GB (§3)."),
    ("11", "Takeaways", "- The planner assumes 60 % of peak (§5)."),
    ("08", "Takeaways", "- The slicer's gain over uniform slices is a few per cent, below the noise."),
    ("12", "Takeaways", "- SwiGLU gains about what its bytes predict."),
    ("01", "Takeaways", "- Full recomputation buys little, 0.85–1.1 in our runs."),
]


def _with_sentence(cells: list[dict], where: str, text: str) -> tuple[list[dict], int]:
    cells = copy.deepcopy(cells)
    titles = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    heads = [(i, s) for i, s in titles if s.lstrip().startswith("## ")]
    starts = [i for i, s in heads if (where.lower() in s.split("\n")[0].lower() if not where[0].isdigit()
                                      else pn.section_number(s.split("\n")[0][3:]) == where)]
    assert starts, f"no section {where!r}"
    nxt = [i for i, _ in heads if i > starts[0]]
    at = nxt[0] if nxt else len(cells)
    cells.insert(at, md(text))
    return cells, at


@pytest.mark.parametrize("lesson_no, where, text", EXAMPLES, ids=[f"{e[0]}-{i}" for i, e in enumerate(EXAMPLES)])
def test_every_lesson_reports_issue_44s_examples_if_put_back(lesson_no, where, text, request):
    lesson = next(p for p in LESSONS if p.stem.split("_")[0] == lesson_no)
    cells = json.loads(lesson.read_text(encoding="utf-8"))["cells"]
    outputs = _own_outputs(request.config, lesson)
    planted, at = _with_sentence(cells, where, text)
    shifted = {(i if i < at else i + 1): v for i, v in outputs.items()}
    found = pn.check(lesson, shifted, other_lessons=_sections(request.config), cells=planted)
    named = where if where[0].isdigit() else (re.findall(r"\(§(\d+)\)", text) or [None])[0]
    if not [u for u in found if u.cell == at] and named:
        # A value can land on the old number in a run (06's measured zig-zag ratio; a bare
        # 0.17 that 11b's §3 prints, which binds 17 %): then the sentence is true of that run
        # and rightly binds, and the section it names must print the number (or, for a
        # percentage, its fraction).
        heads = [i for i, c in enumerate(planted) if c["cell_type"] == "markdown"
                 and "".join(c["source"]).lstrip().startswith("## ")]
        start = next(i for i in heads if pn.section_number("".join(planted[i]["source"]).lstrip()
                                                            .split("\n")[0][3:]) == named)
        end = next((i for i in heads if i > start), len(planted))
        printed = [float(p) for p in re.findall(r"(?<![\d.])\d+(?:\.\d+)?",
                                                " ".join(shifted.get(i, "") for i in range(start, end)))]
        numbers = re.findall(r"\d+(?:\.\d+)?", text.replace(f"(§{named})", ""))

        def shown(n: str) -> bool:   # printed at the written precision (a % also as its fraction)
            d = len(n.partition(".")[2])
            return any(round(p, d) == float(n) or ("%" in text and round(100 * p, d) == float(n))
                       for p in printed)
        assert numbers and all(shown(n) for n in numbers), f"{lesson.stem}: the old text was not reported: {text}"
        return
    assert [u for u in found if u.cell == at], f"{lesson.stem}: the old text was not reported: {text}"


def test_a_page_binds_each_lesson_part_to_its_lesson(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Intro\n\n3.14 is not a lesson's.\n\n### 05 · SP\n\nTP8 costs 18 %.\n\n"
                    "| 06 | ring attention, 1.71× |\n")
    lessons = {"05_sp": [pn.Section("1 · A", 1, printed=[(0.183, False, "")])],
               "06_cp": [pn.Section("1 · A", 1, printed=[(1.5, False, "")])]}
    assert [u.text for u in pn.check_doc(page, lessons, sources=[])] == ["1.71×"]
    lessons["06_cp"][0].rendered.append((1.71, False, ""))  # a page may quote a lesson's rendered prose
    assert pn.check_doc(page, lessons, sources=[]) == []


@pytest.mark.parametrize("page", ["README.md", "docs/teaching.md", "docs/claims.md"])
def test_every_lesson_number_the_docs_quote_is_bound(page, request):
    found = pn.check_doc(ROOT / page, _sections(request.config))
    assert not found, f"{len(found)} number(s) in {page} that no lesson prints or uses:\n" + \
        "\n".join(f"  {u}" for u in found)
