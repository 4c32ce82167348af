"""One letter, one meaning: check the lessons' maths and symbol tables against the course notation.

The course notation is the first table under `## notation` in docs/glossary.md, one row per
symbol: `| symbol | meaning | unit | first lesson |`. The words in **bold** in a meaning are its
key words. A lesson is checked on

- its maths: every `$…$` and `$$…$$` in markdown cells and in the strings of `say(...)` calls.
  Each letter is a symbol (LaTeX writes `sbh` for s·b·h), a Greek command or letter is one, a
  subscript belongs to its letter (`W_{\\rm HBM}` is W_HBM; an index subscript i, j, r or a
  number is dropped: B_i is B), a prime is dropped (Ψ' is Ψ), and `\\text{…}`, `\\rm …` and
  operator names (`\\log`, `\\max`) are words, not symbols. Every symbol must be in the course
  table.
- its symbol tables (a markdown table whose header has a `symbol` column, followed by a
  `meaning` column; a table may have several symbol/meaning pairs side by side). A row may
  declare several symbols, comma-separated, with as many comma-separated meanings. Each symbol
  must be in the course table and its meaning must contain one of the course row's key words.
  A bold entry (`**F**`) is a schedule op, checked against the op table (`| op | meaning |`)
  under the notation table: op names are names of operations, not maths symbols, and never
  appear inside `$…$`. A plain word longer than three letters (`bubble`, a link) is a term
  for the glossary, not a symbol, and is skipped.

    python tools/notation.py                    # every lesson in notebooks/
    python tools/notation.py notebooks/03_zero.ipynb

prints one line per problem (`lesson cell N: symbol 'k': ...`) and exits 1 if there is any.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"

GREEK = {"alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "varepsilon": "ε",
         "zeta": "ζ", "eta": "η", "theta": "θ", "vartheta": "θ", "iota": "ι", "kappa": "κ",
         "lambda": "λ", "mu": "μ", "nu": "ν", "xi": "ξ", "pi": "π", "rho": "ρ", "sigma": "σ",
         "tau": "τ", "upsilon": "υ", "phi": "φ", "varphi": "φ", "chi": "χ", "psi": "ψ", "omega": "ω",
         "ell": "ℓ", "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ", "Xi": "Ξ", "Pi": "Π",
         "Sigma": "Σ", "Upsilon": "Υ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω"}
# operators written as Greek letters, and index subscripts: not symbols of the notation
OPERATORS = {"Σ", "Π", "Δ"}
INDEX = {"i", "j", "r"}
WORD_COMMANDS = r"text|textrm|textit|textbf|mathrm|operatorname|mathit|texttt|rm|mbox"
SUBSCRIPT_DIGITS = {ord(c): "_" + t for c, t in zip("₀₁₂₃₄₅₆₇₈₉ᵢⱼᵣ", "0123456789ijr")}
LETTER = r"[A-Za-zα-ωΑ-Ωℓ]"


@dataclass(frozen=True)
class Problem:
    lesson: str
    cell: int
    symbol: str
    what: str

    def __str__(self) -> str:
        return f"{self.lesson} cell {self.cell}: symbol '{self.symbol}': {self.what}"


# ---------------------------------------------------------------- the course table

def split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(markdown: str) -> list[list[list[str]]]:
    """Every markdown table in `markdown`, as rows of cells, the header row first."""
    found, rows = [], []
    for line in markdown.splitlines() + [""]:
        if line.strip().startswith("|"):
            if not re.fullmatch(r"\|?[\s|:-]+\|?", line.strip()):
                rows.append(split_row(line))
        elif rows:
            found.append(rows)
            rows = []
    return found


def notation_section(text: str) -> str:
    m = re.search(r"^## notation\n(.*?)(?=^## )", text, flags=re.M | re.S)
    if not m:
        raise SystemExit(f"{GLOSSARY}: no '## notation' section")
    return m.group(1)


def key_words(meaning: str) -> list[str]:
    return [k.lower() for k in re.findall(r"\*\*(.+?)\*\*", meaning)]


def course_table(text: str | None = None) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(symbols, ops): each symbol and op name of the course notation -> its key words."""
    text = GLOSSARY.read_text(encoding="utf-8") if text is None else text
    symbols, ops = {}, {}
    for rows in tables(notation_section(text)):
        head = [h.lower() for h in rows[0]]
        target = symbols if head[:2] == ["symbol", "meaning"] else ops if head[:2] == ["op", "meaning"] else None
        if target is None:
            continue
        for row in rows[1:]:
            words = key_words(row[1])
            for piece in row[0].split(","):
                name = normalise(piece.strip("* "))
                if name in target:
                    raise SystemExit(f"{GLOSSARY}: '{name}' has two rows in the notation")
                if not words:
                    raise SystemExit(f"{GLOSSARY}: '{name}' has no key word in **bold**")
                target[name] = words
    return symbols, ops


# ---------------------------------------------------------------- symbols in maths

def normalise(symbol: str) -> str:
    """One spelling of a symbol: '$W_{\\rm HBM}$' and 'W_HBM' -> 'W_HBM', '\\Psi' -> 'Ψ'."""
    s = symbol.strip().strip("$`").translate(SUBSCRIPT_DIGITS).replace("'", "").replace("′", "")
    s = re.sub(r"\\(" + "|".join(GREEK) + r")(?![A-Za-z])", lambda m: GREEK[m.group(1)], s)
    s = re.sub(r"\\(?:" + WORD_COMMANDS + r")(?![A-Za-z])\s*", "", s)
    s = re.sub(r"\\([A-Za-z]+)", r"\1", s)                                  # z_{\max}: z_max
    s = re.sub(r"[{}\s]", "", s)
    base, _, sub = s.partition("_")
    if sub and (sub in INDEX or sub.isdigit() or re.fullmatch(r"[ijr]{2}|[ijr][+-]1", sub)):
        return base
    return f"{base}_{sub}" if sub else base


def maths(text: str) -> list[str]:
    """The `$$…$$` and `$…$` spans of a markdown text (a `\\$` is a dollar, not maths)."""
    text = text.replace(r"\$", "")
    return [a or b for a, b in re.findall(r"\$\$(.+?)\$\$|\$([^$]+?)\$", text, flags=re.S)]


def symbols_in(expr: str, names: set[str] = frozenset()) -> list[str]:
    """The symbols of one maths expression, in order, normalised. A run of letters that is one
    of `names` (`dp`, `cf`) is one symbol; any other run is a product of letters."""
    e = re.sub(r"\\(?:" + WORD_COMMANDS + r")\s*\{[^{}]*\}", " ", expr)     # \text{bytes}
    e = re.sub(r"\^(\{?\\top\}?|\{T\}|T\b)", " ", e)                        # a transpose
    e = re.sub(r"\\hat\s*\{?([A-Za-z])\}?", lambda m: m.group(1) + "\u0302", e)  # Adam's m̂
    for name in sorted((n for n in names if re.fullmatch("[A-Za-z]{2,}", n)), key=len, reverse=True):
        e = re.sub(rf"(?<![A-Za-z\\_]){name}(?![A-Za-z])", f"\u27e8{name}\u27e9", e)
    e = re.sub(r"\{\}", " 0 ", e)                                           # an f-string's {}
    found = []
    subscript = r"_(\{[^{}]*\}|\\[A-Za-z]+|[A-Za-z0-9])"
    head = r"(\\[A-Za-z]+|" + LETTER + r")"
    for m in re.finditer("\u27e8([A-Za-z]+)\u27e9|" + head + "\u0302?(?:" + subscript + ")?|("
                         + LETTER + r"[ᵢⱼᵣ₀-₉]+)", e):
        whole, command, sub, unicode_sub = m.group(1), m.group(2), m.group(3), m.group(4)
        if whole:
            found.append(whole)
            continue
        if m.group(0)[len(command):].startswith("\u0302"):
            command += "\u0302"
        if unicode_sub:
            found.append(normalise(unicode_sub))
            continue
        if command.startswith("\\") and command[1:] not in GREEK:
            continue                                                        # \frac, \log, \cdot
        found.append(normalise(command + ("_" + sub if sub else "")))
    return [s for s in found if s not in OPERATORS]


def say_strings(source: str) -> list[str]:
    """The literal text of every `say(...)` call in a code cell (f-string fields become {})."""
    try:
        tree = ast.parse("\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("%", "!"))))
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "say":
            for arg in node.args[:1]:
                out.append("".join(literal(arg)))
    return out


def literal(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [p.value if isinstance(p, ast.Constant) else "{}" for p in node.values]
    if isinstance(node, ast.BinOp):
        return literal(node.left) + literal(node.right)
    return ["{}"]


# ---------------------------------------------------------------- lesson symbol tables

def top_level_split(text: str) -> list[str]:
    """Split at commas outside (), [], {} and $…$."""
    parts, depth, in_math, cur = [], 0, False, ""
    for ch in text:
        if ch == "$":
            in_math = not in_math
        elif ch in "([{" and not in_math:
            depth += 1
        elif ch in ")]}" and not in_math:
            depth -= 1
        if ch == "," and depth == 0 and not in_math:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def declared(cell: str) -> list[tuple[str, bool]]:
    """The entries of a symbol cell: (name, is_op). A term (a plain word, a link) is left out."""
    out = []
    for piece in top_level_split(cell):
        is_op = piece.startswith("**")
        text = piece.strip("*")
        if "=" in text:
            text = text.split("=")[0]                    # 'I = F / B' declares I
        text = text.strip()
        if text.startswith("$"):
            found = symbols_in(text.strip("$"))
            if len(found) == 1:                          # '$sbh$' is an expression, not a symbol
                out.append((found[0], False))
            continue
        if re.search(r"\[.*\]\(", text) or (len(re.sub(r"[_\W]", "", text)) > 3 and "_" not in text
                                              and " " not in text.strip()) or " " in text:
            continue                                     # a term: 'bubble', '[chunk](...)'
        name = normalise(text.strip("`"))
        if re.match(r"^" + LETTER + r"[A-Za-z]*\(", text):
            name = normalise(text.split("(")[0])          # 't(l, c)' declares t
        out.append((name, is_op))
    return out


def symbol_tables(markdown: str) -> list[tuple[str, str]]:
    """(symbol cell, meaning cell) of every row of every symbol table in `markdown`."""
    out = []
    for rows in tables(markdown):
        head = [h.lower().strip("* ") for h in rows[0]]
        pairs = [i for i in range(len(head) - 1) if head[i] == "symbol" and head[i + 1] == "meaning"]
        for row in rows[1:]:
            for i in pairs:
                if i + 1 < len(row) and row[i]:
                    out.append((row[i], row[i + 1]))
    return out


def known(name: str, table: dict) -> str | None:
    """The row of `table` that holds `name`: its own, or its letter's (B_naive is bytes as B is)."""
    if name in table:
        return name
    base = name.split("_")[0]
    return base if "_" in name and base in table else None


def check_row(symbol_cell: str, meaning: str, symbols: dict, ops: dict) -> list[tuple[str, str]]:
    """(symbol, what is wrong) for one row of a lesson's symbol table."""
    entries = declared(symbol_cell)
    meanings = top_level_split(meaning)
    problems = []
    for n, (name, is_op) in enumerate(entries):
        table = ops if is_op else symbols
        row = known(name, table)
        if row is None:
            problems.append((name, f"not in the course {'op' if is_op else 'symbol'} table "
                                   f"(docs/glossary.md, ## notation)"))
            continue
        own = meanings[n] if len(meanings) == len(entries) else meaning
        plain = re.sub(r"[*`]", "", own).lower()
        if not any(k in plain for k in table[row]):
            problems.append((name, f"declared as '{own.strip()}', but the course meaning's key "
                                   f"words are {table[row]}"))
    return problems


# ---------------------------------------------------------------- a lesson

def check_notebook(path: Path, symbols: dict | None = None, ops: dict | None = None) -> list[Problem]:
    if symbols is None or ops is None:
        symbols, ops = course_table()
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    lesson = Path(path).stem
    problems = []
    for index, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            texts = [source]
            for symbol_cell, meaning in symbol_tables(source):
                problems += [Problem(lesson, index, s, w) for s, w in check_row(symbol_cell, meaning, symbols, ops)]
        elif cell["cell_type"] == "code":
            texts = say_strings(source)
        else:
            continue
        seen = set()
        for text in texts:
            for expr in maths(text):
                for s in symbols_in(expr, set(symbols)):
                    if known(s, symbols) is None and s not in seen:
                        seen.add(s)
                        problems.append(Problem(lesson, index, s, f"in ${expr.strip()}$, not in the "
                                                                  f"course symbol table"))
    return problems


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    symbols, ops = course_table()
    problems = [p for path in paths for p in check_notebook(path, symbols, ops)]
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {len(paths)} lesson(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
