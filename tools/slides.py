"""Slide metadata for the lessons, set by rule so that every lesson — and any lesson added
later — becomes a reveal.js deck with `make slides` (`jupyter nbconvert --to slides`).

    python tools/slides.py            # set the metadata on notebooks/*.ipynb (only what differs)
    python tools/slides.py --check    # exit 1, naming the lessons, if any cell differs from the rule

The rule, one slide type per cell (`cell.metadata.slideshow.slide_type`):
- the first cell (title and learning goals), and markdown with a `# ` or `## ` heading line
  (at its top or further down, after the last words of the section before): "slide" — a new
  section is a new horizontal slide;
- any other markdown (a paragraph, a `### ` figure title, a claim): "subslide", below its section;
- a code cell tagged `prose` (text rendered from computed values, `picolib.prose.say`; the
  deck shows its output only): "fragment", like the number it states;
- a code cell that draws a figure or holds an `assert`: "fragment" — it appears on the next
  click, so the room can guess the figure or the number before it shows;
- a code cell of imports only: "skip" (it still runs; the deck need not show it);
- any other code cell: "-", on the slide of the text before it.
Only `slideshow` is written; every other key of a cell's metadata is kept. Running the tool
twice changes nothing the second time.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "notebooks"

# A figure: matplotlib (plt., fig/axes), a picolib plot_* helper or draw_*, a try-it cell
# (knobs draws), or an explicit display().
FIGURE = re.compile(r"\bplt\.|\bfig\b|\baxes\b|\bplot\w*\(|\.plot\(|\bdraw\w*\(|\bknobs\(|"
                    r"\bimshow\(|\bdisplay\(")
ASSERT = re.compile(r"^\s*assert\b", re.MULTILINE)
SECTION = re.compile(r"^#{1,2} ", re.MULTILINE)


def imports_only(source: str) -> bool:
    try:
        body = ast.parse(source).body
    except SyntaxError:                      # IPython magics: not a plain import cell
        return False
    return bool(body) and all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body)


def slide_type(cell, index: int) -> str:
    """The slide type the rule gives a cell at position `index` of its lesson."""
    source = cell.source.lstrip()
    if index == 0:
        return "slide"
    if cell.cell_type == "markdown":
        return "slide" if SECTION.search(source) else "subslide"
    if cell.cell_type != "code":
        return "-"
    if "prose" in cell.metadata.get("tags", []):
        return "fragment"                    # rendered prose (picolib.prose.say): shown like text
    if FIGURE.search(source) or ASSERT.search(source):
        return "fragment"
    if imports_only(source):
        return "skip"
    return "-"


def differing(nb) -> list[int]:
    """Indices of the cells whose slide type is not the rule's."""
    return [i for i, cell in enumerate(nb.cells)
            if cell.metadata.get("slideshow", {}).get("slide_type") != slide_type(cell, i)]


def apply(nb) -> int:
    """Set the rule's slide type on every cell of `nb`, in place; returns how many changed."""
    changed = differing(nb)
    for i in changed:
        nb.cells[i].metadata["slideshow"] = {"slide_type": slide_type(nb.cells[i], i)}
    return len(changed)


def lessons(folder: Path = LESSONS) -> list[Path]:
    return sorted(folder.glob("*.ipynb"))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if not a.startswith("--")] or lessons()
    stale = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if check:
            cells = differing(nb)
            if cells:
                stale.append(f"{path.name} ({len(cells)} cells, the first is cell {cells[0]})")
        elif apply(nb):
            # the repository's notebook format: nbformat's writer and a final newline
            path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
            print(f"{path.name}: slide metadata set")
    if stale:
        print("slide metadata differs from the rule in: " + "; ".join(stale)
              + "\nrun: python tools/slides.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
