"""Assemble the shipped training text, picolib/data/course.txt, from the course's own prose.

    python tools/make_corpus.py                 # writes picolib/data/course.txt
    python tools/make_corpus.py --root DIR --out FILE

Sources, read in sorted order: the markdown cells of notebooks/*.ipynb, docs/*.md, README.md
and the module docstrings of picolib/**/*.py. All of it is this repository's text, under the
project's MIT licence (see picolib/data/README.md). The output is a function of those files
alone (no dates, no randomness): the same input gives the same bytes.

Each source is cut into sections at markdown headings. Every HOLD_OUT-th section is moved to
the end of the file, so the held-out tail that picolib.data calls the validation split (the
last VAL_FRACTION of the bytes) is a mix of lessons, documents and docstrings rather than one
file. A paragraph that already appeared earlier is dropped, so no validation paragraph is a
verbatim copy of a training one.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from picolib.data import VAL_FRACTION  # noqa: E402  (the split the held-out tail must cover)

HOLD_OUT = 12                       # every 12th section goes to the held-out tail
MIN_DUPLICATE = 40                  # shorter repeated paragraphs (headings, "Takeaways") stay

_IMAGE = re.compile(r"!\[([^\]]*)\]\([^)]*\)")
_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
_HEADING = re.compile(r"^#{1,6} ", re.M)


def _clean(text: str) -> str:
    text = _IMAGE.sub(r"\1", text)
    text = _TAG.sub("", text)
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _notebook(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _module_docstring(path: Path) -> str:
    try:
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except SyntaxError:
        return ""


def sources(root: Path) -> list[tuple[str, str]]:
    """(name, text) of every source, in a fixed order."""
    out = [(p.relative_to(root).as_posix(), _notebook(p))
           for p in sorted(root.glob("notebooks/*.ipynb"))]
    out += [(p.relative_to(root).as_posix(), p.read_text(encoding="utf-8"))
            for p in sorted(root.glob("docs/*.md")) + [root / "README.md"] if p.exists()]
    out += [(p.relative_to(root).as_posix(), _module_docstring(p))
            for p in sorted((root / "picolib").glob("**/*.py"))]
    return [(name, text) for name, text in out if text.strip()]


def sections(text: str) -> list[str]:
    """The text cut before every markdown heading; empty pieces dropped."""
    starts = [0] + [m.start() for m in _HEADING.finditer(text) if m.start() > 0]
    pieces = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    return [c for c in (_clean(p) for p in pieces) if c]


def assemble(root: Path) -> tuple[str, int]:
    """The corpus text and the byte offset where the held-out sections begin."""
    train, held = [], []
    for _, text in sources(root):
        for sec in sections(text):
            (held if (len(train) + len(held)) % HOLD_OUT == HOLD_OUT - 1 else train).append(sec)
    seen, kept = set(), []
    for part in (train, held):
        docs = []
        for sec in part:
            paras = []
            for para in sec.split("\n\n"):
                key = " ".join(para.split())
                if len(key) >= MIN_DUPLICATE and key in seen:
                    continue
                seen.add(key)
                paras.append(para)
            if paras:
                docs.append("\n\n".join(paras))
        kept.append("\n\n\n".join(docs))
    head = kept[0] + "\n\n\n"
    return head + kept[1] + "\n", len(head.encode("utf-8"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Assemble picolib/data/course.txt from the "
                                 "course's own text (lessons, docs, README, docstrings).")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository to read (default: this one)")
    ap.add_argument("--out", type=Path, default=None,
                    help="file to write (default: ROOT/picolib/data/course.txt)")
    args = ap.parse_args(argv)
    if not (args.root / "notebooks").is_dir():
        ap.error(f"--root {args.root} has no notebooks/ folder: not a picolib checkout")
    out = args.out or args.root / "picolib" / "data" / "course.txt"
    text, held_at = assemble(args.root)
    data = text.encode("utf-8")
    if len(data) - held_at < VAL_FRACTION * len(data):
        sys.exit(f"the held-out sections are {1 - held_at / len(data):.1%} of the text, less than "
                 f"the validation split ({VAL_FRACTION:.0%}): lower HOLD_OUT")
    out.write_bytes(data)
    print(f"wrote {out}: {len(data):,} bytes from {len(sources(args.root))} sources; "
          f"held-out sections start at byte {held_at:,} ({1 - held_at / len(data):.1%} of the file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
