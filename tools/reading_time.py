"""A first reading's length, estimated the same way for every lesson (issue 46's pace target).

    python tools/reading_time.py notebooks/*.ipynb

Prose (markdown cells and the literal text of `say(...)` calls) at 130 words a minute, code (the
non-blank lines of code cells outside `say(...)`) at 5.9 lines a minute, one minute a figure
(each `plt.show()`, else one for a cell that calls a figure helper: `plot_*`, `draw_*`,
`*_figure`, `knobs`, `show_*`), one minute of running. The library code a lesson shows with
`picolib.source.show(...)` is code to read: its non-blank lines count with the cells' own
(tools/shown_core.py). The rates were calibrated on three timed
first readings (lessons 01, 03 and 10 before they were split or trimmed: about 110, 85 and 100
minutes). An estimate, not a measurement: it ranks the lessons and flags the long ones.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

WORDS_PER_MIN, LINES_PER_MIN, MIN_PER_FIGURE, RUN_MIN = 130, 5.9, 1, 1
_FIGURE_CALL = re.compile(r"\b(plot_\w+|draw_\w+|\w+_figure|knobs|show_\w+)\(")


def _say_spans(src: str):
    """(code outside `say(...)`, the string literals inside it with `{...}` fields as one word)."""
    code, prose, i = [], [], 0
    for m in re.finditer(r"(?<![\w.])say\(", src):
        if m.start() < i:
            continue
        code.append(src[i:m.start()])
        depth, k = 0, m.end() - 1
        while k < len(src):
            ch = src[k]
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    break
            elif ch in "\"'":
                quote = src[k:k + 3] if src[k:k + 3] in ('"""', "'''") else ch
                end = src.index(quote, k + len(quote))
                while src[end - 1] == "\\":
                    end = src.index(quote, end + 1)
                prose.append(re.sub(r"\{[^{}]*(\{[^{}]*\}[^{}]*)*\}", " X ", src[k + len(quote):end]))
                k = end + len(quote) - 1
            k += 1
        i = k + 1
    code.append(src[i:])
    return "".join(code), " ".join(prose)


def _words(text: str) -> int:
    return len(re.sub(r"\]\([^)]*\)", "]", text).split())


def estimate(path: str) -> dict:
    """Words, code lines, figures and minutes of one lesson."""
    words = lines = figures = 0
    for cell in json.load(open(path, encoding="utf-8"))["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += _words(src)
            continue
        code, prose = _say_spans(src)
        words += _words(prose)
        lines += sum(1 for line in code.splitlines() if line.strip() and line.strip() != ")")
        shows = code.count("plt.show()")
        figures += shows or (1 if _FIGURE_CALL.search(code) else 0)
    lines += sum(s.lines for s in _shown(path))
    minutes = words / WORDS_PER_MIN + lines / LINES_PER_MIN + figures * MIN_PER_FIGURE + RUN_MIN
    return dict(words=words, lines=lines, figures=figures, minutes=minutes)


def _shown(path: str):
    """What the lesson shows of picolib's source (nothing when it calls no `show`)."""
    if "show(" not in open(path, encoding="utf-8").read():
        return []
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import shown_core
    return shown_core.shown(path)


def main(paths: list[str]) -> None:
    print(f"{'lesson':34} {'words':>6} {'code':>5} {'figs':>4} {'min':>4}")
    for path in paths:
        e = estimate(path)
        print(f"{path.rsplit('/', 1)[-1]:34} {e['words']:6d} {e['lines']:5d} {e['figures']:4d} {e['minutes']:4.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
