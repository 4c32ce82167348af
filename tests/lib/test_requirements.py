"""picolib.requirements: the one-line check every lesson starts with."""
import re
import tomllib
from pathlib import Path

import pytest

from picolib import requirements as req

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "matplotlib": "3.11.2", "cloudpickle": "3.1.3",
        "tqdm": "4.70.1"}


def test_versions_compare_as_numbers_not_text():
    assert req.version_tuple("2.10.0a0+git3f2b") == (2, 10, 0)
    assert req.version_tuple("2.6.0+cu124") == (2, 6, 0)
    assert req.at_least("2.10.0", "2.6") and not req.at_least("2.5.1", "2.6")   # '2.10' < '2.6' as text
    assert req.at_least("2.6.0+cpu", "2.6") and req.at_least("2.6.1", "2.6.0")
    with pytest.raises(ValueError, match="not a version"):
        req.version_tuple("nightly")


def test_a_too_old_torch_is_refused_in_one_line_naming_it():
    old = {**GOOD, "torch": "2.5.1"}
    assert req.problems(old, python=(3, 11, 7)) == ["torch >= 2.6 (this is 2.5.1)"]
    with pytest.raises(req.RequirementError) as info:
        req.check(old, python=(3, 11, 7))
    shown = info.value._render_traceback_()          # what IPython prints instead of a traceback
    assert len(shown) == 1 and "torch >= 2.6 (this is 2.5.1)" in shown[0] and "\n" not in shown[0]


def test_everything_missing_or_too_old_is_named_at_once():
    found = {**GOOD, "numpy": None, "cloudpickle": "2.2.1"}
    assert req.problems(found, python=(3, 9, 18)) == [
        "Python >= 3.10 (this is 3.9.18)", "numpy (not installed)", "cloudpickle >= 3 (this is 2.2.1)"]


def test_a_good_environment_passes_with_one_line(capsys):
    assert req.problems(GOOD, python=(3, 10, 0)) == []
    req.check(GOOD, python=(3, 10, 0))
    assert capsys.readouterr().out.count("\n") == 1
    req.check()                                       # this environment: the suite runs in it
    assert "torch " in capsys.readouterr().out


def test_a_section_that_needs_a_newer_torch_says_so_and_skips(capsys):
    assert not req.needs("2.7", "FSDP2 on the CPU", have="2.6.0+cu124")
    assert capsys.readouterr().out == ("needs torch >= 2.7 for this section (FSDP2 on the CPU; "
                                       "this is torch 2.6.0+cu124): its cells skip\n")
    assert req.needs("2.7", "FSDP2 on the CPU", have="2.13.0") and capsys.readouterr().out == ""


def test_the_check_and_pyproject_name_the_same_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for dep in project["dependencies"]:
        m = re.match(r"([A-Za-z0-9_-]+)\s*(?:>=\s*([0-9.]+))?\s*(;.*)?$", dep)
        if not m.group(3):                             # triton: Linux only, lesson 12's alone
            declared[m.group(1)] = m.group(2)
    assert declared == req.REQUIRED
    assert project["requires-python"] == ">=" + ".".join(map(str, req.MIN_PYTHON))


def test_the_readme_states_the_supported_range():
    readme = (ROOT / "README.md").read_text()
    assert f"torch {req.MIN_TORCH}" in readme and "torch ≥ 2.5" not in readme
