"""The tiny Llama: parameter formula, determinism, recomputation, attention variants."""
import pytest
import torch
import torch.nn.functional as F

from picolib.model import (LlamaConfig, TextData, TinyLlama, attention_core, param_count,
                           random_tokens)

CONFIGS = [LlamaConfig(),
           LlamaConfig(hidden=96, n_layers=3, n_heads=6, n_kv_heads=6, ffn_hidden=256),
           LlamaConfig(hidden=32, n_layers=1, n_heads=8, n_kv_heads=1, ffn_hidden=48, vocab_size=97),
           LlamaConfig(hidden=128, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=344, vocab_size=512)]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_parameter_count_formula_equals_counted_parameters(cfg):
    assert sum(p.numel() for p in TinyLlama(cfg).parameters()) == param_count(cfg)


def test_same_seed_same_loss_bitwise_and_other_seed_differs():
    x, y = TextData().batch(4, 32, step=3)
    a, b = TinyLlama(LlamaConfig(seed=1)), TinyLlama(LlamaConfig(seed=1))
    la, lb = a.loss(x, y), b.loss(x, y)
    assert torch.equal(la, lb)
    la.backward(); lb.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(TinyLlama(LlamaConfig(seed=2)).loss(x, y), la)


def test_initial_loss_is_near_uniform():
    x, y = random_tokens(8, 32, 256, seed=0)
    assert abs(TinyLlama().loss(x, y).item() - torch.log(torch.tensor(256.0)).item()) < 0.1


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_changes_memory_not_results(mode):
    x, y = random_tokens(2, 16, 256, seed=1)
    ref, rc = TinyLlama(), TinyLlama(LlamaConfig(recompute=mode))
    l1, l2 = ref.loss(x, y), rc.loss(x, y)
    l1.backward(); l2.backward()
    assert torch.equal(l1, l2)
    for p, q in zip(ref.parameters(), rc.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=0)


def test_eager_attention_equals_the_fused_kernel_and_is_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(attention_core(q, k, v, "eager"),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=1e-5, rtol=1e-5)
    k2 = k.clone(); k2[:, :, -1] += 1.0  # the last key must not change earlier outputs
    out1, out2 = attention_core(q, k, v), attention_core(q, k2, v)
    assert torch.equal(out1[:, :, :-1], out2[:, :, :-1])
    assert not torch.equal(out1[:, :, -1], out2[:, :, -1])


def test_text_data_is_local_deterministic_and_shifted():
    d = TextData()
    x1, y1 = d.batch(3, 20, step=5)
    x2, _ = d.batch(3, 20, step=5)
    assert torch.equal(x1, x2) and x1.shape == (3, 20) and x1.max() < 256
    assert torch.equal(x1[:, 1:], y1[:, :-1])


@pytest.mark.parametrize("bad, match", [(dict(hidden=30, n_heads=4), "n_heads"),
                                        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
                                        (dict(attn_impl="flash3"), "attn_impl"),
                                        (dict(recompute="some"), "recompute")])
def test_bad_configs_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**bad)


def test_positions_beyond_max_seq_are_an_error():
    with pytest.raises(ValueError, match="max_seq"):
        TinyLlama(LlamaConfig(max_seq=8))(torch.zeros(1, 9, dtype=torch.long))


def test_explicit_positions_are_an_input_and_only_their_differences_matter():
    """Positions are an input (context parallelism passes non-contiguous ones): the same
    positions as a tensor give the same logits bitwise; RoPE scores depend on position
    differences only, so shifting all positions changes nothing beyond rounding (1e-5),
    while a gap between them (as in a zig-zag layout) changes the output."""
    model, (x, _) = TinyLlama(), random_tokens(2, 12, 256, seed=3)
    default = model(x)
    torch.testing.assert_close(model(x, torch.arange(12)), default, atol=0, rtol=0)
    torch.testing.assert_close(model(x, range(40, 52)), default, atol=1e-5, rtol=0)
    gapped = torch.cat([torch.arange(6), torch.arange(30, 36)])
    out = model(x, gapped)
    torch.testing.assert_close(out[:, :6], default[:, :6], atol=1e-5, rtol=0)  # before the gap: same
    assert (out[:, 6:] - default[:, 6:]).abs().max() > 1e-3                     # after it: not


def test_parts_chained_equal_the_whole_model_and_share_its_parameters():
    cfg = LlamaConfig(n_layers=4)
    model, (x, y) = TinyLlama(cfg), random_tokens(2, 10, 256, seed=4)
    first = model.part(range(0, 3), head=False)
    last = model.part(range(3, 4), embed=False)
    assert first.lm_head is None and first.loss_fn is None and last.embed is None
    assert list(first.layers) == [0, 1, 2] and list(last.layers) == [3]
    assert model.lm_head is not None and len(model.blocks) == 4     # the whole model is untouched
    hidden = first(x)
    assert hidden.shape == model.hidden_shape(2, 10) == (2, 10, cfg.hidden)
    torch.testing.assert_close(last.loss(hidden, y), model.loss(x, y), atol=0, rtol=0)
    ids = {id(p) for p in model.parameters()}
    part_ids = [id(p) for st in (first, last) for p in st.parameters()]
    assert sorted(part_ids) == sorted(ids)                           # each parameter once, shared
