"""Every number in a lesson's text is bound to the lesson: the prose cannot drift from the code.

    python tools/prose_numbers.py notebooks/05_sequence_parallel.ipynb [...]   # run, then list
    python tools/prose_numbers.py --cached notebooks/*.ipynb                  # last run's outputs

A number a lesson's markdown states is one of:

- *rendered*: the sentence is the output of `picolib.prose.say(f"...")` in a code cell, built
  from the variables that hold the result; it is not in the markdown at all (the literal parts
  of a `say` string are read as prose, like markdown);
- *shown*: the same value, to the precision the text gives it (a wider margin after "about",
  "~", "≈"), is printed by a code cell of the same section. A section runs from one `## `
  heading to the next; the opening goals, the summary, the try-it and the takeaways may point
  anywhere in the lesson; a sentence that names "§N" or "lesson NN" may point there too;
- *cited*: its sentence (or table row) names a source listed in `docs/sources.md` — a
  datasheet, a paper, a published run: a definition or an input, not a result;
- *quoted*: it stands inside quotation marks, the statement a lesson corrects;
- *structure*: a section, lesson, exercise, table or figure number, part of a name (H100, fp32,
  ZeRO-3, 1F1B, Llama-3-70B), a compound such as "2-core", the year of a citation, or a bare
  count from 0 to 10 (written without a unit, a decimal point or "about").

A number that only a literal of equal value in its section's code matches (an input the
text names, a bound an `assert` checks, or a coincidence: "about 3×" matches any literal from
2.7 to 3.3) is an *advisory*: counted and listed with `--advisories`, not a failure.

Vague amounts stand for numbers too ("a few per cent", "below the noise", "buys little"): they
are flagged unless quoted, so a result is stated with its value. Everything else is reported,
naming the lesson, the cell and the number. Outputs are read from the lesson's executed copy,
build/executed/<lesson>.ipynb, the one `make test` and `make site` read too (tools/site.py's
executor runs the lesson first when that copy is missing or stale).
"""
from __future__ import annotations

import argparse
import ast
import functools
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "docs" / "sources.md"

# ---------------------------------------------------------------------------------------------
# Reading numbers out of text

_MINUS = "\u2212"
NUMBER = re.compile(
    r"(?P<approx>(?:~|≈|\babout |\baround |\broughly |\bnearly |\balmost |\bsome |\bnear |\bclose to )\s*)?"
    r"(?P<sign>[+\-" + _MINUS + r"±])?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?P<exp>[eE][+\-" + _MINUS + r"]?\d+)?"
    r"(?P<unit>\s?(?:%|×|x(?![A-Za-z]))|[kKMGT](?![A-Za-z])|B(?![A-Za-z]))?")
PHYSICAL = re.compile(r"\s?(ms|µs|us|ns|s|min|h|GB/s|TB/s|Gb/s|MB/s|GB|GiB|MB|MiB|KB|KiB|TB|TiB|"
                      r"TFLOP/s|PFLOP/s|EFLOP/s|TFLOPS|GFLOP|TFLOP|tokens/s)(?![\w/])")
_UNIT_FAMILY = {"ms": "time", "µs": "time", "us": "time", "ns": "time", "s": "time", "min": "time", "h": "time",
                "GB/s": "bw", "TB/s": "bw", "Gb/s": "bw", "MB/s": "bw",
                "GB": "bytes", "GiB": "bytes", "MB": "bytes", "MiB": "bytes", "KB": "bytes", "KiB": "bytes",
                "TB": "bytes", "TiB": "bytes", "TFLOP/s": "rate", "PFLOP/s": "rate", "EFLOP/s": "rate",
                "TFLOPS": "rate", "GFLOP": "flop", "TFLOP": "flop", "tokens/s": "tps"}
_UNIT_SCALE = {"ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9, "GB/s": 1e9, "TB/s": 1e12, "MB/s": 1e6,
               "GB": 1e9, "MB": 1e6, "KB": 1e3, "TB": 1e12, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10,
               "TiB": 2**40, "TFLOP/s": 1e12, "PFLOP/s": 1e15, "EFLOP/s": 1e18, "TFLOPS": 1e12}
SCALE = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
WORDS_BEFORE_STRUCTURE = re.compile(
    r"(?:§|\blessons?|\bsections?|\bcells?|\bEx(?:ercise)?s?\.?|\bTables?|\bFig(?:ure)?s?\.?|"
    r"\bEq(?:uation)?s?\.?|\bstep-|\bchapters?|\bpart|\bappendix|\bAlgorithm|\bversion|"
    r"\bPython|\btorch|\bv)\s*(?:\d+(?:\.\d+)?[a-z]?\s*(?:,|and|or|–|-|to)\s*)*$", re.I)
VAGUE = re.compile(r"\ba few per ?cent|\ba few %|\bbelow (?:the )?noise|\bwithin (?:the )?noise|"
                   r"\bbuys? little\b|\bnegligibl[ey]|\babout what [^.]{0,60}\bpredicts?\b", re.I)
QUOTE = re.compile(r"\"(?:[^\"\n]|\n(?!\s*\n))*\"|“[^”]*”|«[^»]*»")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"```.*?```", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
HTML = re.compile(r"</?[A-Za-z][^<>]*>")           # a tag, not "< 1e-6 … > 2"
URL = re.compile(r"https?://\S+")
HEADING_NUMBER = re.compile(r"^(#+\s*)[\d.]+[a-z]?\s*[·.:]", re.M)
MATH_COMMAND = re.compile(r"\\[A-Za-z]+")


@dataclass
class Number:
    text: str            # as written, e.g. "−2 %"
    value: float         # in the unit of the bare numeral (2 for "2 %", 70e9 for "70B")
    unit: str            # "%", "×", "" (k/M/B folded into value)
    half_unit: float     # the precision the text claims, in value's unit
    approx: bool
    sentence: str
    block: str = ""      # the paragraph, list item or table row it stands in
    physical: str = ""   # ms, GB, GB/s, ... as written after it

    def matches(self, other: float, other_percent: bool, other_physical: str = "") -> bool:
        if self.physical and other_physical and _UNIT_FAMILY.get(self.physical) != _UNIT_FAMILY.get(other_physical):
            return False
        if self.physical and other_percent:  # 9 ms is not the 8.9 % printed beside it
            return False
        tol = self.half_unit * 1.0001 + 1e-12
        if self.approx:
            tol = max(tol, 0.1 * abs(self.value))
        mine = abs(self.value)
        if self.unit == "%":             # 18 % is printed as 18% or as the fraction 0.18
            candidates = [abs(other)] if other_percent else [abs(other) * 100]
        else:                            # 0.18 or 18 may be printed as 18%
            candidates = [abs(other), abs(other) / 100] if other_percent else [abs(other)]
        if self.physical in _UNIT_SCALE and not other_physical and not other_percent:
            candidates.append(abs(other) / _UNIT_SCALE[self.physical])   # 400 TFLOP/s is 400e12 in code
        return any(abs(c - mine) <= tol for c in candidates)


def _to_float(num: str, exp: str | None) -> tuple[float, float]:
    """(value, half a unit of the last written digit) of a numeral such as '1,234.5' / '3e-5'."""
    clean = num.replace(",", "")
    decimals = len(clean.split(".")[1]) if "." in clean else 0
    value = float(clean)
    half = 0.5 * 10 ** (-decimals)
    if exp:
        e = int(exp[1:].replace(_MINUS, "-"))
        value *= 10 ** e
        half *= 10 ** e
    return value, half


def numbers_in(text: str) -> list[Number]:
    """The numbers a stretch of prose states (markdown already stripped of code, links, quotes)."""
    out = []
    for block, sentence in _sentences(text):
        for m in NUMBER.finditer(sentence):
            start, end = m.start("num"), m.end()
            before, after = sentence[:m.start("sign") if m.group("sign") else start], sentence[end:]
            if m.group("sign") and m.group("sign") in "-" and before[-1:].isalnum():
                before = sentence[:start]                    # "3-70B": the hyphen joins a name
            if _is_structure(sentence, m, before, after):
                continue
            value, half = _to_float(m.group("num"), m.group("exp"))
            unit = (m.group("unit") or "").strip()
            if m.group("unit") == "B":
                continue                                      # 70B, 405B: a model's name
            if unit in SCALE:
                value, half, unit = value * SCALE[unit], half * SCALE[unit], ""
            elif unit == "x":
                unit = "×"
            approx = bool(m.group("approx"))
            phys = PHYSICAL.match(after)
            if (not approx and not unit and not phys and not m.group("exp") and "." not in m.group("num")
                    and value <= 10 and "," not in m.group("num") and not m.group("sign")):
                continue                                      # a bare count: two, 4 ranks
            out.append(Number(m.group(0).strip(), value, unit, half, approx, sentence.strip(), block,
                              phys.group(1) if phys and not unit else ""))
    return out


def _is_structure(sentence: str, m: re.Match, before: str, after: str) -> bool:
    if before[-1:].isalpha() or before[-1:] in "_^\\{" or before.endswith(("-", "‑")) and before[-2:-1].isalnum():
        return True                                           # fp32, H100, ZeRO-3, Llama-3-70B
    if before[-1:].isdigit() or before[-1:] == ".":
        return True                                           # inside another token
    unit = m.group("unit") or ""
    if not unit and re.match(r"[A-Za-z]", after) and not re.match(r"[A-Za-z]{2,}", after):
        return True                                           # 1F1B, 2D, 4k8 (a name)
    if not unit and re.match(r"[-‑][A-Za-z]", after):
        return True                                           # 2-core, 16-bit, 8-GPU
    if not unit and re.match(r"(?:st|nd|rd|th)\b", after):
        return True                                           # 1st, 4th
    if WORDS_BEFORE_STRUCTURE.search(before[-40:]):
        return True                                           # §6, lesson 05, Table 4, Ex 3
    num = m.group("num")
    if re.fullmatch(r"(19[5-9]\d|20[0-3]\d)", num) and (re.search(r"et al\.?,?\s*\(?$|\($|, $|\bin $|\b[A-Z][a-z]+ $", before)
                                                     or after.startswith(")")):
        return True                                           # the year of a citation
    return False


def _sentences(text: str) -> list[tuple[str, str]]:
    """(block, sentence) pairs: a table row is both; a paragraph or list item is split into
    sentences. A citation reaches its sentence; a section reference (§N), its block."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if all(line.lstrip().startswith("|") for line in lines if line.strip()):
            out += [(line, line) for line in lines if line.strip()]
            continue
        for block in re.split(r"\n(?=\s*(?:[-*]|\d+\.) )", para):
            out += [(block, s) for s in re.split(r"(?<=[.!?;:])\s+(?=[A-Z*(\[$\-—])", block)]
    return out


def strip_markdown(md: str) -> tuple[str, list[str]]:
    """Prose with code, links, HTML and heading numbers removed, and the quoted passages."""
    md = FENCE.sub(" ", md)
    md = CODE_SPAN.sub(" ", md)
    md = LINK_TARGET.sub("]", md)
    md = URL.sub(" ", md)
    md = HTML.sub(" ", md)
    md = HEADING_NUMBER.sub(r"\1", md)
    md = md.replace("{,}", ",").replace("\\,", " ").replace("\\!", "")
    md = MATH_COMMAND.sub(lambda m: " " if m.group(0) not in ("\\times", "\\cdot") else " × ", md)
    quotes = QUOTE.findall(md)
    md = QUOTE.sub(" ", md)
    return md, quotes


# ---------------------------------------------------------------------------------------------
# What a lesson binds: its code's literals and its outputs, by section

Value = tuple  # (value, printed as a percentage, physical unit written after it)


@dataclass
class Section:
    title: str
    index: int
    cells: list[int] = field(default_factory=list)
    code: list[Value] = field(default_factory=list)      # literals of the section's code
    printed: list[Value] = field(default_factory=list)   # numbers its cells printed
    rendered: list[Value] = field(default_factory=list)  # numbers in its rendered prose (say)
    kind: str = "section"          # "section", "open" (goals, try it, next) or "summary"

    @property
    def values(self) -> list[Value]:
        return self.code + self.printed


OPEN = re.compile(r"try it|what comes next|goals|exercises", re.I)
SUMMARY = re.compile(r"summary|takeaway", re.I)


def _code_literals(src: str) -> tuple[list[Value], list[str]]:
    """Numeric literals of the code (not its comments), and the literal text of say(...) calls."""
    values: list[Value] = []
    prose: list[str] = []
    try:
        tree = ast.parse(src)
    except SyntaxError:
        tree = None
    said: set[int] = set()
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "say":
                for arg in node.args:
                    # an f-string is read whole, each interpolated value a blank: its sentences
                    # (and the source they name) stay in one piece
                    parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
                    prose.append("".join(p.value if isinstance(p, ast.Constant) and isinstance(p.value, str)
                                         else " \u2039\u203a " for p in parts))
                    for sub in ast.walk(arg):
                        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                            said.add(id(sub))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                values.append((float(node.value), False, ""))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in said:
                values += _loose_values(node.value)
    return values, prose


def _loose_numbers(text: str) -> list[Number]:
    """Every numeral in printed text, names and counts included (an output binds generously)."""
    out = []
    for m in NUMBER.finditer(text):
        value, half = _to_float(m.group("num"), m.group("exp"))
        unit = (m.group("unit") or "").strip()
        if unit in SCALE:
            value *= SCALE[unit]
            unit = ""
        phys = PHYSICAL.match(text, m.end())
        out.append(Number(m.group(0), value, "%" if unit == "%" else unit, half, False, "", "",
                          phys.group(1) if phys and not unit else ""))
    return out


def _loose_values(text: str) -> list[Value]:
    return [(n.value, n.unit == "%", n.physical) for n in _loose_numbers(text)]


def sections_of(cells: list[dict], outputs: dict[int, str]) -> list[Section]:
    sections = [Section("goals", 0, kind="open")]
    for i, cell in enumerate(cells):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            heading = re.search(r"^##\s+(.*)$", src, re.M)
            if heading:
                title = heading.group(1)
                kind = "summary" if SUMMARY.search(title) else "open" if OPEN.search(title) else "section"
                sections.append(Section(title, len(sections), kind=kind))
        sections[-1].cells.append(i)
        if cell["cell_type"] == "code":
            sections[-1].code += _code_literals(src)[0]
            printed, _, rendered = outputs.get(i, "").partition(RENDERED)
            sections[-1].printed += _loose_values(printed)
            sections[-1].rendered += _loose_values(rendered)
    return sections


def section_number(title: str) -> str | None:
    m = re.match(r"\s*(\d+[a-z]?)\s*[·.:]", title)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------
# The check

@dataclass
class Unbound:
    lesson: str
    cell: int
    section: str
    text: str
    sentence: str
    why: str = ""

    def __str__(self) -> str:
        return (f"{self.lesson} cell {self.cell} ({self.section[:40]}): {self.text!r} — {self.why}: "
                f"\"{_short(self.sentence)}\"")


def _short(s: str, n: int = 110) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n - 1] + "…"


def load_sources(path: Path = SOURCES) -> list[str]:
    """The names a citation may use: each `- **name**` (and `aka` names) of docs/sources.md."""
    if not path.exists():
        return []
    names = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\s*[-*]\s+\*\*(.+?)\*\*", line)
        if m:
            names.append(m.group(1))
            aka = re.search(r"\(also:\s*([^)]*)\)", line)
            if aka:
                names += [a.strip() for a in aka.group(1).split(";") if a.strip()]
    return names


@dataclass
class Tally:
    """How the numbers of the checked prose are bound, and the advisories: numbers whose only
    match is a literal of equal value in the code (a coincidence of value as often as not)."""
    output: int = 0
    citation: int = 0
    literal: int = 0
    unbound: int = 0
    advisories: list = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.output} bound by what a cell printed, {self.citation} by a citation, "
                f"{self.literal} by a code literal only (advisory), {self.unbound} unbound")


LITERAL_ONLY = "bound only by a literal of equal value in the code, not by anything printed (advisory)"


def _bind(n: Number, printed: list[Value], code: list[Value], tally: Tally, where: Unbound) -> Unbound | None:
    """Count `n` by what binds it: None when bound, `where` (a failure) when nothing does."""
    if any(n.matches(*v) for v in printed):
        tally.output += 1
    elif any(n.matches(*v) for v in code):
        tally.literal += 1
        where.why = LITERAL_ONLY
        tally.advisories.append(where)
    else:
        tally.unbound += 1
        return where
    return None


def check(notebook: Path, outputs: dict[int, str], other_lessons: dict[str, list[Section]] | None = None,
          sources: list[str] | None = None, cells: list[dict] | None = None,
          tally: Tally | None = None) -> list[Unbound]:
    """Every unbound number of one lesson. `outputs`: cell index → the text it printed;
    `other_lessons`: name → sections, for a sentence that names another lesson; `tally`
    counts how each number is bound and keeps the advisories."""
    if cells is None:
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    sources = load_sources() if sources is None else sources
    source_re = re.compile("|".join(re.escape(s) for s in sorted(sources, key=len, reverse=True)), re.I) if sources else None
    tally = Tally() if tally is None else tally
    sections = sections_of(cells, outputs)
    by_number = {section_number(s.title): s for s in sections if section_number(s.title)}
    found: list[Unbound] = []
    for section in sections:
        for i in section.cells:
            cell = cells[i]
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            texts = [src] if cell["cell_type"] == "markdown" else _code_literals(src)[1]
            for text in texts:
                prose, _ = strip_markdown(text)
                for vague in VAGUE.finditer(prose):
                    found.append(Unbound(notebook.stem, i, section.title, vague.group(0),
                                         prose[max(0, vague.start() - 60):vague.end() + 40],
                                         "a vague amount: state the value"))
                for n in numbers_in(prose):
                    if source_re and source_re.search(" ".join(n.sentence.split())):
                        tally.citation += 1
                        continue
                    refs = [by_number[r] for r in re.findall(r"§\s*(\d+[a-z]?)", n.block) if r in by_number]
                    if section.kind == "summary" and not refs:
                        tally.unbound += 1
                        found.append(Unbound(notebook.stem, i, section.title, n.text, n.sentence,
                                             "a summary states where a number comes from: add (§N)"))
                        continue
                    pool = refs + (sections if section.kind == "open" else [section] if section.kind == "section" else [])
                    for ref in re.findall(r"\blessons?\s+(\d\d[a-z]?)\b", n.block, re.I):
                        for other, secs in (other_lessons or {}).items():
                            if other.split("_")[0] == ref:
                                pool += secs
                    bad = _bind(n, [v for s in pool for v in s.printed], [v for s in pool for v in s.code], tally,
                                Unbound(notebook.stem, i, section.title, n.text, n.sentence,
                                        "not printed by the code of its section, not cited, not quoted"))
                    if bad:
                        found.append(bad)
    return found


LESSON_HEADING = re.compile(r"^#{2,3}\s+(\d\d[a-z]?)\s*·", re.M)
LESSON_ROW = re.compile(r"^\|\s*(\d\d[a-z]?)\s*\|")


def doc_chunks(text: str) -> list[tuple[str, int, str]]:
    """(lesson, line, text) of each part of a page that speaks for one lesson: a `## NN ·`
    or `### NN ·` section, or a table row that starts with the lesson's number."""
    out, lesson, start, buf, plan, meta = [], None, 0, [], False, False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):          # the course plan's run and class times are the
            plan = bool(re.match(r"#+\s*Course plan", line))   # guide's own, not a lesson's
        if line.startswith("Builds on:"):
            meta = True               # the guide's run and class times for the lesson: its own
        elif not line.strip():
            meta = False
        if plan or meta:
            continue
        head = LESSON_HEADING.match(line)
        if head or (line.startswith("#") and lesson):
            if lesson and buf:
                out.append((lesson, start, "\n".join(buf)))
            lesson, start, buf = (head.group(1), n, []) if head else (None, n, [])
            continue
        row = LESSON_ROW.match(line)
        if row:                       # a table row that starts with a lesson's number speaks for it
            out.append((row.group(1), n, line[row.end():]))
        elif lesson:
            buf.append(line)
    if lesson and buf:
        out.append((lesson, start, "\n".join(buf)))
    return out


def check_doc(path: Path, lessons: dict[str, list[Section]], sources: list[str] | None = None,
              tally: Tally | None = None) -> list[Unbound]:
    """A page that quotes the lessons (README, docs/teaching.md, docs/claims.md): every number
    in a lesson's part binds to that lesson's outputs or rendered prose (any section), or to a
    lesson its sentence names, or is cited, quoted or structure; one that only a literal of the
    lesson's code matches is an advisory."""
    sources = load_sources() if sources is None else sources
    source_re = re.compile("|".join(re.escape(s) for s in sorted(sources, key=len, reverse=True)), re.I) if sources else None
    tally = Tally() if tally is None else tally
    by_no = {name.split("_")[0]: secs for name, secs in lessons.items()}
    found = []
    for lesson, line, text in doc_chunks(path.read_text(encoding="utf-8")):
        if lesson not in by_no:
            continue
        prose, _ = strip_markdown(text)
        for vague in VAGUE.finditer(prose):
            found.append(Unbound(path.name, line, f"lesson {lesson}", vague.group(0), prose[max(0, vague.start() - 60):vague.end() + 40],
                                 "a vague amount: state the value"))
        for n in numbers_in(prose):
            if source_re and source_re.search(" ".join(n.sentence.split())):
                tally.citation += 1
                continue
            pool = list(by_no[lesson])
            for ref in re.findall(r"\blessons?\s+(\d\d[a-z]?)\b", n.block, re.I):
                pool += by_no.get(ref, [])
            bad = _bind(n, [v for s in pool for v in s.printed + s.rendered], [v for s in pool for v in s.code], tally,
                        Unbound(path.name, line, f"lesson {lesson}", n.text, n.sentence,
                                f"not printed by lesson {lesson}, not cited, not quoted"))
            if bad:
                found.append(bad)
    return found


def count_numbers(notebook: Path) -> int:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    total = 0
    for cell in cells:
        src = "".join(cell["source"])
        texts = [src] if cell["cell_type"] == "markdown" else _code_literals(src)[1]
        total += sum(len(numbers_in(strip_markdown(t)[0])) for t in texts)
    return total


# ---------------------------------------------------------------------------------------------
# A lesson's outputs: those of its executed copy (tools/site.py's executor, as `make test` and
# `make site` run it)

RENDERED = "\x1e"     # what a cell printed, then (after this mark) the prose it rendered


def output_text(outputs: list) -> str:
    """A cell's outputs as text: what it printed, and after RENDERED what `say` rendered. In
    its own lesson rendered prose binds nothing (it is prose, checked as such); a page that
    quotes the lesson (README, docs) may quote it."""
    printed, rendered = [], []
    for out in outputs or []:
        if out.get("output_type") == "stream":
            printed.append(out.get("text", ""))
        elif out.get("output_type") in ("display_data", "execute_result"):
            data = out.get("data", {})
            if "text/markdown" in data:
                rendered.append(data["text/markdown"])
            else:
                printed.append(data.get("text/plain", ""))
    join = lambda parts: "".join(p if isinstance(p, str) else "".join(p) for p in parts).replace(_MINUS, "-")
    return join(printed) + (RENDERED + join(rendered) if rendered else "")


@functools.lru_cache(maxsize=None)
def _executor():
    """tools/site.py, loaded once (its LessonFailed is then one class)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("picolib_tools_site", ROOT / "tools" / "site.py")
    module = importlib.util.module_from_spec(spec)    # tools/site.py: not the standard `site`
    spec.loader.exec_module(module)
    return module


def executed_outputs(notebook: Path, into: Path | None = None, run: str = "",
                     cached: bool = False) -> dict[int, str]:
    """What each code cell of the lesson printed (cell index → text), read from its executed
    copy in build/executed/, which is made first if it is missing or stale (`cached`: read
    whatever copy is there, never run)."""
    site = _executor()
    into = site.EXECUTED if into is None else Path(into)
    path = site.executed_path(notebook, into) if cached else site.ensure_executed(notebook, into, run=run)
    if not path.exists():
        raise FileNotFoundError(f"{path}: not executed yet; run without --cached")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return {i: output_text(c.get("outputs", [])) for i, c in enumerate(cells) if c["cell_type"] == "code"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prose_numbers", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--cached", action="store_true",
                        help="read the executed copies in build/executed/ as they are; never execute")
    parser.add_argument("--advisories", action="store_true", help="list the advisories too, not only their count")
    args = parser.parse_args(argv)
    bad, total = 0, Tally()
    for nb in args.notebooks:
        if not nb.exists():
            parser.error(f"no such notebook: {nb}")
        try:
            outputs = executed_outputs(nb.resolve(), cached=args.cached)
        except FileNotFoundError as err:
            parser.error(str(err))
        tally = Tally()
        found = check(nb.resolve(), outputs, tally=tally)
        print(f"{nb.stem}: {count_numbers(nb)} numbers in the prose: {tally}")
        for u in found:
            print("  " + str(u))
        for u in tally.advisories if args.advisories else []:
            print("  advisory: " + str(u))
        bad += len(found)
        for name in ("output", "citation", "literal", "unbound"):
            setattr(total, name, getattr(total, name) + getattr(tally, name))
    if len(args.notebooks) > 1:
        print(f"all: {total}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
