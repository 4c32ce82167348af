"""The setup path of a learner who brings their own torch (Colab, a GPU image): `make test-setup`.

A fresh virtual environment holds only a given torch (from a directory kept in the cache, put on
its path as Colab's system packages are) and a Jupyter kernel to run cells in. Lesson 00 then
runs from its first cell: the setup cell installs picolib from this clone with the documented
command, the check line passes, the lesson runs. Afterwards picolib is installed and torch is
the one the environment had. Exit status 0 when all of that holds.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_env import ROOT, cache_dir, uv_install  # noqa: E402

KERNEL = ["ipykernel", "nbclient"]          # a Jupyter's own: a kernel and what runs cells in it

RUN_LESSON = """
import nbclient, nbformat
nb = nbformat.read("00_collectives.ipynb", as_version=4)
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "."}}).execute()
print("lesson 00 ran:", sum(c.cell_type == "code" for c in nb.cells), "code cells")
"""


def torch_only(version: str, python: str, py: str) -> Path:
    """A directory with torch and its own dependencies, nothing else (built once)."""
    where = cache_dir() / f"torch-only-{version}-py{py}"
    if not (where / ".complete").exists():
        shutil.rmtree(where, ignore_errors=True)
        print(f"building {where} (torch {version} alone)", file=sys.stderr)
        uv_install(python, [f"torch=={version}"], target=where)   # linked from uv's cache
        (where / ".complete").touch()
    return where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="the torch release the environment has, e.g. 2.6.0")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    py = subprocess.run([args.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                        capture_output=True, text=True, check=True).stdout.strip()
    base = torch_only(args.version, args.python, py)
    with tempfile.TemporaryDirectory(prefix="picolib-setup-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([args.python, "-m", "venv", str(venv)], check=True)
        python = str(venv / "bin" / "python")
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "preinstalled-torch.pth").write_text(f"{base}\n")
        subprocess.run([python, "-m", "pip", "install", "-q", *KERNEL], check=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # picolib: not yet
        subprocess.run([python, "-c", RUN_LESSON], cwd=ROOT / "notebooks", check=True, env=env)
        after = subprocess.run([python, "-c", "import picolib, torch; print(torch.__version__, torch.__file__)"],
                               capture_output=True, text=True, check=True, env=env, cwd=tmp).stdout.split()
        if not (after[0].startswith(args.version) and after[1].startswith(str(base))):
            print(f"the setup replaced the environment's torch: now {after}", file=sys.stderr)
            return 1
    print(f"setup path: torch {args.version} kept, picolib installed, lesson 00 ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
