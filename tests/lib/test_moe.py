"""The MoE layer in one process: each piece against its definition written out token by
token (fp32, atol 1e-6), and the balancing methods doing what they claim."""
import pytest
import torch
import torch.nn.functional as F

from picolib.model import LlamaConfig, SwiGLU, TinyLlama, random_tokens
from picolib.moe import (MoE, Router, apply_moe, aux_loss_in_backward, balancing_loss, capacity,
                         check_moe, keep_mask, moe_layers, sort_by_expert)

H = 16


def _naive(moe, x):
    """Σ_j gate_j · expert_j(x) token by token, with the drops of keep_mask."""
    r = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            if r.keep[t, j]:
                out[t] += r.gates[t, j] * moe.experts[int(r.choice[t, j])](x[t])
    if moe.shared is not None:
        out = out + moe.shared(x)
    return out


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k, cf, shared", [(1, None, 0), (2, None, 8), (2, 0.5, 0), (3, 1.0, 8)])
def test_layer_equals_the_token_by_token_definition(router, k, cf, shared):
    moe = MoE(H, 6, k, 20, router=router, capacity_factor=cf, shared_hidden=shared, seed=1)
    x = torch.randn(30, H)
    torch.testing.assert_close(moe(x), _naive(moe, x), atol=1e-6, rtol=0)
    assert (moe.dropped == 0) if cf is None else (cf > 0.6 or moe.dropped > 0)


def test_one_expert_top_1_is_the_dense_swiglu():
    moe = MoE(H, 1, 1, 20, seed=2)
    dense = SwiGLU(LlamaConfig(hidden=H, ffn_hidden=20))
    dense.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(4, 5, H)
    torch.testing.assert_close(moe(x), dense(x), atol=1e-7, rtol=0)   # softmax over 1 expert = 1


def test_capacity_keeps_first_choices_then_earlier_tokens():
    choice = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    assert capacity(4, 3, 2, 1.0) == 3 and capacity(4, 3, 2, None) is None
    keep = keep_mask(choice, 3, cap=2)
    # expert 0: first choices of tokens 0, 1, 2 → token 2's dropped, and token 3's second choice;
    # expert 1: token 3's first choice comes before token 0's and token 2's second choices
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]


def test_sort_by_expert_and_its_inverse():
    choice = torch.tensor([[2, 0], [1, 2], [0, 1]])
    keep = torch.ones_like(choice, dtype=torch.bool)
    order, counts = sort_by_expert(choice, keep, 4)
    assert counts.tolist() == [2, 2, 2, 0]
    assert choice.reshape(-1)[order].tolist() == [0, 0, 1, 1, 2, 2]
    assert (order // 2).tolist() == [0, 2, 1, 2, 0, 1]          # tokens, in token order per expert
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    assert choice.reshape(-1)[order][inverse].tolist() == choice.reshape(-1).tolist()


def test_balancing_loss_is_one_when_even_and_larger_when_collapsed():
    even = torch.full((8, 4), 0.25)
    assert balancing_loss(even, torch.arange(8).view(8, 1) % 4, 4).item() == pytest.approx(1.0)
    collapsed = F.one_hot(torch.zeros(8, dtype=torch.long), 4).float() * 0.9 + 0.025
    assert balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), 4).item() > 3.5


def test_sigmoid_router_normalises_and_the_bias_only_steers():
    router = Router(H, 4, 2, "sigmoid")
    torch.nn.init.normal_(router.weight)
    x = torch.randn(10, H)
    scores, choice, gates = router(x)
    torch.testing.assert_close(gates.sum(-1), torch.ones(10))
    router.expert_bias[3] = 100.0                                  # every token picks expert 3
    scores2, choice2, gates2 = router(x)
    assert (choice2 == 3).any(-1).all()
    torch.testing.assert_close(scores2, scores)                    # the scores themselves unchanged
    torch.testing.assert_close(gates2, scores.gather(1, choice2) / scores.gather(1, choice2).sum(-1, keepdim=True))


def test_bias_updates_even_the_load():
    moe = MoE(H, 4, 1, 8, router="sigmoid", seed=0)
    g = torch.Generator().manual_seed(0)
    moe.router.weight.data = torch.randn(4, H, generator=g) * 0.3
    x = torch.randn(256, H, generator=g) + 2.0                     # a skewed input: uneven routing
    moe(x)
    before = moe.load.clone()
    for _ in range(200):
        moe(x)
        moe.update_bias(0.003)
    moe(x)
    assert before.max() > 100 and moe.load.max() < 80, (before, moe.load)   # even: 64 each


def test_token_groups_apply_capacity_per_group():
    moe = MoE(H, 4, 1, 8, capacity_factor=1.0, token_groups=2, seed=0)
    x = torch.randn(16, H)
    whole = torch.cat([MoE(H, 4, 1, 8, capacity_factor=1.0, seed=0)(half) for half in x.chunk(2)])
    torch.testing.assert_close(moe(x), whole, atol=0, rtol=0)


def test_apply_moe_adds_the_aux_loss_to_the_models_loss():
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    tokens, targets = random_tokens(2, 8, 64)
    model = apply_moe(TinyLlama(cfg), n_experts=4, top_k=2, aux_weight=0.5)
    loss = model.loss(tokens, targets)
    plain = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    aux = sum(m.aux_loss for m in moe_layers(model))
    assert len(moe_layers(model)) == 2 and aux.item() > 1.0
    assert abs(loss.item() - (plain.item() + 0.5 * aux.item())) < 1e-6
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="has MoE layers already"):
        apply_moe(model, n_experts=4, top_k=1)


def test_aux_loss_in_backward_gives_the_gradients_of_the_loss_with_it():
    """What pipeline stages need: the layers add the aux loss's gradient in backward (scaled
    like the loss, here by 1/3); every gradient equals backward through loss + w·aux."""
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    tokens, targets = random_tokens(2, 8, 64)
    want = apply_moe(TinyLlama(cfg), n_experts=4, top_k=2, aux_weight=0.5)
    (want.loss(tokens, targets) / 3).backward()
    got = apply_moe(TinyLlama(cfg), n_experts=4, top_k=2, aux_weight=0.5)
    aux_loss_in_backward(got, scale=1 / 3)
    loss = got.loss(tokens, targets)
    assert abs(loss.item() - F.cross_entropy(got(tokens).flatten(0, 1), targets.flatten()).item()) < 1e-6
    (loss / 3).backward()
    router = dict(got.named_parameters())["blocks.0.mlp.router.weight"]
    for (name, p), q in zip(want.named_parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    without = apply_moe(TinyLlama(cfg), n_experts=4, top_k=2, aux_weight=0.0)
    (without.loss(tokens, targets) / 3).backward()
    assert not torch.allclose(dict(without.named_parameters())["blocks.0.mlp.router.weight"].grad,
                              router.grad)                     # the aux loss's part is there
    with pytest.raises(ValueError, match="needs a model made MoE"):
        aux_loss_in_backward(TinyLlama(cfg))


@pytest.mark.parametrize("args, message", [
    ((4, 5), "top_k=5 is larger than n_experts=4"),
    ((6, 1, None, "softmax", 4), "n_experts=6 does not divide by the ep size 4"),
    ((4, 1, 0.0), "capacity_factor must be > 0"),
    ((4, 1, -1.0), "capacity_factor must be > 0"),
    ((4, 1, None, "relu"), "unknown router 'relu'"),
    ((0, 1), "n_experts must be a positive int"),
])
def test_bad_sizes_name_the_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        check_moe(*args)
