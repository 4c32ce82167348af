"""What the lessons need, checked in one line: every lesson's first cell calls `check()`.

A learner who brings their own Python (Colab, a GPU image, a workstation) gets one line naming
what is missing or too old, instead of a traceback part-way through a lesson. `needs()` guards
a lesson section that an older torch cannot run. Nothing here imports torch, so a missing torch
is reported too.
"""
import importlib.metadata
import re
import sys

MIN_PYTHON = (3, 10)
MIN_TORCH = "2.6"
# pyproject.toml's dependencies, with their lowest versions (tests/lib/test_requirements.py
# keeps the two lists equal); triton is lesson 12's alone, and that lesson checks it itself
REQUIRED = {"torch": MIN_TORCH, "numpy": None, "matplotlib": None, "cloudpickle": "3", "tqdm": None}
SETUP = "the setup cell at the top of lesson 00 (or the README's) installs what is missing"


class RequirementError(ImportError):
    """Shown by IPython as its one-line message, without a traceback."""

    def _render_traceback_(self):
        return [f"{type(self).__name__}: {self}"]


def version_tuple(text):
    """The release numbers a version string starts with: '2.10.0a0+git3f2b' -> (2, 10, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def at_least(found, wanted):
    """True when version `found` is `wanted` or newer ('2.6' matches '2.6.0+cu124' and '2.6.1')."""
    want = version_tuple(wanted)
    return version_tuple(found)[:len(want)] >= want


def installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def problems(versions=None, python=None):
    """What is missing or too old, one short phrase each; `versions` maps a distribution to
    its installed version (None: absent), read from this environment when not given."""
    python = tuple(sys.version_info[:3] if python is None else python)
    found = {name: installed(name) for name in REQUIRED} if versions is None else versions
    out = []
    if python[:2] < MIN_PYTHON:
        out.append(f"Python >= {'.'.join(map(str, MIN_PYTHON))} (this is {'.'.join(map(str, python))})")
    for name, lowest in REQUIRED.items():
        have = found.get(name)
        if have is None:
            out.append(f"{name}{f' >= {lowest}' if lowest else ''} (not installed)")
        elif lowest and not at_least(have, lowest):
            out.append(f"{name} >= {lowest} (this is {have})")
    return out


def check(versions=None, python=None):
    """Raise RequirementError naming everything missing or too old; else print one line."""
    wrong = problems(versions, python)
    if wrong:
        raise RequirementError(f"picolib needs {'; '.join(wrong)}. {SETUP}.")
    found = {name: installed(name) for name in REQUIRED} if versions is None else versions
    print(f"torch {found['torch']}, Python {sys.version.split()[0]}: the lessons' requirements are met")


def needs(wanted, what, have=None):
    """For a section an older torch cannot run: True when torch is `wanted` or newer; else
    print one line saying what the section needs, and return False (its cells then skip)."""
    have = installed("torch") if have is None else have
    if at_least(have, wanted):
        return True
    print(f"needs torch >= {wanted} for this section ({what}; this is torch {have}): its cells skip")
    return False
