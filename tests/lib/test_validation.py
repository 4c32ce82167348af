"""The planner against published runs (picolib/validation.py), and the op list it prices
(picolib/roofline.layer_ops) against what lesson 12 measures on a real step."""
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.plan_search import model_flops_per_token, step_time
from picolib.roofline import GROUPS, head_ops, layer_ops
from picolib.validation import RUNS, markdown, published_tokens_per_s, table

ROOT = Path(__file__).resolve().parents[2]


def test_layer_ops_are_the_forward_matmuls_a_real_step_counts():
    cfg, b, s = LlamaConfig(), 4, 128
    tokens, targets = random_tokens(b, s)
    with FlopCounterMode(display=False) as fc:
        TinyLlama(cfg).loss(tokens, targets)
    ops = cfg.n_layers * layer_ops(cfg, b * s, s, flash=False) + head_ops(cfg, b * s)
    assert {op["group"] for op in ops} <= set(GROUPS)          # lesson 12's groups
    assert sum(op["flops"] for op in ops if op["kind"] == "matmul") == fc.get_total_flops()


def test_published_figures_convert_by_each_sources_formula():
    llama = RUNS[0]      # 430 TFLOP/s per GPU, picolib's causal count
    assert published_tokens_per_s(llama) == pytest.approx(430e12 / model_flops_per_token(llama.cfg, 8192))
    ds = RUNS[-1]        # 180K GPU hours per trillion tokens
    assert published_tokens_per_s(ds) == pytest.approx(1e12 / 180e3 / 3600)
    nar = next(r for r in RUNS if r.unit.startswith("TFLOP/s (Megatron"))
    kor = next(r for r in RUNS if r.unit.startswith("MFU"))
    # recomputation: Narayanan's 96 counts a second forward that Korthikanti's model FLOPs (72) do not
    for run, per, rate in ((nar, 96, nar.published * 1e12), (kor, 72, kor.published * 312e12)):
        c, s = run.cfg, run.par.seq
        l, h, v = c.n_layers, c.hidden, c.vocab_size
        head = v / ((16 if per == 96 else 12) * l * h)
        flops_per_token = per * l * h * h * (1 + s / (6 * h) + head)
        assert published_tokens_per_s(run) * flops_per_token == pytest.approx(rate)
        assert c.ffn_hidden * 3 == pytest.approx(8 * c.hidden, rel=0.01)   # GPT's 8h² MLP weights


def test_the_validation_table_is_the_planners_and_the_readme_shows_it():
    rows = table()
    assert len(rows) >= 8 and len({r["run"].source.split(",")[0] for r in rows}) >= 4
    assert {r["run"].hw for r in rows} >= {"A100-SXM", "H100-SXM", "H800"}
    assert any(r["run"].moe for r in rows)
    for r in rows:
        t = step_time(r["run"].cfg, r["run"].par, r["run"].hw, r["run"].moe, **r["run"].options)
        assert r["planner"] == t["tokens_per_s"] / r["run"].gpus
        assert abs(r["error"]) < 0.3                               # the table's stated range
    readme = (ROOT / "README.md").read_text()
    assert markdown(rows) in readme
