"""The site (`make site`, tools/site.py) and the decks (`make slides`, tools/slides.py): one
short lesson is executed and exported beside a one-cell lesson after it. No cell errored,
every figure is in the page as a data: URI (the try-it cell's too) with its title in its alt
text, the index and the previous/next links lead to pages that exist, the glossary is a page
linked from the index and every lesson, no link points to a file the site does not have,
nothing is fetched while the pages are written, and a failing cell stops the build naming the
lesson and the cell."""
import importlib.util
import re
import socket
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from unittest import mock

import nbformat
import pytest
from nbconvert import SlidesExporter

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "notebooks" / "04_tensor_parallel.ipynb"   # the shortest lesson (~10 s), no timing asserts
PAGE = LESSON.stem + ".html"


def _tool(name):
    # tools/site.py shares its name with the standard library's `site`: load it by path
    spec = importlib.util.spec_from_file_location(f"picolib_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


site_tool, slides_tool = _tool("site"), _tool("slides")


class Tags(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.tags = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def all(self, tag, **where):
        return [a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in where.items())]


KNOWN_TEXT = ("### A figure\n\nA known sentence about [ranks](../docs/glossary.md#rank). A second one; "
              "then [the exercises](../exercises/04_tensor_parallel.ipynb), [the comm module]"
              "(../picolib/comm.py) and [lesson 04](04_tensor_parallel.ipynb).")
KNOWN_FIGURE = ("import matplotlib.pyplot as plt\n"
                "fig, ax = plt.subplots(figsize=(3, 2))\n"
                "ax.plot([0, 1]); ax.set_xlabel('step (count)'); ax.set_title('A known title')")


def _lesson(path, cells):
    nb = nbformat.v4.new_notebook(cells=cells)
    nbformat.write(nb, path)
    return path


def _image_outputs(nb):
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs
            if any(k.startswith("image/") for k in o.get("data", {}))]


@pytest.fixture(scope="module")
def built(tmp_path_factory, pytestconfig):
    tmp = tmp_path_factory.mktemp("site")
    after = _lesson(tmp / "99_after.ipynb", [
        nbformat.v4.new_markdown_cell("# 99 · The lesson after\n\nYou will see a link back."),
        nbformat.v4.new_code_cell("print('the next lesson ran')"),
        nbformat.v4.new_markdown_cell(KNOWN_TEXT),
        nbformat.v4.new_code_cell(KNOWN_FIGURE)])
    # lesson 04 as `make test` executed it (its own test, the same run): never executed twice
    executed = [site_tool.ensure_executed(LESSON, Path(pytestconfig.getoption("--executed")),
                                          run=pytestconfig.picolib_run),
                site_tool.ensure_executed(after, tmp / "executed", timeout=120)]
    connections = []

    def refuse(*args, **kwargs):
        connections.append(args)
        raise OSError("the site build must not reach the network")

    with mock.patch.object(socket.socket, "connect", refuse), \
            mock.patch.object(socket, "getaddrinfo", refuse):
        site_tool.write_site(executed, tmp / "site")
    return {"out": tmp / "site", "executed": [nbformat.read(p, as_version=4) for p in executed],
            "connections": connections}


def _page(built, name):
    return (built["out"] / name).read_text(encoding="utf-8")


def test_every_cell_ran_and_none_errored(built):
    nb = built["executed"][0]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    errors = [(i, o.ename) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert nb.metadata["site"]["seconds"] > 0


def test_every_figure_is_embedded_including_the_try_it_cell(built):
    nb = built["executed"][0]
    images = _image_outputs(nb)
    try_it = [i for i, c in enumerate(nb.cells) if "knobs(" in c.source]
    assert len(images) >= 1
    assert try_it and try_it[0] in {i for i, _ in images}, "the try-it figure left its widget"
    assert "widgets" not in nb.metadata
    imgs = Tags(_page(built, PAGE)).all("img")
    assert len(imgs) == len(images)
    assert all(a["src"].startswith("data:image/") for a in imgs)


def test_nothing_is_fetched_while_the_pages_are_written(built):
    assert built["connections"] == []
    # when a page is read: MathJax, on a page with math, is the only thing it asks for, and
    # it comes from the site's own folder (maths typesets offline)
    lesson, plain = Tags(_page(built, PAGE)), Tags(_page(built, "99_after.html"))
    scripts = [a["src"] for a in lesson.all("script") if "src" in a]
    assert len(scripts) == 1 and scripts[0].startswith("mathjax/MathJax.js?config="), scripts
    config = scripts[0].split("config=")[1].split(",")
    assert (built["out"] / "mathjax" / "MathJax.js").is_file()
    assert all((built["out"] / "mathjax" / "config" / f"{name}.js").is_file() for name in config), config
    assert [a for a in plain.all("script") if "src" in a] == []
    for page in (lesson, plain):
        assert [a for a in page.all("link") if a.get("href", "").startswith("http")] == []


def test_the_index_links_every_lesson_in_order(built):
    index = Tags(_page(built, "index.html"))
    hrefs = [a["href"] for a in index.all("a")]
    lessons = [h for h in hrefs if h.endswith(".html") and h[:2].isdigit()]
    assert lessons == [PAGE, "99_after.html"]
    assert all((built["out"] / h).exists() for h in hrefs if not h.startswith("http"))
    assert "vocab-parallel embedding and loss" in _page(built, "index.html")   # the README's line for 04


def test_previous_and_next_links(built):
    first, second = Tags(_page(built, PAGE)), Tags(_page(built, "99_after.html"))
    assert {a["href"] for a in first.all("a", rel="next")} == {"99_after.html"}
    assert first.all("a", rel="prev") == []
    assert {a["href"] for a in second.all("a", rel="prev")} == {PAGE}
    assert second.all("a", rel="next") == []
    assert {a["href"] for a in second.all("a", rel="index")} == {"index.html"}


def test_timings_are_written(built):
    import json
    timings = json.loads(_page(built, "timings.json"))
    assert set(timings["lessons"]) == {LESSON.stem, "99_after"}
    assert timings["lessons"][LESSON.stem]["seconds"] == built["executed"][0].metadata["site"]["seconds"]


def test_the_deck_has_a_slide_per_section_and_every_figure(built):
    nb = built["executed"][0]
    deck, _ = SlidesExporter(reveal_scroll=True).from_notebook_node(nb)
    types = [c.metadata.get("slideshow", {}).get("slide_type") for c in nb.cells]
    tags = Tags(deck)
    slides = [a for a in tags.all("section")]
    assert len(slides) == 2 * types.count("slide") + types.count("subslide")   # a slide is an outer and an inner section
    fragments = [a for t, a in tags.tags if "fragment" in a.get("class", "").split()]
    assert len(fragments) == types.count("fragment") > 0
    assert len([a for a in tags.all("img") if a["src"].startswith("data:image/")]) == len(_image_outputs(nb))
    # a cell that draws a figure is a fragment, so the figure comes on a click
    assert all(types[i] == "fragment" for i, _ in _image_outputs(nb))


def test_a_failing_cell_stops_the_build_naming_the_lesson_and_the_cell(tmp_path):
    broken = _lesson(tmp_path / "98_broken.ipynb", [
        nbformat.v4.new_markdown_cell("# 98 · Broken"), nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("def deep():\n    raise ValueError('on purpose')\ndeep()")])
    into = tmp_path / "out"
    with pytest.raises(site_tool.LessonFailed) as err:
        site_tool.ensure_executed(broken, into, timeout=60, run="r1")
    # the lesson, the cell, its first line and the traceback's end
    assert re.search(r"98_broken\.ipynb: cell 2 \('def deep\(\):'\) failed: .*ValueError: on purpose", str(err.value), re.S)
    assert "deep()" in str(err.value)
    assert not site_tool.executed_path(broken, into).exists()
    with pytest.raises(site_tool.LessonFailed, match="on purpose"):     # the same run: not run again
        site_tool.ensure_executed(broken, into, timeout=60, run="r1")
    assert site_tool.runs(into, "r1") == {site_tool.executed_path(broken, into).relative_to(into).as_posix(): 1}


def test_a_hanging_cell_fails_on_its_timeout(tmp_path):
    hangs = _lesson(tmp_path / "97_hangs.ipynb", [
        nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("import time\ntime.sleep(600)")])
    start = time.perf_counter()
    with pytest.raises(site_tool.LessonFailed, match=r"97_hangs\.ipynb: cell 1 \('import time'\) failed: CellTimeoutError"):
        site_tool.ensure_executed(hangs, tmp_path / "out", timeout=3)
    assert time.perf_counter() - start < 120


ASK = ("import importlib.util, sys\n"
       "spec = importlib.util.spec_from_file_location('s', sys.argv[1]); m = importlib.util.module_from_spec(spec)\n"
       "spec.loader.exec_module(m); print(m.ensure_executed(sys.argv[2], sys.argv[3], 120, run=sys.argv[4]))")


def test_each_notebook_runs_once_and_is_reused_while_its_stamp_holds(tmp_path):
    """Two processes (two xdist workers) ask for the same notebook at once: it runs once, under
    the lock, and both read the same file; a change to the notebook runs it again."""
    for folder in ("notebooks", "solutions"):
        (tmp_path / folder).mkdir()
    src = _lesson(tmp_path / "notebooks" / "96_once.ipynb", [nbformat.v4.new_code_cell("print('ran')")])
    into = tmp_path / "executed"
    asks = [subprocess.Popen([sys.executable, "-c", ASK, str(ROOT / "tools" / "site.py"), str(src), str(into), "r1"],
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = [a.communicate(timeout=300)[0].strip().splitlines()[-1] for a in asks]
    assert paths == [str(into / "96_once.ipynb")] * 2
    assert site_tool.runs(into, "r1") == {"96_once.ipynb": 1}
    site_tool.ensure_executed(src, into, run="r2")
    assert site_tool.runs(into, "r2") == {}                      # current stamp: reused
    nb = nbformat.read(src, as_version=4)
    nb.cells[0].source = "print('ran again')"
    nbformat.write(nb, src)
    site_tool.ensure_executed(src, into, run="r3")
    assert site_tool.runs(into, "r3") == {"96_once.ipynb": 1}   # changed: run again
    assert "ran again" in nbformat.read(into / "96_once.ipynb", as_version=4).cells[0].outputs[0].text
    solution = _lesson(tmp_path / "solutions" / "96_once.ipynb", [nbformat.v4.new_code_cell("1")])
    assert site_tool.ensure_executed(solution, into) == into / "solutions" / "96_once.ipynb"


def test_figure_problems_are_kept_with_their_cell_and_leave_the_outputs(tmp_path):
    src = _lesson(tmp_path / "95_figures.ipynb", [
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt"),
        nbformat.v4.new_code_cell("fig, (a, b) = plt.subplots(1, 2, figsize=(4, 2))\n"
                                  "a.plot([0, 1]); a.set_title('drawn'); b.set_title('left empty')"),
        nbformat.v4.new_code_cell(KNOWN_FIGURE)])
    nb = nbformat.read(site_tool.ensure_executed(src, tmp_path / "out", timeout=120), as_version=4)
    assert [f["cell"] for f in nb.metadata["figures"]] == [1]
    assert "panel 1 ('left empty') is empty" in nb.metadata["figures"][0]["problem"]
    assert not [o for c in nb.cells for o in c.get("outputs", []) if site_tool.FIGURE_MARK in o.get("text", "")]


def test_slide_rule_and_idempotence():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 42 · Title\n\n## Goals"),
        nbformat.v4.new_code_cell("import torch\nfrom picolib import comm"),
        nbformat.v4.new_markdown_cell("## 1 · A section"),
        nbformat.v4.new_markdown_cell("A paragraph."),
        nbformat.v4.new_code_cell("def f(x):\n    return x"),
        nbformat.v4.new_code_cell("fig, ax = plt.subplots()"),
        nbformat.v4.new_code_cell("y = f(2)\nassert y == 2"),
        nbformat.v4.new_code_cell("knobs(f, x=(1, 3, 1))"),
        nbformat.v4.new_markdown_cell("The end of section 1.\n\n## 2 · The next section"),
        nbformat.v4.new_markdown_cell("### A figure title\n\nnot a section")])
    nb.cells[4].metadata["tags"] = ["kept"]
    assert slides_tool.apply(nb) == 10
    assert [c.metadata.slideshow.slide_type for c in nb.cells] == [
        "slide", "skip", "slide", "subslide", "-", "fragment", "fragment", "fragment", "slide",
        "subslide"]
    assert nb.cells[4].metadata["tags"] == ["kept"]
    assert slides_tool.apply(nb) == 0 and slides_tool.differing(nb) == []


def test_every_lesson_carries_the_slide_metadata_of_the_rule():
    """A lesson added or rebuilt without it fails here: run `python tools/slides.py`."""
    stale = {p.name: slides_tool.differing(nbformat.read(p, as_version=4))
             for p in slides_tool.lessons()}
    assert not {k: v for k, v in stale.items() if v}, "run: python tools/slides.py"


def test_the_glossary_is_a_page_linked_from_the_index_and_every_lesson(built):
    glossary = Tags(_page(built, "glossary.html"))
    ids = {a.get("id") for _, a in glossary.tags}
    assert {"process-group", "all-reduce", "f-and-g", "notation"} <= ids
    assert "glossary.html" in {a["href"] for a in Tags(_page(built, "index.html")).all("a")}
    for name in (PAGE, "99_after.html"):
        hrefs = [a["href"] for a in Tags(_page(built, name)).all("a")]
        assert hrefs.count("glossary.html") == 2, (name, "top and bottom bar")


def test_every_figure_has_its_title_and_a_sentence_as_alt_text(built):
    nb = built["executed"][0]
    imgs = Tags(_page(built, PAGE)).all("img")
    outputs = [o for _, o in _image_outputs(nb)]
    assert len(imgs) == len(outputs) > 0
    for img, out in zip(imgs, outputs):
        titles = [" ".join(t.split()) for t in out.metadata.get("figure", {}).get("titles", [])]
        assert titles, "the kernel recorded no title for a figure of lesson 04"
        alt = img.get("alt", "")
        assert alt and "No description" not in alt
        assert all(t in alt for t in titles), (titles, alt)
        assert len(alt) > len("; ".join(titles)) + 10, f"no sentence after the title: {alt!r}"
    # the known figure: its title, then the first sentence of the cell above, links as words
    known = Tags(_page(built, "99_after.html")).all("img")
    assert [a["alt"] for a in known] == ["A known title. A known sentence about ranks."]


def test_no_link_points_to_a_missing_file(built):
    out = built["out"]
    pages = sorted(out.glob("*.html"))
    ids = {p.name: {a.get("id") for _, a in Tags(p.read_text(encoding="utf-8")).tags} for p in pages}
    checked = 0
    for p in pages:
        tags = Tags(p.read_text(encoding="utf-8"))
        refs = ([a.get("href", "") for a in tags.all("a")] + [a.get("href", "") for a in tags.all("link")]
                + [a.get("src", "") for t in ("img", "script") for a in tags.all(t)])
        for ref in refs:
            if not ref or ref.startswith(("#", "data:")) or re.match(r"[a-z][a-z0-9+.-]*:", ref):
                continue
            path, _, fragment = ref.split("?")[0].partition("#")
            assert (out / path).is_file(), f"{p.name} links to {ref}, which the site lacks"
            if fragment and path.endswith(".html"):
                assert fragment in ids[path], f"{p.name} links to {ref}: no such anchor"
            checked += 1
    assert checked > 10
    after = _page(built, "99_after.html")
    assert 'href="glossary.html#rank"' in after and 'href="04_tensor_parallel.html"' in after
    assert "<code>exercises/04_tensor_parallel.ipynb</code>" in after     # kept as text
    assert "<code>picolib/comm.py</code>" in after


def test_a_split_lesson_follows_its_first_half_in_the_index_and_the_links(tmp_path):
    """Lesson 11b (the second half of 11, split without renumbering) comes after 11 and before
    12: in the index, in previous/next, with its own number and the course plan's builds-on."""
    made = [_lesson(tmp_path / f"{name}.ipynb", [nbformat.v4.new_markdown_cell(f"# {title}\n\nYou will.")])
            for name, title in (("12_last", "12 · Last"), ("11b_second", "11b · Second"),
                                ("11_first", "11 · First"))]
    site_tool.write_site(made, tmp_path / "site", mathjax_url="mathjax/MathJax.js")
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    hrefs = [a["href"] for a in Tags(index).all("a") if a["href"][:2].isdigit()]
    assert hrefs == ["11_first.html", "11b_second.html", "12_last.html"]
    assert "<td>11b</td>" in index and "<td>11</td>" in index
    second = Tags((tmp_path / "site" / "11b_second.html").read_text(encoding="utf-8"))
    assert {a["href"] for a in second.all("a", rel="prev")} == {"11_first.html"}
    assert {a["href"] for a in second.all("a", rel="next")} == {"12_last.html"}
    assert "11" in site_tool.course_plan()["11b"]["builds on"]
    names = [p.name for p in slides_tool.lessons()]           # the real lessons, as make site orders them
    assert names.index("11b_planner_case_studies.ipynb") == names.index("11_cluster_planning.ipynb") + 1
    assert names.index("10b_training_run.ipynb") == names.index("10_5d_parallelism.ipynb") + 1
    assert "10" in site_tool.course_plan()["10b"]["builds on"]


def test_a_progress_bar_becomes_the_line_it_ended_on():
    # tqdm.auto in a notebook draws HBox(HTML, FloatProgress, HTML); the page shows its text
    state = {"box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_b", "IPY_MODEL_r"]}},
             "l": {"model_name": "HTMLModel", "state": {"value": "dp2 tp2&nbsp;"}},
             "b": {"model_name": "FloatProgressModel", "state": {"value": 3.0, "max": 3.0}},
             "r": {"model_name": "HTMLModel", "state": {"value": " 3/3 [00:04&lt;00:00]"}}}
    nb = nbformat.v4.new_notebook(metadata={"widgets": {site_tool.WIDGET_STATE: {"state": state}}})
    view = {site_tool.WIDGET_VIEW: {"model_id": "box"}, "text/plain": "HBox(children=(HTML(value='')))"}
    cell = nbformat.v4.new_code_cell("main()", outputs=[nbformat.v4.new_output("display_data", data=view)])
    nb.cells.append(cell)
    site_tool.flatten_widgets(nb)
    text = "".join(o.get("text", "") + str(o.get("data", "")) for o in nb.cells[0].outputs)
    assert text == "dp2 tp2 100% 3/3 [00:04<00:00]\n"
    assert "Model" not in text and "HBox" not in text
    state["l"]["state"]["value"] = "dp2 tp2: 100%"                # tqdm's own text has the percentage
    nb.metadata["widgets"] = {site_tool.WIDGET_STATE: {"state": state}}
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data=view)]
    site_tool.flatten_widgets(nb)
    assert nb.cells[0].outputs[0]["text"] == "dp2 tp2: 100% 3/3 [00:04<00:00]\n"
