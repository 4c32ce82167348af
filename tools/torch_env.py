"""A virtual environment with one given torch, for `make test-torch TORCH_VERSION=X`.

Prints the environment's path. It lives outside the clone, under
${XDG_CACHE_HOME:-~/.cache}/picolib/, named after the torch version, the Python and a hash of
what it installs besides torch (pyproject.toml's dependencies and the test tools), so CI reuses
it between runs on the same machine and a change of dependencies builds a new one. It holds
torch (PyPI's wheel: the CUDA build on Linux, which also runs on a CPU), picolib's dependencies
and what pytest needs to run notebooks — not picolib itself: the caller puts the clone on
PYTHONPATH, so one environment serves every clone.

uv builds it (`uv venv`, `uv pip install`), with its wheel cache in the same folder: a fresh
machine downloads each torch once, in parallel pieces, and every later environment of that torch
(this one rebuilt, `make test-setup`'s torch-only folder) links the files from the cache in
seconds. uv is the one on PATH, else a pinned uv that pip installs into the cache folder once.
uv reads none of pip's configuration, so a host's pip constraints (which may cap torch below the
version asked for) do not apply. A lock lets two runs share the cache.
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
TEST_TOOLS = ["pytest", "pytest-xdist", "nbclient", "ipykernel"]   # pytest -n 2, notebooks in a kernel
# torch.compile's inductor imports setuptools on older torch (2.6: lesson 12); pip's venvs came
# with it, uv's come bare
TEST_TOOLS += ["setuptools"]
UV = "uv==0.13.9"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picolib"


def uv() -> list[str]:
    """The uv command: the one on PATH, else the pinned one, installed by pip into the cache once."""
    found = shutil.which("uv")
    if found:
        return [found]
    where = cache_dir() / UV.replace("==", "-")
    if not (where / "bin" / "uv").exists():
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--target", str(where), UV], check=True)
    return [str(where / "bin" / "uv")]


def uv_env() -> dict:
    """The environment uv runs in: its wheel cache beside the environments it builds."""
    return {**os.environ, "UV_CACHE_DIR": str(cache_dir() / "uv"), "UV_NO_PROGRESS": "1"}


def uv_install(python: str, packages: list[str], target: Path | None = None) -> None:
    """`uv pip install` of `packages` for the interpreter `python` (into `target` if given)."""
    where = ["--target", str(target)] if target else []
    subprocess.run([*uv(), "pip", "install", "-q", "--python", python, *where, *packages],
                   check=True, env=uv_env())


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
            subprocess.run([*uv(), "venv", "-q", "--python", args.python, str(env)], check=True, env=uv_env())
            uv_install(str(env / "bin" / "python"), [f"torch=={args.version}", *wanted])
            stamp.touch()
            for old in cache_dir().glob(f"venv-torch-{args.version}-py{py}-*"):
                if old != env:                               # made for other requirements
                    shutil.rmtree(old, ignore_errors=True)
    print(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
