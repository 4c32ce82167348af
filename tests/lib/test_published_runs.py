"""The planner against published runs (picolib/published_runs.py), and the op list it prices
(picolib/layer_costs.layer_ops) against what lesson 12 measures on a real step."""
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.plan_search import model_flops_per_token, step_time
from picolib.layer_costs import head_ops, layer_ops
from picolib.roofline import GROUPS
from picolib.published_runs import RUNS, markdown, published_tokens_per_s, table

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
    ds = next(r for r in RUNS if r.moe)        # 180K GPU hours per trillion tokens
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


def test_iteration_times_give_each_sources_own_throughput():
    # the sources that state seconds per iteration state a rate too, by their own FLOP count:
    # BLOOM's log 149.77 TFLOP/s and MT-NLG's 126, 121, 113 by Narayanan's 96·B·s·l·h²(…) (they
    # recompute), Nemotron-4's MFU 42.4, 42.3, 41.0 % of 989 TFLOP/s by 6N + the whole square
    stated = {"BLOOM 176B, 384 GPUs": 149.77, "MT-NLG 530B, 2,240 GPUs": 126, "MT-NLG 530B, 2,800 GPUs": 121,
              "MT-NLG 530B, 3,360 GPUs": 113, "Nemotron-4 340B, 1,536 GPUs": 0.424,
              "Nemotron-4 340B, 3,072 GPUs": 0.423, "Nemotron-4 340B, 6,144 GPUs": 0.410}
    runs = {r.name: r for r in RUNS if r.unit == "s per iteration"}
    assert set(runs) == set(stated)
    for name, rate in stated.items():
        run = runs[name]
        c, s = run.cfg, run.par.seq
        l, h, v = c.n_layers, c.hidden, c.vocab_size
        per_token = (model_flops_per_token(c, s, causal=False) / 989e12 if name.startswith("Nemotron")
                     else 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)) / 1e12)
        assert published_tokens_per_s(run) * per_token == pytest.approx(rate, rel=0.006), name
        # planted: the seconds per iteration read as per micro-batch would miss it by m
        wrong = run.tokens / run.par.micro_batches / (run.published * run.gpus)
        assert wrong * per_token != pytest.approx(rate, rel=0.1)


def test_the_validation_table_is_the_planners_and_the_readme_shows_it():
    rows = table()
    assert len(rows) >= 8 and len({r["run"].source.split(",")[0] for r in rows}) >= 4
    assert {r["run"].hw for r in rows} >= {"A100-SXM", "H100-SXM", "H800"}
    assert any(r["run"].moe for r in rows)
    for r in rows:
        t = step_time(r["run"].cfg, r["run"].par, r["run"].hw, r["run"].moe, **r["run"].options)
        assert r["planner"] == t["tokens_per_s"] / r["run"].gpus
        assert abs(r["error"]) < 0.55                              # the table's stated range
    readme = (ROOT / "README.md").read_text()
    assert markdown(rows) in readme
    assert readme.count(markdown(rows).splitlines()[0]) == 1, "the README holds the table twice"


def _matmul_flops(ops, names=None):
    return sum(op["flops"] for op in ops if op["kind"] == "matmul" and (names is None or op["name"] in names))


def test_gpt_block_ops_count_what_a_torch_gpt_block_does():
    # a GPT block from torch's own modules: LayerNorm, biased Linears, a GeLU MLP of 4h
    h, heads, s, b, e = 48, 4, 16, 2, 4
    cfg = LlamaConfig(hidden=h, n_heads=heads, n_kv_heads=heads, ffn_hidden=8 * h // 3, vocab_size=64)
    ln1, ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
    qkv, out = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
    up, down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
    x = torch.randn(b, s, h)
    with FlopCounterMode(display=False) as fc:
        q, k, v = qkv(ln1(x)).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        y = x + out(att.transpose(1, 2).reshape(b, s, h))
        y = y + down(torch.nn.functional.gelu(up(ln2(y))))
    ops = {op["name"]: op for op in layer_ops(cfg, b * s, s, flash=False, e=e, block="gpt")}
    assert "RoPE on q and k" not in ops                       # GPT's positions are an embedding
    assert _matmul_flops(ops.values()) == fc.get_total_flops()
    # LayerNorm writes its output and each token's statistics (torch's own shapes)
    t = x.reshape(b * s, h)
    y_, mean, rstd = torch.ops.aten.native_layer_norm(t, [h], ln1.weight, ln1.bias, 1e-5)
    assert ops["attention norm"]["bytes"] == e * (t.numel() + y_.numel()) + 4 * (mean.numel() + rstd.numel())
    # the biases: q, k, v's added after its matmul; the MLP's fused into the GeLU (read, bias, write)
    pre = t @ up.weight.T
    post = torch.nn.functional.gelu(pre + up.bias)
    assert ops["bias and GeLU"]["bytes"] == e * (pre.numel() + up.bias.numel() + post.numel())
    n = qkv.weight.shape[0]
    assert ops["q, k, v bias"]["bytes"] == e * (2 * b * s * n + qkv.bias.numel())


def test_latent_attention_ops_count_what_a_torch_mla_does():
    # DeepSeek-V3's attention, written out from its shapes (MLA: latents, rope/nope split)
    from picolib.layer_costs import MLAShape
    h, heads, s, b = 64, 4, 16, 2
    m = MLAShape(q_lora=24, kv_lora=16, qk_nope=8, qk_rope=4, v_head=6)
    cfg = LlamaConfig(hidden=h, n_heads=heads, n_kv_heads=heads, ffn_hidden=32, vocab_size=64)
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)          # noqa: E731
    q_down, q_up = lin(h, m.q_lora), lin(m.q_lora, heads * (m.qk_nope + m.qk_rope))
    kv_down, kv_up = lin(h, m.kv_lora + m.qk_rope), lin(m.kv_lora, heads * (m.qk_nope + m.v_head))
    out = lin(heads * m.v_head, h)
    x = torch.randn(b, s, h)
    with FlopCounterMode(display=False) as fc:
        q = q_up(q_down(x)).view(b, s, heads, -1).transpose(1, 2)
        c, k_rope = kv_down(x).split([m.kv_lora, m.qk_rope], dim=-1)
        k_nope, v = kv_up(c).view(b, s, heads, -1).transpose(1, 2).split([m.qk_nope, m.v_head], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(b, heads, s, m.qk_rope)], dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        out(att.transpose(1, 2).reshape(b, s, -1))
    ops = layer_ops(cfg, b * s, s, flash=False, mla=m)
    attention = {"q down", "q up", "kv down", "kv up", "QKᵀ", "scores × V", "attention out"}
    assert attention <= {op["name"] for op in ops}
    assert _matmul_flops(ops, attention) == fc.get_total_flops()
    # the fused kernel does the causal half of the unfused core's FLOPs
    fused = next(op for op in layer_ops(cfg, b * s, s, mla=m) if op["kind"] == "attention")
    assert 2 * fused["flops"] == _matmul_flops(ops, {"QKᵀ", "scores × V"})


def test_the_embeddings_gradient_is_a_dense_table_priced_on_the_first_stage():
    from picolib.hardware import hardware
    from picolib.planner import Parallelism
    from picolib.layer_costs import embedding_ops, op_seconds
    cfg, tokens, e = LlamaConfig(vocab_size=512, hidden=32), 64, 4
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden)
    ids = torch.randint(0, cfg.vocab_size, (tokens,))
    for _ in range(2):                                        # the second one accumulates
        rows = emb(ids)
        rows.backward(torch.ones_like(rows))
    table, grad = emb.weight.grad, rows
    # written dense, the tokens' rows read and read-modified-written, then added to .grad
    expected = e * table.numel() + 3 * e * grad.numel() + 3 * e * table.numel()
    op = embedding_ops(cfg, tokens, e=e)[0]
    assert op["backward_bytes"] == expected
    hw = hardware("H100-SXM")
    assert op_seconds(op, hw, backward=True)[0] == pytest.approx(
        max(expected / (hw.hbm_bandwidth * hw.hbm_eff), hw.launch))
    # the planner prices it on the first pipeline stage only: a larger vocabulary slows the
    # first stage's backward by the difference of the two tables' gradients
    from picolib.plan_search import _stage_seconds_ops
    par = Parallelism(pp=2, micro_batches=4, seq=256)
    first = []
    for v in (32000, 128000):
        big = LlamaConfig(vocab_size=v, hidden=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=512)
        first.append(_stage_seconds_ops(big, par, hw, None, None, False)[0])
        grad_s = op_seconds(embedding_ops(big, 256, e=2)[0], hw, backward=True)[0]
        first[-1] = (*first[-1], grad_s)
    assert first[1][1] - first[0][1] == pytest.approx(first[1][4] - first[0][4])
    assert first[1][1] > first[0][1] and first[1][0] == pytest.approx(first[0][0])


def test_a_multi_token_prediction_module_is_one_more_layer_and_head_on_the_last_stage():
    from picolib.hardware import hardware
    from picolib.plan_search import _stage_seconds_ops
    from picolib.planner import Parallelism
    from picolib.layer_costs import mtp_ops, op_seconds
    cfg, tokens = LlamaConfig(hidden=64, n_heads=4, n_kv_heads=4, ffn_hidden=128, vocab_size=256, n_layers=4), 32
    proj = torch.nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)      # DeepSeek-V3 §2.2's M
    with FlopCounterMode(display=False) as fc:
        proj(torch.randn(tokens, 2 * cfg.hidden))
    assert _matmul_flops(mtp_ops(cfg, tokens)) == fc.get_total_flops()
    hw, par = hardware("H100-SXM"), Parallelism(pp=2, micro_batches=4, seq=tokens)
    plain = _stage_seconds_ops(cfg, par, hw, None, None, False)
    one = _stage_seconds_ops(cfg, par, hw, None, None, False, mtp=1)
    assert one[0] == plain[0]                                        # the first stage: unchanged
    forward = lambda ops: sum(op_seconds(op, hw)[0] for op in ops)   # noqa: E731
    added = (forward(layer_ops(cfg, tokens, tokens)) + forward(head_ops(cfg, tokens))
             + forward(mtp_ops(cfg, tokens)))
    assert one[1][0] - plain[1][0] == pytest.approx(added)


def test_megatrons_all_reduce_after_the_backward_is_exposed_whole():
    from picolib.hardware import hardware
    from picolib.model import param_count
    from picolib.planner import Parallelism
    cfg = LlamaConfig(hidden=1024, n_heads=8, n_kv_heads=8, ffn_hidden=2816, n_layers=8, vocab_size=32000)
    par, hw = Parallelism(dp=16, micro_batches=2, seq=1024, zero=0), hardware("A100-SXM")
    over, after = step_time(cfg, par, "A100-SXM"), step_time(cfg, par, "A100-SXM", dp_overlap=False)
    # a ring all-reduce of the bf16 gradients: 2(n−1)/n of them leave each rank, at NCCL's fraction
    ring = 2 * 15 / 16 * 2 * param_count(cfg) / (hw.link(16) * hw.link_eff)
    assert after["dp"] == pytest.approx(ring) and after["dp_exposed"] == after["dp"]
    assert over["dp_exposed"] < after["dp_exposed"]
    assert after["seconds"] - over["seconds"] == pytest.approx(after["dp_exposed"] - over["dp_exposed"])


def test_each_term_of_the_time_model_switches_on_in_turn():
    """`term_presets` rebuilds the presets as the planner had them before issue 57's terms (no
    tiles; the A100 on Hopper's HBM and NCCL fractions), then switches each on; the last step is
    the presets as they are. On Korthikanti's one-node run each term lowers the optimism."""
    from picolib.hardware import hardware
    from picolib.published_runs import TERMS, term_presets
    first, last = term_presets(0), term_presets(len(TERMS) - 1)
    h100, a100 = hardware("H100-SXM"), hardware("A100-SXM")
    assert first["A100-SXM"].sms == 0 and first["A100-SXM"].hbm_eff == h100.hbm_eff
    assert first["A100-SXM"].link_eff == h100.link_eff and first["H100-SXM"].sms == 0
    assert last == {name: hardware(name) for name in last}
    assert a100.hbm_eff != h100.hbm_eff and a100.link_eff != h100.link_eff and a100.sms == 108
    run = next(r for r in RUNS if r.name == "GPT 22B, 8 GPUs")
    errors = [table([run], term_presets(step, {run.hw}))[0]["error"] for step in range(len(TERMS))]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    with pytest.raises(ValueError, match="step must be in"):
        term_presets(len(TERMS))
