"""A virtual environment with one given torch, for `make test-torch TORCH_VERSION=X`.

Prints the environment's path. It lives outside the clone, under
${XDG_CACHE_HOME:-~/.cache}/picolib/, named after the torch version, the Python and a hash of
what it installs besides torch (pyproject.toml's dependencies and the test tools), so CI reuses
it between runs on the same machine and a change of dependencies builds a new one. It holds torch (PyPI's wheel: the CUDA build on Linux, which also runs on a
CPU), picolib's dependencies and what pytest needs to run notebooks — not picolib itself: the
caller puts the clone on PYTHONPATH, so one environment serves every clone.

The host's pip constraints are set aside for this install (PIP_CONSTRAINT: an empty file):
a machine may cap torch below the version asked for. A lock lets two runs share the cache.
"""
import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_TOOLS = ["pytest", "pytest-xdist", "nbval", "ipykernel"]   # pytest -n 2 --nbval-lax, with a kernel


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picolib"


def no_constraints() -> dict:
    """The environment for a pip that ignores the host's constraints (an empty file)."""
    empty = cache_dir() / "no-constraints.txt"
    empty.parent.mkdir(parents=True, exist_ok=True)
    empty.write_text("")
    return {**os.environ, "PIP_CONSTRAINT": str(empty)}


def requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    return [d for d in project["dependencies"] if not re.match(r"torch\b", d)] + TEST_TOOLS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="a torch release on PyPI, e.g. 2.6.0")
    ap.add_argument("--python", default=sys.executable, help="the Python to build it from")
    args = ap.parse_args()
    if not re.fullmatch(r"\d+\.\d+\.\d+", args.version):
        ap.error(f"TORCH_VERSION must be a release like 2.6.0, not {args.version!r}")
    pyproject = ROOT / "pyproject.toml"
    py = subprocess.run([args.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                        capture_output=True, text=True, check=True).stdout.strip()
    wanted = requirements(pyproject)
    key = hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:10]
    env = cache_dir() / f"venv-torch-{args.version}-py{py}-{key}"
    stamp = env / ".complete"
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"venv-torch-{args.version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            shutil.rmtree(env, ignore_errors=True)          # a build that was cut off
            print(f"building {env} (torch {args.version}: a download of a few GB the first time)",
                  file=sys.stderr)
            subprocess.run([args.python, "-m", "venv", str(env)], check=True)
            subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--progress-bar", "off", f"torch=={args.version}", *wanted],
                           check=True, env=no_constraints())
            stamp.touch()
            for old in cache_dir().glob(f"venv-torch-{args.version}-py{py}-*"):
                if old != env:                               # made for other requirements
                    shutil.rmtree(old, ignore_errors=True)
    print(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
