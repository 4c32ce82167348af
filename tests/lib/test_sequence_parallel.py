"""TP+SP against one process (tp = 1, 2, 4; with and without the backward re-gather),
the sequence collectives' conjugates, equal traffic with TP, and the saved-activation
bytes per layer equal to the formula exactly.

Tolerance: fp32, atol=1e-5 (sharded sums change the rounding order, nothing else)."""
import pytest
import torch
import torch.nn.functional as F

from picolib import comm
from picolib.comm import ring_sent_bytes
from picolib.launch import run
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.sequence_parallel import (activation_bytes_per_layer, gather_sequence,
                                       korthikanti_bytes_per_layer, reduce_scatter_sequence,
                                       split_sequence)
from picolib.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, gather_from_tp

from helpers import grad_model

ATOL = 1e-5
CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def _compare(cfg, tokens, targets, regather):
    ref = TinyLlama(cfg)
    ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    sp = {"sequence_parallel": True, "regather": regather}
    expected = apply_tensor_parallel(grad_model(ref), **sp)
    model = apply_tensor_parallel(TinyLlama(cfg), **sp)
    loss = model.loss(tokens, targets)
    loss.backward()     # the norms' gradients are summed over the group inside backward
    errors = {"loss": (loss - ref_loss).abs().item()}
    with torch.no_grad():
        errors["logits"] = (gather_from_tp(model(tokens)) - ref_logits).abs().max().item()
    for (name, p), e in zip(model.named_parameters(), expected.parameters(), strict=True):
        errors[name] = (p.grad - e).abs().max().item()
    return errors


@pytest.mark.parametrize("tp, regather", [(1, True), (2, True), (4, True), (2, False), (4, False)])
def test_tp_sp_llama_matches_one_process(tp, regather):
    tokens, targets = random_tokens(2, 8, CFG.vocab_size, seed=3)
    for rank, errors in enumerate(run(_compare, tp, CFG, tokens, targets, regather, timeout=120)):
        bad = {k: v for k, v in errors.items() if v > ATOL}
        assert not bad, (rank, bad)


def _seq_ops():
    import torch.distributed as dist
    r = dist.get_rank()
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    local = split_sequence(full).requires_grad_()
    g = gather_sequence(local)
    g.backward(torch.ones_like(g) * (r + 1))           # conjugate: reduce-scatter
    part = (full * (r + 1)).requires_grad_()
    rs = reduce_scatter_sequence(part)
    rs.backward(torch.ones_like(rs) * (r + 1))          # conjugate: all-gather
    return g.detach(), local.grad, rs.detach(), part.grad


def test_sequence_collectives_and_their_conjugates():
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    for r, (g, lg, rs, pg) in enumerate(run(_seq_ops, 2, timeout=120)):
        assert torch.equal(g, full)
        assert torch.equal(lg, torch.full((2, 2, 3), 3.0))          # 1 + 2 summed
        assert torch.equal(rs, (full * 3).chunk(2, 1)[r])           # sum, this rank's tokens
        assert torch.equal(pg, torch.cat([torch.full((2, 2, 3), 1.0), torch.full((2, 2, 3), 2.0)], 1))


def _traffic(cfg, tokens, targets, sp, regather):
    model = apply_tensor_parallel(TinyLlama(cfg), sequence_parallel=sp, regather=regather)
    with comm.Ledger() as fwd:
        loss = model.loss(tokens, targets)
    with comm.Ledger() as bwd:
        loss.backward()
    return fwd.summary(), bwd.summary()


def _bytes(summary, ops=("all_reduce", "reduce_scatter", "all_gather")):
    return sum(summary.get(op, {}).get("sent_bytes", 0) for op in ops)


def _calls(summary, ops=("all_reduce", "reduce_scatter", "all_gather")):
    return sum(summary.get(op, {}).get("calls", 0) for op in ops)


def _traffic_only(summary):
    """{op: (calls, payload bytes, sent bytes)}: the summary without its wall times."""
    return {op: (s["calls"], s["nbytes"], s["sent_bytes"]) for op, s in summary.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_tp_sp_move_the_same_activation_bytes_in_twice_the_calls(tp):
    tokens, targets = random_tokens(2, 8, CFG.vocab_size, seed=3)
    args = (CFG, tokens, targets)
    tp_f, tp_b = run(_traffic, tp, *args, False, False, timeout=120)[0]
    sp_f, sp_b = run(_traffic, tp, *args, True, False, timeout=120)[0]
    rg_f, rg_b = run(_traffic, tp, *args, True, True, timeout=120)[0]
    L = CFG.n_layers
    # activations: TP all-reduces (b, s, h); SP reduce-scatters + all-gathers them
    assert tp_f["all_reduce"]["calls"] == 2 * L + 1 + 3                   # + the loss's 3
    assert sp_f["all_gather"]["calls"] == sp_f["reduce_scatter"]["calls"] == 2 * L + 1
    assert _calls(sp_f) - 3 == 2 * (_calls(tp_f) - 3)
    assert _bytes(sp_f) == _bytes(tp_f) > 0
    # backward: the same activation bytes, plus one all-reduce of each norm weight's
    # gradient (h floats; 2 norms per block + the final one saw s/tp tokens each)
    norms = 2 * L + 1
    norm_bytes = norms * ring_sent_bytes("all_reduce", CFG.hidden * 4, tp)
    assert _bytes(sp_b) == _bytes(tp_b) + norm_bytes and _bytes(tp_b) > 0
    assert _calls(sp_b) == 2 * _calls(tp_b) - (
        tp_b["all_reduce"]["calls"] - (2 * L + 1)) + norms   # the KV-replica sums are the same calls
    # the re-gather changes nothing forward; backward it adds one all-gather of (b, s, h)
    # per TP region (2 per block + the lm_head's) and leaves every other call as it was
    b, s, h = tokens.shape + (CFG.hidden,)
    assert _traffic_only(rg_f) == _traffic_only(sp_f)
    rg, sp = _traffic_only(rg_b), _traffic_only(sp_b)
    (rg_calls, rg_nbytes, rg_sent) = rg.pop("all_gather")
    (sp_calls, sp_nbytes, sp_sent) = sp.pop("all_gather")
    act, regions = b * s * h * 4, 2 * L + 1
    assert (rg_calls - sp_calls, rg_nbytes - sp_nbytes, rg_sent - sp_sent) == (
        regions, regions * act, regions * ring_sent_bytes("all_gather", act, tp))
    assert rg == sp                                      # every other collective as it was


def _saved_per_layer(cfg, b, s, mode):
    torch.manual_seed(0)
    tokens, targets = random_tokens(b, s, cfg.vocab_size)
    model = TinyLlama(cfg)
    if mode == "tp":
        model = apply_tensor_parallel(model)
    elif mode.startswith("tp+sp"):
        model = apply_tensor_parallel(model, sequence_parallel=True, regather=(mode == "tp+sp"))
    with SavedActivations(model) as act:
        model.loss(tokens, targets)
    return [sum(v for k, v in act.by_module.items() if k.startswith(f"blocks.{i}."))
            for i in range(cfg.n_layers)]


@pytest.mark.parametrize("tp, mode", [(1, "tp"), (2, "tp"), (4, "tp"), (2, "tp+sp"),
                                      (4, "tp+sp"), (2, "tp+sp-gathered")])
def test_saved_activation_bytes_equal_the_formula(tp, mode):
    b, s = 2, 16
    expected = activation_bytes_per_layer(s, b, CFG.hidden, CFG.ffn_hidden, CFG.n_heads, tp, mode)
    for per_layer in run(_saved_per_layer, tp, CFG, b, s, mode, timeout=120):
        assert per_layer == [expected] * CFG.n_layers


def test_formulas():
    # with f = 2h the adapted per-layer bytes are s·b·h·(24 + 48/t) + ... vs 72/t with SP
    s, b, h, a = 16, 2, 32, 4
    tp = activation_bytes_per_layer(s, b, h, 2 * h, a, 4, "tp")
    sp = activation_bytes_per_layer(s, b, h, 2 * h, a, 4, "tp+sp")
    assert tp == s * b * h * (24 + 48 // 4) + 8 * s * b + 4 * a * b * s * s // 4 + s * s
    assert sp == s * b * h * 72 // 4 + 8 * s * b // 4 + 4 * a * b * s * s // 4 + s * s
    assert korthikanti_bytes_per_layer(s, b, h, a, 8, sp=True) == s * b * h * 34 / 8 + 5 * a * s * s * b / 8
    with pytest.raises(ValueError, match="tp=3 must divide s=16"):
        activation_bytes_per_layer(s, b, h, 2 * h, a, 3, "tp")


def _bad_seq():
    model = apply_tensor_parallel(TinyLlama(CFG), sequence_parallel=True)
    tokens, targets = random_tokens(1, 7, CFG.vocab_size)
    with comm.Ledger() as led:
        try:
            model.loss(tokens, targets)
        except ValueError as e:
            return str(e), led.count()
    return "", led.count()


def test_sequence_not_divisible_is_a_clear_error_before_any_collective():
    with pytest.raises(ValueError, match="tp=2 must divide the sequence length 7"):
        check_tensor_parallel(CFG, 2, seq_len=7)
    for msg, calls in run(_bad_seq, 2, timeout=120):
        assert "tp=2" in msg and "sequence length 7" in msg and calls == 0
