"""The lessons as a static site: every lesson executed, with its outputs and figures, one HTML
page each with links to the previous and next lesson, and an index with the lesson map.

    python tools/site.py build [--out build/site] [--only 00 01] [--timeout 300]
    python tools/site.py execute [--into build/executed] notebooks/00_collectives.ipynb [...]
    python tools/site.py html [--out build/site] build/executed/*.ipynb

This is also the course's one executor: `make test` (the root conftest.py), the prose check
(tools/prose_numbers.py), `make site` and `make slides` all read the executed notebooks it
writes, build/executed/<lesson>.ipynb (a solution: build/executed/solutions/<name>.ipynb).
Each file carries a stamp (a hash of the notebook, picolib's sources and the torch version);
`ensure_executed` reuses a file whose stamp is current and otherwise runs the notebook, under
a file lock, so two pytest-xdist workers never run the same notebook twice. Every run is
logged in build/executed/runs.log. Each notebook runs in a fresh kernel with its folder as
the working directory, as in JupyterLab; a failing or timed-out cell fails the run, naming
the notebook, the cell, its first line and the traceback's end. The seconds each lesson took
are kept in build/site/timings.json (the run times in docs/teaching.md come from there).

Why nbconvert: the site needs exactly what a notebook already is — cells, outputs, figures —
and nbconvert is Jupyter's own maintained converter, installed with JupyterLab (the
`notebooks` extra), with nbclient to execute. Its HTML exporter writes figures into the page
as base64 `data:` URIs and inlines its CSS, so a page is one file that reads offline, and it
downloads nothing at build time. A site generator (Jupyter Book, Sphinx with myst-nb,
Quarto) would bring a second toolchain for features this course does not need.

Figures: before a lesson runs, the kernel is given a display formatter that writes down the
titles of every matplotlib figure it shows, and `picolib.figure_check.watch` looks at each
figure as it is shown; what a reader could not see is kept, with the cell, in the executed
notebook's metadata (`figures`), which `make test` fails on (a setup cell, removed again
afterwards). Each
figure's <img> then gets as alt text its title(s) and the first sentence of the markdown cell
before it. Links: `../docs/glossary.md#term` becomes `glossary.html#term`, a link to a lesson
its page; a link to anything the site does not hold (an exercise, a library file) becomes its
path in the repository, in plain text, with the way to open it.

Widgets: a "try it" cell (`picolib.tryit.knobs`) shows sliders and draws into an Output widget.
A static page has no kernel to move them, so the page shows what the first call drew and a
line naming each knob and its range.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import html
import json
import os
import re
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellControlSignal, DeadKernelError
from traitlets.config import Config

ROOT = Path(__file__).resolve().parent.parent
EXECUTED = ROOT / "build" / "executed"
TEMPLATES = Path(__file__).resolve().parent / "templates"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")          # the colours of an IPython traceback


def markdown2html(text: str) -> str:
    # nbconvert is imported where pages are written: executing needs only nbclient (the
    # environments of `make test-torch` have no nbconvert)
    from nbconvert.filters.markdown import markdown2html_mistune
    return markdown2html_mistune(text)


class LessonFailed(RuntimeError):
    """A lesson's cell raised or ran out of time while the site was being built."""


FIGURE_MIME = "application/vnd.picolib.figure+json"
FIGURE_MARK = "\x1f[picolib figure] "   # starts each line the figure check writes to stderr

# Run in the kernel before the lesson's first cell: every matplotlib figure that is displayed
# (inline, or into a try-it's Output widget) also yields {"titles": [...]} under FIGURE_MIME.
SETUP = f"""
def _picolib_site_setup():
    import sys
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter

    def titles(fig):
        found = [fig._suptitle.get_text()] if getattr(fig, "_suptitle", None) else []
        for ax in fig.axes:
            found += [ax.get_title(loc) for loc in ("left", "center", "right")]
        for sub in getattr(fig, "subfigs", []):
            found += titles(sub)
        return [t.strip() for t in found if t and t.strip()]

    class FigureTitles(BaseFormatter):
        # not registered by type: the inline backend drops every formatter's Figure entry
        format_type = {FIGURE_MIME!r}
        _return_type = dict

        def __call__(self, obj):
            figure = sys.modules.get("matplotlib.figure")
            if figure is None or not isinstance(obj, figure.Figure):
                return None
            return {{"titles": titles(obj)}}

    shell = get_ipython()
    formatter = FigureTitles(parent=shell.display_formatter)
    shell.display_formatter.formatters[formatter.format_type] = formatter

    from picolib.figure_check import watch
    watch(lambda line: print({FIGURE_MARK!r} + line, file=sys.stderr, flush=True))

_picolib_site_setup()
del _picolib_site_setup
"""


def execute(path: Path, timeout: float = 300) -> nbformat.NotebookNode:
    """Run every cell of the lesson at `path` in a fresh kernel (cwd: the lesson's folder).
    Records the wall-clock seconds of the whole run and of each cell in
    `nb.metadata["site"]`, the titles of each figure in its output's metadata
    (`metadata["figure"]["titles"]`), and replaces widgets by static outputs."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(SETUP))   # cell indices below are the lesson's
    cells, current = {}, {}

    def started(cell, cell_index):
        current.update(index=cell_index - 1, t0=time.perf_counter())

    def finished(cell, cell_index, execute_reply):
        if cell_index > 0:
            cells[cell_index - 1] = round(time.perf_counter() - current["t0"], 2)

    # one execute() call, so one event loop reads the kernel's replies from start to end (run
    # cell by cell, a try-it cell's reply was now and then seen only at the cell's timeout)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}},
                            on_cell_execute=started, on_cell_executed=finished)
    start = time.perf_counter()
    try:
        client.execute()
    except (CellControlSignal, DeadKernelError) as e:   # an error, a timeout, a dead kernel
        index = current.get("index")
        if index == -1:
            raise LessonFailed(f"{path.name}: the site's setup cell failed: {ANSI.sub('', str(e))[-2000:]}") from None
        first = nb.cells[index + 1].source.strip().splitlines()[:1] if index is not None else []
        detail = ANSI.sub("", str(e))[-2000:]
        raise LessonFailed(f"{path.name}: cell {index} ({first[0][:60] if first else ''!r}) "
                           f"failed: {type(e).__name__}: {detail}") from None
    setup = nb.cells.pop(0)
    for cell in nb.cells:                               # number the lesson's cells from 1
        if cell.cell_type == "code" and cell.execution_count and setup.execution_count:
            cell.execution_count -= setup.execution_count
            for out in cell.outputs:
                if "execution_count" in out and out.execution_count:
                    out.execution_count -= setup.execution_count
    nb.metadata["site"] = {"seconds": round(time.perf_counter() - start, 1), "cells": cells,
                           "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    flatten_widgets(nb)
    figure_titles_to_metadata(nb)
    nb.metadata["figures"] = figure_problems(nb)
    return nb


def figure_problems(nb) -> list[dict]:
    """Take the figure check's lines out of the cells' stderr: [{"cell": i, "problem": line}]."""
    found = []
    for i, cell in enumerate(nb.cells):
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and FIGURE_MARK in out.get("text", ""):
                lines = out.text.splitlines(keepends=True)
                found += [{"cell": i, "problem": ln[len(FIGURE_MARK):].strip()}
                          for ln in lines if ln.startswith(FIGURE_MARK)]
                out.text = "".join(ln for ln in lines if not ln.startswith(FIGURE_MARK))
                if not out.text:
                    continue
            kept.append(out)
        if cell.cell_type == "code":
            cell.outputs = kept
    return found


def figure_titles_to_metadata(nb) -> None:
    """Move the titles the setup cell wrote beside each figure into the output's metadata,
    where exporters do not look for something to display. In place."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if FIGURE_MIME in data:
                out.setdefault("metadata", {})["figure"] = dict(data.pop(FIGURE_MIME))


def flatten_widgets(nb) -> None:
    """Replace each widget view in the outputs by what a static page can show: an Output
    widget by the outputs it captured, a row of knobs by a line naming them. In place."""
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.outputs:
            if out.get("output_type") in ("display_data", "execute_result") \
                    and WIDGET_VIEW in out.get("data", {}):
                outputs += static_outputs(out["data"][WIDGET_VIEW]["model_id"], state)
            else:
                outputs.append(out)
        cell.outputs = outputs


def static_outputs(model_id: str, state: dict) -> list:
    model = state.get(model_id, {})
    name, s = model.get("model_name", ""), model.get("state", {})
    if name == "OutputModel":
        return [nbformat.from_dict(o) for o in s.get("outputs", [])]
    if name in ("HBoxModel", "VBoxModel", "BoxModel"):
        children = [c.removeprefix("IPY_MODEL_") for c in s.get("children", [])]
        if any(state.get(c, {}).get("model_name") in PROGRESS for c in children):
            return [progress_line([state.get(c, {}) for c in children])]
        if all(state.get(c, {}).get("model_name") != "OutputModel" for c in children):
            return [knob_line([knob(state.get(c, {})) for c in children])]
        return [o for c in children for o in static_outputs(c, state)]
    return [knob_line([knob(model)])]


PROGRESS = ("FloatProgressModel", "IntProgressModel")


def progress_line(models: list[dict]) -> nbformat.NotebookNode:
    """A progress bar (tqdm's: text, bar, text) as the line it ended on, e.g.
    "train: 100% 3/3 [00:04<00:00]"."""
    words = []
    for m in models:
        s = m.get("state", {})
        if m.get("model_name") in PROGRESS:
            words.append(f"{100 * s.get('value', 0) / (s.get('max') or 1):.0f}%")
        else:
            words.append(html.unescape(re.sub(r"<[^>]*>", "", str(s.get("value", "")))).strip())
    if sum("%" in w for w in words) > 1:          # tqdm writes the percentage in its text too
        words = [w for m, w in zip(models, words) if m.get("model_name") not in PROGRESS]
    return nbformat.v4.new_output("stream", name="stdout", text=" ".join(w for w in words if w) + "\n")


def knob(model: dict) -> str:
    s = model.get("state", {})
    label = s.get("description") or model.get("model_name", "widget")
    if "min" in s and "max" in s:
        return f"{label}: {s['min']:g} … {s['max']:g}, step {s.get('step', 1):g}"
    if "_options_labels" in s:
        return f"{label}: {' | '.join(s['_options_labels'])}"
    return label


def knob_line(knobs: list[str]) -> nbformat.NotebookNode:
    text = ("Knobs (they move when you run the notebook; shown here at their first values): "
            + "; ".join(knobs))
    return nbformat.v4.new_output("display_data", data={
        "text/plain": text, "text/html": f'<p class="site-knobs">{html.escape(text)}</p>'})


def title(nb) -> str:
    """A lesson's title: the first line of its first cell, without the '#'."""
    first = nb.cells[0].source.strip().splitlines()[0] if nb.cells else ""
    return first.lstrip("#").strip()


def table_rows(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.lstrip().startswith("|")]


def readme_lines(readme: Path = ROOT / "README.md") -> dict[str, str]:
    """One line per lesson from README's lesson table: notebook file name -> what it settles."""
    lines = {}
    for row in table_rows(readme.read_text(encoding="utf-8") if readme.exists() else ""):
        if len(row) >= 3 and re.fullmatch(r"`notebooks/[^`]+\.ipynb`", row[1]):
            lines[row[1].strip("`").split("/")[-1]] = row[2]
    return lines


def course_plan(guide: Path = ROOT / "docs" / "teaching.md") -> dict[str, dict[str, str]]:
    """The course-plan table of the teaching guide: lesson number -> {column: cell}."""
    plan, header = {}, None
    for row in table_rows(guide.read_text(encoding="utf-8") if guide.exists() else ""):
        if row and row[0] == "#":
            header = [h.lower() for h in row]
        elif header and row and re.fullmatch(r"\d\d[a-z]?", row[0]):     # 11, 11b
            plan[row[0]] = dict(zip(header, row))
    return plan


# ------------------------------------------------------------------ figures' alt text

def plain_text(markdown: str) -> str:
    """Markdown as the words a screen reader should say: links, emphasis, code and maths
    delimiters dropped, whitespace collapsed."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"[*_`]+|\$+|\\[,;!]", "", text)
    return re.sub(r"\s+", " ", text).strip()


def first_sentence(markdown: str, limit: int = 300) -> str:
    """The first sentence of a markdown cell's prose, at most `limit` characters. Headings,
    tables, code and a paragraph that only leads into one ("Symbols:") are left out; a cell
    with nothing else gives its headings."""
    blocks, heads, fence, current = [], [], False, []
    for line in markdown.splitlines() + [""]:
        if line.lstrip().startswith("```"):
            fence = not fence
        is_prose = not fence and line.strip() and not line.lstrip().startswith(("|", "```")) \
            and not re.match(r"\s*#{1,6}\s", line)
        if is_prose:
            current.append(re.sub(r"^\s*(?:[-*+]|\d+\.)\s+", "", line))    # list markers
            continue
        if current:
            blocks.append(plain_text(" ".join(current)))
            current = []
        if not fence and re.match(r"\s*#{1,6}\s", line):
            heads.append(line.strip().lstrip("#"))
    prose = [b for b in blocks if b and not (b.endswith(":") and not re.search(r"[.!?]\s", b))]
    text = prose[0] if prose else plain_text(". ".join(heads))
    m = re.match(r"(.+?[.!?])(?=\s|$)", text)
    sentence = m.group(1) if m else text
    return sentence if len(sentence) <= limit else sentence[:limit - 1].rstrip() + "…"


def figure_alt(titles: list[str], before: str) -> str:
    """A figure's alt text: its title(s), then the first sentence of the text before it."""
    named = "; ".join(re.sub(r"\s+", " ", t).strip() for t in titles)
    sentence = first_sentence(before)
    if named and sentence:
        return f"{named}. {sentence}" if not named.endswith((".", "?", "!")) else f"{named} {sentence}"
    return named or sentence or "A figure of this lesson."


def describe_figures(nb) -> int:
    """Give every image output `metadata["site_alt"]`: the titles its figure carried (see
    `SETUP`) and the first sentence of the nearest markdown cell above. Returns the count."""
    before, count = "", 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            before = cell.source
            continue
        for out in cell.get("outputs", []):
            if any(k.startswith("image/") for k in out.get("data", {})):
                titles = out.get("metadata", {}).get("figure", {}).get("titles", [])
                out.setdefault("metadata", {})["site_alt"] = figure_alt(titles, before)
                count += 1
    return count


# ------------------------------------------------------------------ links

ANCHOR = re.compile(r"<a\b([^>]*)>(.*?)</a>", re.S)
HREF = re.compile(r'\bhref="([^"]*)"')


def rewrite_links(page_html: str, source_dir: Path, pages: dict[Path, str],
                  site_files: set[str]) -> str:
    """Point a page's relative links at the site: a repository file the site renders (the
    glossary, the teaching guide, a lesson) -> its page, the #fragment kept; any other
    repository file (an exercise, a library module) -> its path as text, unlinked, since the
    site does not hold it. Web links, #fragments and the site's own pages stay."""
    def one(m):
        attrs, inner = m.group(1), m.group(2)
        found = HREF.search(attrs)
        if not found:
            return m.group(0)
        href = html.unescape(found.group(1))
        if not href or href.startswith(("#", "/")) or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", href):
            return m.group(0)
        path, _, fragment = href.partition("#")
        path = path.split("?")[0]
        if path in site_files:
            return m.group(0)
        target = (source_dir / unquote(path)).resolve()
        if target in pages:
            new = pages[target] + (f"#{fragment}" if fragment else "")
            attrs = HREF.sub(lambda _: 'href="' + html.escape(new) + '"', attrs, count=1)
            return f"<a{attrs}>{inner}</a>"
        try:
            rel = target.relative_to(ROOT).as_posix()
        except ValueError:                     # outside the repository: keep the words only
            return f'<span class="site-path">{inner}</span>'
        hint = (", an exercise: open it in JupyterLab (<code>make lab</code>)"
                if rel.startswith("exercises/") else ", in the repository")
        words = re.sub(r"<[^>]+>", "", inner).strip()
        shown = (f"<code>{html.escape(rel)}</code>{hint}" if words == rel
                 else f"{inner} (<code>{html.escape(rel)}</code>{hint})")
        return f'<span class="site-path">{shown}</span>'
    return ANCHOR.sub(one, page_html)


def page(title_: str, body: str) -> str:
    """A plain page (index, teaching guide) with its CSS inline."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>{html.escape(title_)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em;
  line-height: 1.5; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.35em 0.5em; text-align: left;
  vertical-align: top; }}
td p {{ margin: 0; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
h2 {{ margin-top: 1.6em; }}
.num {{ text-align: right; white-space: nowrap; }}
</style></head><body>
{body}
</body></html>
"""


def index_page(lessons: list[dict], has_guide: bool, has_glossary: bool = False) -> str:
    plan = course_plan()
    rows = []
    for lesson in lessons:
        number = lesson["name"].split("_")[0]          # "11", "11b"
        builds_on = plan.get(number, {}).get("builds on", "")
        rows.append(
            f'<tr><td>{html.escape(number)}</td>'
            f'<td><a href="{lesson["href"]}">{html.escape(lesson["title"])}</a></td>'
            f'<td>{markdown2html(lesson["line"])}</td><td>{html.escape(builds_on)}</td>'
            f'<td class="num">{lesson["seconds"]:.0f} s</td></tr>')
    guide = ('<p>Teaching with it: <a href="teaching.html">the course plan</a> (order, timing, '
             'live cells, questions, homework).</p>' if has_guide else "")
    if has_glossary:
        guide += ('<p>Words and symbols: <a href="glossary.html">the glossary</a> (one notation for '
                  'the whole course, and every term with the lesson that teaches it).</p>')
    cpus = {lesson["cpus"] for lesson in lessons}
    return page("picolib — the lessons", f"""
<h1>picolib — the lessons</h1>
<p>Every lesson below was executed for this site, with its outputs and figures as they came
out; the assertions in the cells passed. To run a lesson and turn its knobs yourself:
<code>make lab</code>. Read them in order: each builds on the lessons named beside it.
<code>make slides</code> writes a reveal.js deck of each lesson into <code>build/slides/</code>.</p>
{guide}
<table>
<tr><th>#</th><th>lesson</th><th>what it settles</th><th>builds on</th>
<th class="num">run time</th></tr>
{chr(10).join(rows)}
</table>
<p>Run time: the wall-clock seconds the whole lesson took to execute for this build, on a
machine with {", ".join(str(c) for c in sorted(cpus, key=str))} CPU cores (also in
<code>timings.json</code>).</p>
""")


def export(nb, resources: dict, mathjax_url: str | None = None) -> str:
    # a cell tagged `prose` speaks through its output (picolib.prose.say): the page shows the text only
    from nbconvert import HTMLExporter
    config = Config()
    config.TagRemovePreprocessor.enabled = True
    config.TagRemovePreprocessor.remove_input_tags = {"prose"}
    exporter = HTMLExporter(config=config, template_name="picolib_site",
                            extra_template_basedirs=[str(TEMPLATES)], embed_images=True)
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return body


MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"


def local_mathjax(out: Path) -> str:
    """Copy MathJax 2 from the `jupyter-server-mathjax` package (PyPI; the `notebooks` extra)
    into the site and return the pages' relative URL for it, so maths typesets offline."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise SystemExit("the site typesets maths with a local MathJax: pip install jupyter-server-mathjax "
                         "(it comes with `pip install -e '.[notebooks]'`), or pass --mathjax-url") from None
    static = Path(jupyter_server_mathjax.__file__).parent / "static"
    if not (out / "mathjax" / "MathJax.js").exists():
        shutil.copytree(static, out / "mathjax", dirs_exist_ok=True)
    return f"mathjax/MathJax.js?config={MATHJAX_CONFIG}"


def write_site(executed: list[Path], out: Path, mathjax_url: str | None = None) -> dict:
    """HTML pages, index.html, teaching.html, glossary.html and timings.json for executed
    lessons. Maths typesets with the local copy of MathJax unless `mathjax_url` names another."""
    out.mkdir(parents=True, exist_ok=True)
    mathjax_url = mathjax_url or local_mathjax(out)
    nbs = [(Path(p), nbformat.read(p, as_version=4)) for p in sorted(executed, key=lambda p: Path(p).name)]
    lines = readme_lines()
    lessons = []
    for path, nb in nbs:
        run = nb.metadata.get("site", {})
        lessons.append({"name": path.stem, "href": f"{path.stem}.html", "title": title(nb),
                        "line": lines.get(path.name, ""), "seconds": run.get("seconds", 0.0),
                        "cells": run.get("cells", {}), "cpus": run.get("cpus"),
                        "date": run.get("date", "")})
    guide, glossary = ROOT / "docs" / "teaching.md", ROOT / "docs" / "glossary.md"
    pages = {(ROOT / "notebooks" / f"{les['name']}.ipynb").resolve(): les["href"] for les in lessons}
    for source, href in ((guide, "teaching.html"), (glossary, "glossary.html")):
        if source.exists():
            pages[source.resolve()] = href
    site_files = {"index.html", *pages.values()}
    for i, ((path, nb), lesson) in enumerate(zip(nbs, lessons)):
        near = {"prev": lessons[i - 1] if i > 0 else None,
                "next": lessons[i + 1] if i + 1 < len(lessons) else None}
        site = {k: v and {"href": v["href"], "title": v["title"]} for k, v in near.items()}
        site["math"] = any("$" in c.source for c in nb.cells if c.cell_type == "markdown")
        site["run"] = (f"Executed on {lesson['date']} in {lesson['seconds']:.0f} s "
                       f"({lesson['cpus']} CPU cores). Run it yourself: make lab.")
        site["glossary"] = glossary.exists()
        describe_figures(nb)
        resources = {"metadata": {"name": lesson["title"], "path": str(ROOT / "notebooks")},
                     "site": site}
        body = rewrite_links(export(nb, resources, mathjax_url), ROOT / "notebooks", pages, site_files)
        (out / lesson["href"]).write_text(body, encoding="utf-8")
    nav = '<p><a href="index.html">all lessons</a>' + (
        ' · <a href="glossary.html">glossary</a>' if glossary.exists() else "") + "</p>"
    for source, href, name in ((guide, "teaching.html", "teaching guide"),
                               (glossary, "glossary.html", "glossary")):
        if source.exists():
            body = nav + markdown2html(source.read_text(encoding="utf-8"))
            (out / href).write_text(page(f"picolib — {name}", rewrite_links(
                body, source.parent, pages, site_files)), encoding="utf-8")
    (out / "index.html").write_text(index_page(lessons, guide.exists(), glossary.exists()),
                                    encoding="utf-8")
    timings = {"cpus": sorted({les["cpus"] for les in lessons}, key=str),
               "lessons": {les["name"]: {"seconds": les["seconds"], "date": les["date"],
                                         "slowest_cells": dict(sorted(
                                             les["cells"].items(), key=lambda kv: -kv[1])[:3])}
                           for les in lessons}}
    (out / "timings.json").write_text(json.dumps(timings, indent=1) + "\n", encoding="utf-8")
    return timings


def stamp(src: Path) -> str:
    """What an executed notebook depends on: the notebook, picolib's sources, the setup cell
    and the torch of this environment (the kernel's: nbclient starts this Python)."""
    h = hashlib.sha256(Path(src).read_bytes())
    for f in sorted((ROOT / "picolib").rglob("*.py")):
        h.update(f.relative_to(ROOT).as_posix().encode() + f.read_bytes())
    h.update(SETUP.encode())
    try:
        h.update(metadata.version("torch").encode())
    except metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:20]


def executed_path(src: Path, into: Path = EXECUTED) -> Path:
    """build/executed/<lesson>.ipynb; a notebook of another folder (solutions/) in its own."""
    src = Path(src)
    return into / src.name if src.parent.name == "notebooks" else into / src.parent.name / src.name


def _stamp_of(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["metadata"].get("executed", {}).get("stamp")
    except (OSError, ValueError, KeyError):
        return None


def ensure_executed(src: Path, into: Path = EXECUTED, timeout: float = 300, run: str = "") -> Path:
    """The executed copy of `src`, run now unless a copy with the current stamp exists. A
    lock per notebook: a second caller waits for the first caller's run and reads its file. A
    failure raises LessonFailed, and again for each caller of the same `run` (one pytest
    session) without running the notebook again."""
    src, into = Path(src), Path(into)
    dest = executed_path(src, into)
    dest.parent.mkdir(parents=True, exist_ok=True)
    key = stamp(src)
    failed = dest.with_suffix(".failed")
    with open(dest.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp_of(dest) == key:
            return dest
        if run and failed.exists():
            memo = json.loads(failed.read_text(encoding="utf-8"))
            if memo.get("stamp") == key and memo.get("run") == run:
                raise LessonFailed(memo["error"])
        try:
            write_executed(src, dest, timeout, key)
        except LessonFailed as err:
            failed.write_text(json.dumps({"stamp": key, "run": run, "error": str(err)}), encoding="utf-8")
            raise
        finally:
            with open(into / "runs.log", "a", encoding="utf-8") as log:
                log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {run or '-'} {os.getpid()} "
                          f"{dest.relative_to(into).as_posix()} {key}\n")
        failed.unlink(missing_ok=True)
    return dest


def runs(into: Path = EXECUTED, run: str | None = None) -> dict[str, int]:
    """How many times each notebook was executed (in session `run`, or ever), from runs.log."""
    counts: dict[str, int] = {}
    log = into / "runs.log"
    for line in log.read_text(encoding="utf-8").splitlines() if log.exists() else []:
        parts = line.split()
        if len(parts) == 5 and (run is None or parts[1] == run):
            counts[parts[3]] = counts.get(parts[3], 0) + 1
    return counts


def write_executed(src: Path, dest: Path, timeout: float, key: str | None = None) -> None:
    nb = execute(src, timeout)
    nb.metadata["executed"] = {"stamp": key or stamp(src), "source": Path(src).name}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(dest)                   # only a finished run leaves a file behind
    print(f"{src.name}: {nb.metadata['site']['seconds']:.1f} s", flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="execute the lessons and write the site")
    b.add_argument("--only", nargs="*", help="lesson numbers, e.g. 00 01")
    e = sub.add_parser("execute", help="execute notebooks whose executed copy is missing or stale")
    e.add_argument("sources", nargs="+", type=Path)
    e.add_argument("--into", type=Path, default=EXECUTED)
    h = sub.add_parser("html", help="write the site from executed notebooks")
    h.add_argument("executed", nargs="+", type=Path)
    for p in (b, e):
        p.add_argument("--timeout", type=float, default=300, help="seconds per cell")
    for p in (b, h):
        p.add_argument("--out", type=Path, default=ROOT / "build" / "site")
        p.add_argument("--mathjax-url", help="MathJax 2 to typeset maths with (default: a copy of the "
                                             "jupyter-server-mathjax package's, written beside the pages)")
    args = ap.parse_args(argv)
    try:
        if args.command == "execute":
            for src in args.sources:
                ensure_executed(src, args.into, args.timeout)
        elif args.command == "html":
            write_site(args.executed, args.out, args.mathjax_url)
        else:
            sources = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
                       if not args.only or p.name[:2] in args.only]
            executed = [ensure_executed(src, EXECUTED, args.timeout) for src in sources]
            write_site(executed, args.out, args.mathjax_url)
    except LessonFailed as err:
        print(f"site build failed — {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
