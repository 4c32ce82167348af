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


# ----------------------------------------------------------------- the faster formulation (issue 26)

def old_apply_rope(x, cos, sin):
    """RoPE as the model wrote it before: two stride-2 slices, four products and a stack."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def old_attention_core(q, k, v, impl="eager", causal=True):
    """The core as before: K/V repeated to every query head, then eager or SDPA."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def old_core_forward(self, q, k, v):
    """AttentionCore.forward as before: repeat K/V, then (selective) checkpoint the core."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    if self.selective:
        return torch.utils.checkpoint.checkpoint(old_attention_core, q, k, v, self.impl,
                                                 use_reentrant=False)
    return old_attention_core(q, k, v, self.impl)


def _loss_grads_bytes(cfg, x, y):
    from picolib.memory import SavedActivations
    model = TinyLlama(cfg)
    with SavedActivations(model) as act:
        loss = model.loss(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, act.bytes


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_one_step_rope_and_gqa_sdpa_equal_the_old_formulation(impl, recompute, monkeypatch):
    """Losses and gradients (fp32) equal the old model's within 1e-6 (measured: eager
    bitwise, SDPA within 3e-8); eager saves the same bytes; SDPA saves 2·b·s·(a − kv)·d·4
    bytes less per layer (K/V heads unrepeated), and on the CPU b·s·h·4 less again."""
    import picolib.model as pm
    cfg = LlamaConfig(hidden=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=96,
                      attn_impl=impl, recompute=recompute, seed=5)
    x, y = random_tokens(3, 24, 256, seed=2)
    loss, grads, saved = _loss_grads_bytes(cfg, x, y)
    monkeypatch.setattr(pm, "apply_rope", old_apply_rope)
    monkeypatch.setattr(pm, "attention_core", old_attention_core)
    monkeypatch.setattr(pm.AttentionCore, "forward", old_core_forward)
    old_loss, old_grads, old_saved = _loss_grads_bytes(cfg, x, y)
    torch.testing.assert_close(loss, old_loss, atol=1e-6, rtol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, old_grads[n], atol=1e-6, rtol=1e-5, msg=n)
    b, s, L = 3, 24, cfg.n_layers
    if impl == "eager":
        assert saved == old_saved
    else:   # K/V unrepeated; on the CPU the kernel's output also comes out (b, s, heads, d),
        kv = L * 2 * b * s * (8 - 2) * cfg.head_dim * 4    # so wo's input is a view of it,
        assert old_saved - saved in (kv, kv + L * b * s * cfg.hidden * 4)   # not a copy


def test_rope_backward_is_the_rotation_back():
    """The rotation's hand-written backward (rotate the gradient by the opposite angle)
    against autograd's numerical gradient, float64; and a turn keeps each pair's length."""
    from picolib.model import apply_rope, rope_tables
    cos, sin = (t.double() for t in rope_tables(8, 6, 10000.0))
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
    pairs = lambda t: t.unflatten(-1, (-1, 2)).norm(dim=-1)   # noqa: E731
    torch.testing.assert_close(pairs(apply_rope(x, cos, sin)), pairs(x))
    torch.testing.assert_close(apply_rope(x, cos, sin), old_apply_rope(x, cos, sin))
