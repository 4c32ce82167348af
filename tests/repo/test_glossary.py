"""The glossary (docs/glossary.md): every link into it from a lesson, an exercise, a solution or
a page lands on a heading that exists, and it defines the terms a learner meets before the
lesson that teaches them.

Anchors: GitHub lower-cases a heading, drops punctuation except hyphens and turns spaces into
hyphens; JupyterLab and nbconvert (the site) only turn spaces into hyphens and keep the case
and the punctuation. The three agree when a heading is lower-case letters, digits, spaces and
hyphens, which is what the glossary's term headings are (checked below), so one slug serves a
link read on GitHub, in JupyterLab and on the site."""
import json
import re
from pathlib import Path

import pytest
from nbconvert.filters.markdown import markdown2html_mistune as markdown2html

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
LINK = re.compile(r"\]\((?:\.\./)*(?:docs/)?glossary\.md#([^)\s]*)\)")

# the terms issue 40 found used before they were defined (a term -> the heading that defines it)
REQUIRED = {
    "gloo": "gloo", "NCCL": "nccl", "process group": "process group", "world size": "world size",
    "NVLink": "nvlink", "NVSwitch": "nvswitch", "InfiniBand": "infiniband", "SHARP": "sharp",
    "DTensor": "dtensor", "mesh": "mesh", "unit": "unit", "region": "region", "MQA": "mqa",
    "bucket": "bucket", "pipeline bubble": "pipeline bubble", "1F1B": "1f1b",
    "Ulysses": "ulysses", "ZB-H2": "zb-h2", "F&B": "overlapped forward and backward",
    "shared expert": "shared expert", "sigmoid router": "sigmoid router",
    "capacity": "capacity", "critical batch": "critical batch",
    "5-D parallelism": "5-d parallelism", "turn rank": "turn rank", "chunk": "chunk",
    "B/W split": "split backward",
}


def github_slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)          # drop punctuation, keep letters, digits, _ and -
    return text.replace(" ", "-")


def headings(markdown: str) -> list[str]:
    out, fence = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def sections(markdown: str) -> dict[str, str]:
    """`## heading` -> the text under it, up to the next `## `."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _text(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text(encoding="utf-8")
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                     if c["cell_type"] == "markdown")


PAGES = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/*.ipynb"),
                *ROOT.glob("solutions/*.ipynb"), *ROOT.glob("docs/*.md"), ROOT / "README.md"])


def test_slug_rules_on_known_headings():
    assert github_slug("all-reduce") == "all-reduce"
    assert github_slug("f and g") == "f-and-g"
    assert github_slug("Process Group") == "process-group"
    assert github_slug("fused forward (F&B)") == "fused-forward-fb"      # GitHub drops '(', '&', ')'


def test_every_heading_has_one_anchor_on_github_jupyterlab_and_the_site():
    text = GLOSSARY.read_text(encoding="utf-8")
    titles = headings(text)
    unsafe = [t for t in titles if t != titles[0] and not re.fullmatch(r"[a-z0-9][a-z0-9 \-]*", t)]
    assert not unsafe, f"headings GitHub and JupyterLab would slug differently: {unsafe}"
    slugs = [github_slug(t) for t in titles]
    assert len(slugs) == len(set(slugs)), "two headings share an anchor"
    jupyterlab = {t.replace(" ", "-") for t in titles}                     # JupyterLab's rule
    site = set(re.findall(r'<h\d id="([^"]+)"', markdown2html(text)))     # nbconvert's ids
    for slug in slugs[1:]:
        assert slug in jupyterlab and slug in site, slug


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_into_the_glossary_lands_on_a_heading(path):
    anchors = {github_slug(t) for t in headings(GLOSSARY.read_text(encoding="utf-8"))}
    text = _text(path)
    if path == GLOSSARY:                              # its own links: [x](#anchor)
        targets = re.findall(r"\]\(#([^)\s]*)\)", text)
    else:
        targets = LINK.findall(text)
    missing = sorted({t for t in targets if t not in anchors})
    assert not missing, f"{path.name} links to glossary anchors that do not exist: {missing}"


def test_the_required_terms_are_defined():
    defined = sections(GLOSSARY.read_text(encoding="utf-8"))
    for term, heading in REQUIRED.items():
        assert heading in defined, f"no '## {heading}' for {term}"
        body = defined[heading]
        assert len(body.split()) >= 8, f"'{heading}' is not a definition: {body!r}"
        assert re.search(r"[Ll]essons? \d\d", body), f"'{heading}' names no lesson"
    assert "F&B" in defined["overlapped forward and backward"]


def test_the_notation_names_every_symbol_the_course_uses():
    notation = sections(GLOSSARY.read_text(encoding="utf-8"))["notation"]
    first_column = {symbol.strip() for row in notation.splitlines() if row.startswith("|")
                    for symbol in row.split("|")[1].split(",")}
    for symbol in ("N", "Ψ", "b", "s", "h", "a", "L", "n_vocab", "t", "p", "m", "v", "k", "E", "α", "β", "C"):
        assert symbol in first_column, symbol
    for book in ("D", "F", "B", "X", "Y", "C", "W"):          # lesson 11's letters, mapped
        assert re.search(rf"^\| {book} \(", notation, flags=re.M), book
