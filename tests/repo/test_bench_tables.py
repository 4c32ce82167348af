"""The benchmark tables (docs/benchmarks.md) and the README's summary of them are generated
from bench/results/*.json (tools/bench_tables.py, bench/_report.py): every result file has its
block, every block is exactly its JSON's rendering, and so is the summary."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "tools" / "bench_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_tables_and_the_readme_summary_agree_with_their_json():
    tool = _tool()
    assert tool.problems(PAGE.read_text()) == []
    assert tool.summary_problems((ROOT / "README.md").read_text()) == []


def test_every_rendered_result_has_a_block():
    tool = _tool()
    names = {p.stem for p in (ROOT / "bench" / "results").glob("*.json")} & set(tool._report.RENDERERS)
    assert {"pipeline", "terapipe", "moe", "context_parallel"} <= names
    assert names == set(tool.blocks(PAGE.read_text()))


def test_a_changed_number_is_caught(tmp_path, monkeypatch):
    """Change one number in a copy of a result file: the block no longer agrees, and
    rewriting it puts the new number in the table; a changed ratio changes the summary."""
    tool = _tool()
    readme = PAGE.read_text()
    summary = (ROOT / "README.md").read_text()
    results = tmp_path / "results"
    results.mkdir()
    for p in (ROOT / "bench" / "results").glob("*.json"):
        (results / p.name).write_text(p.read_text())
    data = json.loads((results / "moe.json").read_text())
    data["rows"][0]["step_s"] = 9.87654
    (results / "moe.json").write_text(json.dumps(data))
    monkeypatch.setattr(tool._report, "RESULTS", results)
    bad = tool.problems(readme)
    assert len(bad) == 1 and "'moe'" in bad[0]
    fixed = tool.rewrite(readme)
    assert "| 9.877 |" in tool.blocks(fixed)["moe"] and tool.problems(fixed) == []
    hand_edit = fixed.replace("| 9.877 |", "| 9.878 |")          # a table typed over by hand
    assert tool.problems(hand_edit) and tool.blocks(hand_edit).keys() == tool.blocks(fixed).keys()
    assert tool.summary_problems(summary) == []
    data = json.loads((results / "train_5d.json").read_text())
    data["side_by_side"]["ratio"] = 0.1234
    (results / "train_5d.json").write_text(json.dumps(data))
    assert len(tool.summary_problems(summary)) == 1
    assert "| 0.12 |" in tool.rewrite_summary(summary)


def test_pipeline_bubbles_recorded_are_todays_code():
    """bench/results/pipeline.json's simulated columns are what the current simulator and op
    lists give (so the table cannot show an old schedule), and every measured bubble there
    is within the benchmark's tolerance of its replay (the run's own op times on ideal devices)."""
    from picolib.pipeline_schedules import bubble_formula, make_schedule
    from picolib.pipeline_simulator import simulate
    from picolib.timeline import bubble_ratio
    b = json.loads((ROOT / "bench" / "results" / "pipeline.json").read_text())["bubble"]
    p, m = b["p"], b["m"]
    for r in b["rows"]:
        v = 2 if r["schedule"] == "interleaved" else 1
        s = make_schedule(r["schedule"], p, m, v)
        k = 1 if s.name == "dualpipe" else s.n_stages // p
        cost = {x: b["cost_s"] / k for x in "FBW"}
        assert r["simulated"] == pytest.approx(bubble_ratio(simulate(s, cost, overlap=False)), abs=1e-4)
        assert r["simulated_fb_chunk"] == pytest.approx(bubble_ratio(simulate(s, cost)), abs=1e-4)
        assert r["formula"] == pytest.approx(bubble_formula(p, m, v, schedule=s.name, cost=cost), abs=1e-4)
        assert abs(r["measured"] / r["replayed"] - 1) <= b["tolerance"], r["schedule"]
