"""Every technique lesson shows the core of the library's own implementation (issue 55).

`CORE` lists, per lesson, each technique and the picolib functions whose source a cell of that
lesson displays with `picolib.source.show` — the code the lesson then runs, the trainer too.
The test fails when a listed function is not shown, when a lesson shows fewer than
`MIN_LINES` lines of core, when it shows something outside the library (a try-it helper, a
grading check, PyTorch), or shows a function it never runs. The audit itself is checked on
made-up lessons that break each rule.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import shown_core  # noqa: E402

MIN_LINES = 15
NOT_CORE = ("picolib.tryit", "picolib.grading", "picolib.source")

# lesson -> technique -> the functions (module-qualified) whose source the lesson shows
CORE: dict[str, dict[str, list[str]]] = {
    "02_data_parallel": {
        "naive DP: one all-reduce per gradient": ["picolib.data_parallel.all_reduce_gradients"],
        "DDP: bucketed all-reduce with overlap": [
            "picolib.data_parallel.DistributedDataParallel._grad_ready",
            "picolib.data_parallel.DistributedDataParallel._launch",
            "picolib.data_parallel.DistributedDataParallel.finish_gradient_sync"],
    },
    "10_5d_parallelism": {"the 5-D composition": ["picolib.compose.transform", "picolib.compose.build"]},
    "08_terapipe": {"TeraPipe": ["picolib.terapipe.CachedAttentionCore.forward", "picolib.terapipe.forward_slice",
                                 "picolib.terapipe.backward_slice", "picolib.terapipe.run_terapipe",
                                 "picolib.terapipe_slicer.least_sum", "picolib.terapipe_slicer.dp_slices"]},
    "09_expert_parallel": {"MoE dispatch/combine": ["picolib.moe.Router.forward", "picolib.moe.sort_by_expert",
                                                    "picolib.moe.MoE.dispatch_combine",
                                                    "picolib.expert_parallel.dispatch_combine"]},
    "04_tensor_parallel": {
        "TP column/row and the f/g pair": [
            "picolib.tensor_parallel.ColumnParallelLinear.forward",
            "picolib.tensor_parallel.RowParallelLinear.forward",
            "picolib.mappings._CopyToRegion", "picolib.mappings._ReduceFromRegion",
            "picolib.tensor_parallel.ParallelAttention._kv", "picolib.mappings._CopyToReplicas"],
        "vocab-parallel embedding and loss": [
            "picolib.vocab_parallel.VocabParallelEmbedding.forward",
            "picolib.vocab_parallel.vocab_parallel_cross_entropy"],
    },
    "05_sequence_parallel": {
        "SP": ["picolib.mappings._AllGatherToRegion", "picolib.mappings._ReduceScatterToRegion",
               "picolib.sequence_parallel.sequence_parallel_region",
               "picolib.sequence_parallel.SequenceParallelRMSNorm.forward",
               "picolib.tensor_parallel.ParallelSwiGLU.forward"],
    },
    "06_context_parallel": {
        "ring attention (forward and backward)": ["picolib.blockwise_attention.merge",
                                                  "picolib.context_parallel.ring_attention_forward",
                                                  "picolib.context_parallel.ring_attention_backward"],
        "zig-zag": ["picolib.context_parallel.chunk_ids", "picolib.blockwise_attention.visible"],
        "all-gather K/V": ["picolib.context_parallel.allgather_attention"],
        "Ulysses": ["picolib.context_parallel.seq_to_heads", "picolib.context_parallel.heads_to_seq",
                    "picolib.context_parallel.ulysses_attention"],
    },
    "07_pipeline_parallel": {
        "the executor": ["picolib.pipeline_parallel.Executor.run", "picolib.pipeline_parallel.Executor.forward",
                         "picolib.pipeline_parallel.Executor.backward"],
        "AFAB/1F1B": ["picolib.pipeline_schedules.afab", "picolib.pipeline_schedules.one_f_one_b"],
        "interleaving": ["picolib.pipeline_schedules.interleaved_1f1b"],
    },
    "07b_zero_bubble_dualpipe": {
        "ZB-H1 and the split backward": ["picolib.pipeline_schedules.zb_h1",
                                         "picolib.pipeline_parallel.Executor.backward_input",
                                         "picolib.pipeline_parallel.Executor.backward_weight",
                                         "picolib.pipeline_parallel.backward_weights"],
        "DualPipe(V)": ["picolib.pipeline_schedules.dualpipev_rank", "picolib.pipeline_schedules.dualpipev"],
    },
    "03_zero": {
        "ZeRO-1": ["picolib.zero.ZeRO.step", "picolib.zero.ZeRO._reduce_scatter"],
        "ZeRO-2": ["picolib.sharded_optim.ShardedUnit.flat_grads", "picolib.zero.ZeRO._backward_done"],
        "ZeRO-3": ["picolib.zero.ZeRO._pre_forward", "picolib.zero.ZeRO._post_forward",
                   "picolib.sharded_optim.ShardedUnit.all_gather", "picolib.sharded_optim.ShardedUnit.free"],
    },
}


# issue 55's list: every technique lesson shows each of these (the keys of its CORE entry)
REQUIRED = {
    "02_data_parallel": {"DDP: bucketed all-reduce with overlap"},
    "03_zero": {"ZeRO-1", "ZeRO-2", "ZeRO-3"},
    "04_tensor_parallel": {"TP column/row and the f/g pair", "vocab-parallel embedding and loss"},
    "05_sequence_parallel": {"SP"},
    "06_context_parallel": {"ring attention (forward and backward)", "zig-zag", "all-gather K/V", "Ulysses"},
    "07_pipeline_parallel": {"the executor", "AFAB/1F1B", "interleaving"},
    "07b_zero_bubble_dualpipe": {"ZB-H1 and the split backward", "DualPipe(V)"},
    "08_terapipe": {"TeraPipe"},
    "09_expert_parallel": {"MoE dispatch/combine"},
    "10_5d_parallelism": {"the 5-D composition"},
}


def test_every_technique_is_shown_somewhere():
    missing = [f"{lesson}: {t}" for lesson, techniques in REQUIRED.items()
               for t in sorted(techniques - set(CORE.get(lesson, {})))]
    assert missing == []


def audit(path: Path, techniques: dict[str, list[str]]) -> list[str]:
    """The problems of one lesson against its entry in CORE (empty when it holds)."""
    name = path.stem
    items = shown_core.shown(path)
    problems = []
    by_name = {s.qualname for s in items}
    for technique, functions in techniques.items():
        if not functions:
            problems.append(f"{name}: no function listed for {technique!r}")
        for fn in functions:
            if fn not in by_name:
                problems.append(f"{name}: {technique!r} needs show({fn.rsplit('.', 2)[-1]}) — not shown")
    for s in items:
        if s.qualname.startswith(NOT_CORE):
            problems.append(f"{name}, cell {s.cell}: shows {s.qualname}, which is not the technique's code")
        if not shown_core.run_elsewhere(path, s):
            problems.append(f"{name}, cell {s.cell}: shows {s.expr} but never runs it")
    total = sum(s.lines for s in items if not s.qualname.startswith(NOT_CORE))
    if techniques and total < MIN_LINES:
        problems.append(f"{name}: {total} lines of core shown, fewer than {MIN_LINES}")
    return problems


@pytest.mark.parametrize("lesson", sorted(CORE))
def test_lesson_shows_its_core(lesson):
    path = ROOT / "notebooks" / f"{lesson}.ipynb"
    assert path.exists(), path
    assert audit(path, CORE[lesson]) == []


def test_shown_functions_are_listed():
    """A lesson that shows library code lists it in CORE, so the table stays the whole story."""
    unlisted = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        listed = {fn for fns in CORE.get(path.stem, {}).values() for fn in fns}
        unlisted += [f"{path.stem}: {s.qualname}" for s in shown_core.shown(path) if s.qualname not in listed]
    assert unlisted == []


# --- the audit on made-up lessons ----------------------------------------------------------------

def _lesson(tmp_path, *sources) -> Path:
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": s}
             for s in sources]
    path = tmp_path / "99_made_up.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


RING = "picolib.comm.ring_all_reduce"


def test_audit_passes_a_lesson_that_shows_and_runs(tmp_path):
    path = _lesson(tmp_path, "from picolib.source import show\nfrom picolib.comm import ring_all_reduce, ring_neighbours",
                   "show(ring_all_reduce, ring_neighbours)", "n, me, right, left = ring_neighbours(g)\nring_all_reduce(x)")
    assert sum(s.lines for s in shown_core.shown(path)) >= MIN_LINES
    assert audit(path, {"ring all-reduce": [RING, "picolib.comm.ring_neighbours"]}) == []


@pytest.mark.parametrize("sources, expected", [
    (("from picolib.source import show\nfrom picolib.comm import ring_all_reduce", "out = ring_all_reduce(x)"),
     "needs show(ring_all_reduce) — not shown"),
    (("from picolib.source import show\nfrom picolib.comm import ring_all_reduce", "show(ring_all_reduce)"),
     "shows ring_all_reduce but never runs it"),
    (("from picolib.source import show\nfrom picolib.comm import ring_all_reduce\n"
      "from picolib.tryit import knobs", "show(ring_all_reduce, knobs)", "ring_all_reduce(x); knobs(f)"),
     "shows picolib.tryit.knobs, which is not the technique's code"),
])
def test_audit_fails_each_broken_rule(tmp_path, sources, expected):
    problems = audit(_lesson(tmp_path, *sources), {"ring all-reduce": [RING]})
    assert any(expected in p for p in problems), problems


def test_audit_counts_lines(tmp_path):
    path = _lesson(tmp_path, "from picolib.source import show\nfrom picolib.prose import pct", "show(pct)", "pct(0.5)")
    problems = audit(path, {"a percentage": ["picolib.prose.pct"]})
    assert any("fewer than 15" in p for p in problems), problems


def test_show_refuses_code_outside_picolib():
    from picolib.source import show
    with pytest.raises(ValueError, match="picolib's own source"):
        show(json.dumps)
