"""Tensor parallelism against one process: shards, the f/g pair, the vocab-parallel loss,
biases, and the whole TinyLlama at tp = 1, 2, 4 (loss, logits, every gradient).

Tolerance: fp32, atol=1e-5 on values and gradients — a sharded matmul sums the same
products in another order, so results agree to rounding, not bitwise."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import grad_model, with_biases
from picolib import comm
from picolib.comm import ring_sent_bytes
from picolib.launch import run
from picolib.mappings import reduce_from_region, reduce_scatter_to_region, shard
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                     apply_tensor_parallel, check_tensor_parallel, copy_to_tp,
                                     gather_from_tp, kv_heads_per_rank, reduce_from_tp)
from picolib.vocab_parallel import vocab_parallel_cross_entropy

ATOL = 1e-5
CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def _compare_model(cfg, tokens, targets, sequence_parallel=False, biases=None):
    """Errors of a TP (or TP+SP) model against TinyLlama: loss, logits, every gradient.
    biases: None, "attention" (q, k, v, o) or "everywhere" (also the MLP and lm_head)."""
    import torch.distributed as dist

    def build():
        model = TinyLlama(cfg)
        return model if biases is None else with_biases(model, 7, biases == "everywhere")

    ref = build()
    ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    sp = {"sequence_parallel": sequence_parallel}
    expected = apply_tensor_parallel(grad_model(ref), **sp)   # the gradients, sharded like the weights
    model = apply_tensor_parallel(build(), **sp)
    with comm.Ledger() as led:
        loss = model.loss(tokens, targets)
        loss.backward()
    errors = {"loss": (loss - ref_loss).abs().item()}
    with torch.no_grad():
        errors["logits"] = (gather_from_tp(model(tokens)) - ref_logits).abs().max().item()
    for (name, p), e in zip(model.named_parameters(), expected.parameters(), strict=True):
        assert p.shape == e.shape, name
        errors[name] = (p.grad - e).abs().max().item()
    return errors, led.summary(), dist.get_rank()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tinyllama_matches_one_process(tp):
    tokens, targets = random_tokens(2, 8, CFG.vocab_size, seed=1)
    for errors, _, rank in run(_compare_model, tp, CFG, tokens, targets, timeout=120):
        bad = {k: v for k, v in errors.items() if v > ATOL}
        assert not bad, (rank, bad)


def test_full_recompute_and_sdpa_match_too():
    cfg = CFG.replace(attn_impl="sdpa", recompute="full", n_kv_heads=4)
    tokens, targets = random_tokens(2, 8, cfg.vocab_size, seed=2)
    for errors, _, rank in run(_compare_model, 2, cfg, tokens, targets, timeout=120):
        assert max(errors.values()) < ATOL, (rank, errors)


def test_one_all_reduce_per_f_g_pair():
    """Forward: 2 all-reduces per block (attention, MLP) + 1 for the embedding, plus the
    loss's three (max, sum-exp, target). Backward: one per f (2 per block + lm_head's).
    Each moves a (b, s, h) activation (the loss's: (b, s) numbers); bytes by the ring formula."""
    b, s = 2, 8
    tokens, targets = random_tokens(b, s, CFG.vocab_size, seed=1)
    _, summary, _ = run(_compare_model, 2, CFG, tokens, targets, timeout=120)[0]
    L = CFG.n_layers
    assert set(summary) == {"all_reduce"}
    assert summary["all_reduce"]["calls"] == (2 * L + 1 + 3) + (2 * L + 1)
    activation, per_token = b * s * CFG.hidden * 4, b * s * 4
    expected = (2 * (2 * L + 1) * ring_sent_bytes("all_reduce", activation, 2)
                + 3 * ring_sent_bytes("all_reduce", per_token, 2))
    assert summary["all_reduce"]["sent_bytes"] == expected


@pytest.mark.parametrize("sp, tp, biases", [
    (False, 2, "attention"), (False, 4, "attention"), (True, 2, "attention"),
    (True, 4, "attention"), (False, 2, "everywhere"), (True, 4, "everywhere")])
def test_biases_match_one_process(sp, tp, biases):
    """q, k, v (gate, up, lm_head) biases are cut with the outputs (at tp=4 the KV biases are
    replicated on 2 ranks); o (down) biases are added once, after the all-reduce (TP) or the
    reduce-scatter (SP: f on the bias sums its gradient in backward, like the norms')."""
    tokens, targets = random_tokens(2, 8, CFG.vocab_size, seed=4)
    for errors, _, rank in run(_compare_model, tp, CFG, tokens, targets, sp, biases=biases,
                               timeout=120):
        assert "blocks.1.attn.wo.bias" in errors                     # the biases are there
        assert ("lm_head.bias" in errors) == (biases == "everywhere")
        bad = {k: v for k, v in errors.items() if v > ATOL}
        assert not bad, (rank, bad)


def _row_bias_after_explicit_reduction():
    """RowParallelLinear(reduce_output=False): the partial sum comes back without the bias;
    the caller reduces (all-reduce, or reduce-scatter along the tokens) and adds it once."""
    import torch.distributed as dist
    torch.manual_seed(0)
    r, n = dist.get_rank(), dist.get_world_size()
    dense = nn.Linear(8, 6, bias=True)
    with torch.no_grad():
        dense.bias.add_(1.0)                          # a bias that cannot hide in the tolerance
    x = torch.randn(4, 8)
    upstream = torch.randn(4, 6)
    dense(x).backward(upstream)
    row = RowParallelLinear.from_linear(dense, reduce_output=False)
    xs = x.chunk(n, -1)[r]
    partial = row(xs)
    no_bias = (partial - xs @ row.weight.t()).abs().max().item()
    y = row.add_bias(reduce_from_region(partial))
    y.backward(upstream)
    reduced = (y - dense(x)).abs().max().item()
    bias_grad = (row.bias.grad - dense.bias.grad).abs().max().item()
    row.bias.grad = None
    # rank r keeps tokens r; the bias meets those only, and f on it sums its gradient
    y_rs = row.add_bias(reduce_scatter_to_region(row(xs), 0), sequence_split=True)
    y_rs.backward(upstream.chunk(n, 0)[r])
    scattered = (y_rs - dense(x).chunk(n, 0)[r]).abs().max().item()
    return no_bias, reduced, bias_grad, scattered, (row.bias.grad - dense.bias.grad).abs().max().item()


@pytest.mark.parametrize("n", [2, 4])
def test_row_parallel_bias_is_added_once_after_the_reduction(n):
    for errors in run(_row_bias_after_explicit_reduction, n, timeout=120):
        assert max(errors) < ATOL, errors


def _shards():
    import torch.distributed as dist
    torch.manual_seed(0)
    r, n = dist.get_rank(), dist.get_world_size()
    dense = nn.Linear(8, 12, bias=True)
    col = ColumnParallelLinear.from_linear(dense, gather_output=True)
    row = RowParallelLinear.from_linear(nn.Linear(12, 8, bias=True))
    x = torch.randn(3, 8)
    return (r, n, dense.weight, col.weight, dense.bias, col.bias, col(x), dense(x))


def test_weight_shards_are_exact_slices():
    for r, n, w, col_w, b, col_b, y, ref in run(_shards, 2, timeout=120):
        step = w.shape[0] // n
        assert torch.equal(col_w, w[r * step:(r + 1) * step])   # rows of W = output features
        assert torch.equal(col_b, b[r * step:(r + 1) * step])
        assert torch.allclose(y, ref, atol=ATOL)
    m = TinyLlama(CFG)
    assert torch.equal(shard(m.blocks[0].mlp.w_down.weight, 1, 1, 2),
                       m.blocks[0].mlp.w_down.weight[:, 32:])


def _linear_pair():
    """Column (f on input) then row (g on output) equals the dense pair, values and grads."""
    import torch.distributed as dist
    torch.manual_seed(0)
    a, b = nn.Linear(6, 8, bias=False), nn.Linear(8, 6, bias=True)
    x = torch.randn(4, 6, requires_grad=True)
    (b(torch.relu(a(x))) ** 2).sum().backward()
    col, row = ColumnParallelLinear.from_linear(a), RowParallelLinear.from_linear(b)
    xp = x.detach().clone().requires_grad_()
    with comm.Ledger() as led:
        y = row(torch.relu(col(xp)))
        fwd = led.count("all_reduce")
        (y ** 2).sum().backward()
    r, n = dist.get_rank(), dist.get_world_size()
    return ((xp.grad - x.grad).abs().max().item(),
            (col.weight.grad - a.weight.grad.chunk(n, 0)[r]).abs().max().item(),
            (row.weight.grad - b.weight.grad.chunk(n, 1)[r]).abs().max().item(),
            (row.bias.grad - b.bias.grad).abs().max().item(), fwd, led.count("all_reduce"))


def test_column_then_row_needs_one_all_reduce_each_way():
    for *errs, fwd, total in run(_linear_pair, 2, timeout=120):
        assert max(errs) < ATOL, errs
        assert (fwd, total) == (1, 2)


def _f_and_g():
    import torch.distributed as dist
    r = dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    copy_to_tp(x).backward(torch.ones(3) * (r + 1))
    y = torch.full((3,), float(r + 1), requires_grad=True)
    out = reduce_from_tp(y)
    out.backward(torch.ones(3) * (r + 1))
    return x.grad, out.detach(), y.grad


def test_f_and_g_are_conjugate():
    for r, (fx, gy, gyg) in enumerate(run(_f_and_g, 2, timeout=120)):
        assert torch.equal(fx, torch.full((3,), 3.0))       # f backward: sum of 1 + 2
        assert torch.equal(gy, torch.full((3,), 3.0))       # g forward: sum of 1 + 2
        assert torch.equal(gyg, torch.full((3,), r + 1.0))  # g backward: identity


def _vocab_loss(logits, targets):
    import torch.distributed as dist
    r, n = dist.get_rank(), dist.get_world_size()
    v = logits.shape[-1]
    local = logits.chunk(n, -1)[r].clone().requires_grad_()
    with comm.Ledger() as led:
        loss = vocab_parallel_cross_entropy(local, targets, r * v // n)
    loss.backward()
    return loss.detach(), local.grad, led.summary()


@pytest.mark.parametrize("n", [2, 4])
def test_vocab_parallel_loss_equals_cross_entropy(n):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 16) * 4).requires_grad_()
    targets = torch.randint(0, 16, (3, 5))
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref.backward()
    for r, (loss, grad, summary) in enumerate(run(_vocab_loss, n, logits.detach(), targets, timeout=120)):
        assert abs(loss.item() - ref.item()) < ATOL
        assert torch.allclose(grad, logits.grad.chunk(n, -1)[r], atol=ATOL)
        # never gathers the logits: three all-reduces of (b, s) = 15 numbers only
        assert set(summary) == {"all_reduce"}
        assert summary["all_reduce"]["calls"] == 3
        assert summary["all_reduce"]["nbytes"] == 3 * 15 * 4
        assert summary["all_reduce"]["sent_bytes"] == 3 * ring_sent_bytes("all_reduce", 15 * 4, n)


def test_gqa_rule():
    assert kv_heads_per_rank(8, 4, 2) == (2, 1)   # split the KV heads
    assert kv_heads_per_rank(8, 2, 8) == (1, 4)   # each KV head on 4 ranks
    with pytest.raises(ValueError, match="tp=3.*n_heads=8"):
        kv_heads_per_rank(8, 2, 3)
    with pytest.raises(ValueError, match="n_kv_heads=4 must divide tp=6"):
        kv_heads_per_rank(12, 4, 6)


@pytest.mark.parametrize("cfg, tp, message", [
    (CFG, 8, "tp=8 must divide n_heads=4"),
    (CFG.replace(ffn_hidden=66), 4, "tp=4 must divide ffn_hidden=66"),
    (CFG.replace(vocab_size=66), 4, "tp=4 must divide vocab_size=66"),
    (CFG.replace(hidden=36, n_heads=6, n_kv_heads=3), 2, "tp=2 must divide n_kv_heads=3"),
    (CFG.replace(hidden=48, n_heads=12, n_kv_heads=4), 6, "n_kv_heads=4 must divide tp=6"),
    (CFG, 4, None)])
def test_bad_tp_is_a_clear_value_error_before_any_rank_starts(cfg, tp, message):
    if message is None:           # tp=4 > 2 KV heads is fine: each is replicated on 2 ranks
        check_tensor_parallel(cfg, tp)
        with pytest.raises(ValueError, match="tp=4 must divide the sequence length 10"):
            check_tensor_parallel(cfg, tp, seq_len=10)
    else:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(cfg, tp)


def _bad_in_rank(cfg):
    with comm.Ledger() as led:
        try:
            apply_tensor_parallel(TinyLlama(cfg))
        except ValueError as e:
            return str(e), led.count()
    return "", led.count()


def test_bad_tp_in_a_rank_raises_before_any_collective():
    for msg, calls in run(_bad_in_rank, 4, CFG.replace(n_heads=2, n_kv_heads=2), timeout=120):
        assert "tp=4" in msg and "n_heads=2" in msg and calls == 0


def _in_place(sp):
    from picolib.mesh import Mesh
    model = TinyLlama(CFG)
    out = apply_tensor_parallel(model, Mesh(tp=2), sequence_parallel=sp)   # a mesh: its "tp" group
    parts = {name: type(m).__name__ for name, m in model.named_modules()
             if name in ("embed", "lm_head", "loss_fn", "norm", "blocks.0.attn", "blocks.0.mlp",
                         "blocks.0.attn_norm", "blocks.0.attn.core")}
    try:
        apply_tensor_parallel(model, sequence_parallel=sp)
        again = ""
    except ValueError as e:
        again = str(e)
    return out is model, parts, model.sequence_shards, again


@pytest.mark.parametrize("sp", [False, True])
def test_the_transform_swaps_parts_in_place_once(sp):
    for same, parts, shards, again in run(_in_place, 2, sp, timeout=120):
        assert same and shards == (2 if sp else 1)
        norm = "SequenceParallelRMSNorm" if sp else "RMSNorm"
        assert parts == {"embed": "VocabParallelEmbedding", "lm_head": "ColumnParallelLinear",
                         "loss_fn": "VocabParallelCrossEntropy", "norm": norm,
                         "blocks.0.attn": "ParallelAttention", "blocks.0.mlp": "ParallelSwiGLU",
                         "blocks.0.attn_norm": norm, "blocks.0.attn.core": "AttentionCore"}
        assert "tensor-parallel already" in again
