"""Write the README's benchmark tables from bench/results/*.json.

    .venv/bin/python tools/bench_tables.py            # rewrite the tables in README.md
    .venv/bin/python tools/bench_tables.py --check    # exit 1 if a table and its JSON disagree

Each result NAME has one block in README.md between the marker comments
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; the block is `bench/_report.render(NAME)`,
made from bench/results/NAME.json alone. Text outside the markers is left as it is.
`make bench` runs every benchmark and then this script.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import _report  # noqa: E402

README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def blocks(text: str) -> dict[str, str]:
    """{NAME: the text between its two markers} for every block in `text`."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def rewrite(text: str) -> str:
    """`text` with every block replaced by its rendering from bench/results/NAME.json."""
    return BLOCK.sub(lambda m: m[1] + _report.render(m["name"]) + m[4], text)


def problems(text: str) -> list[str]:
    """What disagrees: a block whose text is not its JSON's rendering, a result file with a
    renderer (bench/_report.py RENDERERS) but no block, a block with no result file."""
    found, out = blocks(text), []
    results = {p.stem for p in _report.RESULTS.glob("*.json")}
    for name in sorted(results - _report.RENDERERS.keys()):
        print(f"note: bench/results/{name}.json has no renderer in bench/_report.py (no table)",
              file=sys.stderr)
    results &= _report.RENDERERS.keys()
    for name in sorted(results - found.keys()):
        out.append(f"bench/results/{name}.json has no <!-- bench:{name} --> block in README.md")
    for name, body in found.items():
        if name not in results:
            out.append(f"README.md block {name!r} has no bench/results/{name}.json and renderer")
        elif body != _report.render(name):
            out.append(f"README.md block {name!r} differs from bench/results/{name}.json "
                       f"(run tools/bench_tables.py)")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = README.read_text()
    if "--check" in argv:
        bad = problems(text)
        print("\n".join(bad) or "README benchmark tables agree with bench/results/*.json")
        return 1 if bad else 0
    new = rewrite(text)
    if new != text:
        README.write_text(new)
    print(f"{len(blocks(new))} benchmark blocks written in {README.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
