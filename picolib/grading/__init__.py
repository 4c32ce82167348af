"""Checks for the exercises: `check_<name>(student_fn)` runs a student's function against
picolib's reference (on several ranks where the exercise is distributed), prints what
differs, and raises `ExerciseFailed` if anything does.

Each lesson keeps its checks in its own module (`lesson00.py`, `lesson01.py`, ...);
every `check_*` they define is available here as `picolib.grading.check_*`.
"""
import importlib
import pkgutil

from ._core import ExerciseFailed, call_student, compare, report, run_student

__all__ = ["ExerciseFailed", "call_student", "compare", "report", "run_student"]

for _info in pkgutil.iter_modules(__path__):
    if _info.name.startswith("lesson"):
        _mod = importlib.import_module(f"{__name__}.{_info.name}")
        for _name in dir(_mod):
            if _name.startswith("check_"):
                globals()[_name] = getattr(_mod, _name)
                __all__.append(_name)
