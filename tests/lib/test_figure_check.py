"""picolib.figure_check sees what a reader cannot: each kind of fault is drawn on purpose and
must be named, with its panel; a figure without faults passes."""
import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from picolib.figure_check import problems, watch  # noqa: E402

plt.rcParams["font.size"] = 10


def _good():
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 1, 2], [1, 3, 2])
    ax.set(title="fine", xlabel="x (s)", ylabel="y (B)")
    for t in ax.get_xticklabels() + ax.get_yticklabels():
        t.set_fontsize(10)
    return fig


def test_a_clean_figure_passes():
    fig = _good()
    assert problems(fig) == []
    plt.close(fig)


def test_a_figure_taller_than_a_screen_and_an_untitled_panel_are_named():
    fig, ax = plt.subplots(figsize=(6, 16))
    ax.plot([0, 1], [0, 1])
    found = problems(fig)
    assert any("16.0 in tall" in p for p in found), found
    assert any("panel 0 has no title, and the figure none" in p for p in found), found
    fig.suptitle("one title for the figure")
    assert not any("no title" in p for p in problems(fig))
    plt.close(fig)


def test_an_empty_panel_is_named():
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.plot([0, 1], [0, 1])
    a.set_title("drawn")
    b.set_title("zig-zag")
    found = problems(fig)
    assert any("panel 1 ('zig-zag') is empty" in p for p in found), found
    plt.close(fig)


def test_a_panel_squeezed_by_a_shared_axis_is_named():
    fig, (a, b) = plt.subplots(2, 1, sharex=True, figsize=(8, 4))
    a.barh([0], [1.0], left=[0])            # one slice: 1 unit long
    a.set_title("one slice")
    b.barh([0], [1375.0], left=[0])         # the other panel's units: 1,375
    b.set_title("eight slices")
    found = problems(fig)
    assert any("panel 0 ('one slice')" in p and "x axis it shares" in p for p in found), found
    assert not any("panel 1" in p and "shares" in p for p in found), found
    plt.close(fig)


def test_data_past_the_limits_are_named():
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 710], [0, 1])
    ax.set_xlim(0, 410)
    ax.set_title("cut")
    found = problems(fig)
    assert any("panel 0 ('cut'): data run" in p and "x axis past its limits" in p for p in found), found
    plt.close(fig)


def test_small_text_is_named_with_its_size():
    fig = _good()
    fig.axes[0].text(1, 2, "tiny label", fontsize=7)
    found = problems(fig)
    assert any("under 9 pt" in p and "7 pt" in p and "tiny label" in p for p in found), found
    plt.close(fig)


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """An in-process IPython shell (what a notebook's kernel runs), its history in memory,
    removed after the test: get_ipython() is None again."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    yield InteractiveShell.instance(config=config)
    InteractiveShell.clear_instance()


def test_watch_checks_each_figure_once_as_ipython_displays_it(shell):
    """The inline backend's own setup (select_figure_formats, run when a kernel imports pyplot)
    comes after `watch` and replaces the image formatters: the check still runs, once per
    figure, and the figure is still drawn as a PNG."""
    from IPython.core.pylabtools import select_figure_formats
    seen = []
    watch(seen.append)
    watch(seen.append)                       # installing twice changes nothing
    select_figure_formats(shell, {"png"})
    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1], [0, 1])
    a.set_title("drawn")
    data, _ = shell.display_formatter.format(fig)
    assert data["image/png"][:4] == b"\x89PNG" or data["image/png"][:4] == "iVBO", list(data)
    shell.display_formatter.format(fig)      # shown again: reported once
    assert sum("panel 1 is empty" in s for s in seen) == 1, seen
    good = _good()
    shell.display_formatter.format(good)
    assert len(seen) == 1, seen
    plt.close("all")


def test_watch_outside_ipython_says_where_it_works():
    with pytest.raises(RuntimeError, match="inside IPython"):
        watch(print)
