"""Write the benchmark tables (docs/benchmarks.md) and the README's summary of them from
bench/results/*.json.

    .venv/bin/python tools/bench_tables.py            # rewrite the tables and the summary
    .venv/bin/python tools/bench_tables.py --check    # exit 1 if a table and its JSON disagree

Each result NAME has one block in docs/benchmarks.md between the marker comments
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; the block is `bench/_report.render(NAME)`,
made from bench/results/NAME.json alone. README.md holds one block between
`<!-- bench-summary -->` and `<!-- /bench-summary -->`: `summary()`, each side-by-side
benchmark's time ratio (picolib / PyTorch's peer) from the same files. Text outside the
markers is left as it is. `make bench` runs every benchmark and then this script.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import _report  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
SUMMARY = re.compile(r"(<!-- bench-summary -->\n)(?P<body>.*?)(<!-- /bench-summary -->)", re.S)
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
        out.append(f"bench/results/{name}.json has no <!-- bench:{name} --> block in {PAGE.name}")
    for name, body in found.items():
        if name not in results:
            out.append(f"{PAGE.name} block {name!r} has no bench/results/{name}.json and renderer")
        elif body != _report.render(name):
            out.append(f"{PAGE.name} block {name!r} differs from bench/results/{name}.json "
                       f"(run tools/bench_tables.py)")
    return out


def _span(ratios) -> str:
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def summary() -> str:
    """The README's table: per side-by-side benchmark, picolib's step time over its PyTorch
    peer's (a range over the benchmark's rows), from bench/results/*.json."""
    load, rows = _report.load, []
    names = {p.stem for p in _report.RESULTS.glob("*.json")}
    if "launch" in names:
        warm = [r["ratio"] for r in load("launch") if r["name"].startswith("allreduce_")]
        rows.append(["launch a trivial job, server warm", "`torch.multiprocessing.spawn`", _span(warm)])
    if "dp_zero" in names:
        peers = {"DDP": "`DistributedDataParallel`", "ZeRO-1": "`ZeroRedundancyOptimizer`",
                 "ZeRO-3": "FSDP2 `fully_shard`"}
        rows += [[r["name"], peers.get(r["name"], "PyTorch"), f"{r['ratio']:.2f}"] for r in load("dp_zero")]
    if "tp_sp" in names:
        rows.append(["TP, TP+SP (tp = 2, 4)", "DTensor `parallelize_module`",
                     _span([r["ratio"] for r in load("tp_sp")["rows"]])])
    if "pipeline" in names:
        rows.append(["pipeline schedules (2 and 4 ranks)", "`torch.distributed.pipelining`",
                     _span([r["ratio"] for r in load("pipeline")["side_by_side"]])])
    if "train_5d" in names:
        rows.append(["the trainer, ZeRO-3 × TP on 4 ranks", "FSDP2 + DTensor TP",
                     f"{load('train_5d')['side_by_side']['ratio']:.2f}"])
    for name in ("model", "model_gpu"):
        if name in names:
            d = load(name)
            where = d["device"] if d["cuda"] else "CPU"
            rows.append([f"the model, one step ({where})", "transformers `LlamaForCausalLM`",
                         f"{d['ratio']:.2f}"])
    return _report._table(["benchmark", "against", "time, picolib / peer"], rows) + "\n"


def rewrite_summary(text: str) -> str:
    return SUMMARY.sub(lambda m: m[1] + summary() + m[3], text)


def summary_problems(text: str) -> list[str]:
    """The README's summary block: missing, or not what `summary()` gives today."""
    m = SUMMARY.search(text)
    if not m:
        return [f"{README.name} has no <!-- bench-summary --> block"]
    return [] if m["body"] == summary() else [
        f"{README.name}'s benchmark summary differs from bench/results/*.json (run tools/bench_tables.py)"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text, readme = PAGE.read_text(), README.read_text()
    if "--check" in argv:
        bad = problems(text) + summary_problems(readme)
        print("\n".join(bad) or "benchmark tables and summary agree with bench/results/*.json")
        return 1 if bad else 0
    new, new_readme = rewrite(text), rewrite_summary(readme)
    if new != text:
        PAGE.write_text(new)
    if new_readme != readme:
        README.write_text(new_readme)
    print(f"{len(blocks(new))} benchmark blocks written in {PAGE.relative_to(ROOT)}, "
          f"and the summary in {README.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
