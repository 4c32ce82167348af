"""Context parallelism (lesson 06) against one process.

Attention alone (ring, all-gather, Ulysses; contiguous and zig-zag; N = 1, 2, 4; GQA): the
output and the gradients of q, k, v equal full causal attention (fp32, atol 1e-5). The tiny
Llama made context-parallel: the loss averaged over the ranks and every weight gradient
summed over them equal one process (fp32, atol 1e-5). Then what the lesson measures: the
blocks each rank computes, the traffic in the ledger, the bytes saved for backward."""
import pytest
import torch
import torch.distributed as dist

from picolib.blockwise_attention import unmasked_scores
from picolib.comm import Ledger
from picolib.context_parallel import (ALGORITHMS, LAYOUTS, apply_context_parallel,
                                      check_context_parallel, chunk_ids, positions,
                                      shard_sequence, unshard_sequence)
from picolib.launch import WorkerError, run
from picolib.memory import SavedActivations
from picolib.model import AttentionCore, LlamaConfig, TinyLlama, attention_core, random_tokens, repeat_kv
from picolib.context_parallel import allgather_attention, ring_attention, ulysses_attention

FN = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
B, A, KV, S, D = 2, 4, 2, 16, 8
CFG = LlamaConfig(hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=32)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (A, KV, KV))
    return q, k, v, torch.randn(B, A, S, D, generator=g)


def _attention_worker(algorithm, layout):
    n, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = _qkv()
    local = [shard_sequence(t, layout, r, n, dim=2).requires_grad_() for t in (q, k, v)]
    work = {}
    with Ledger() as led:
        out = FN[algorithm](*local, None, layout, work)
        out.backward(shard_sequence(dout, layout, r, n, dim=2))
    return out.detach(), [t.grad for t in local], work, led.summary()


def _reference_attention():
    q, k, v, dout = _qkv()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_core(q, repeat_kv(k, A // KV), repeat_kv(v, A // KV))
    out.backward(dout)
    return out.detach(), [q.grad, k.grad, v.grad]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_attention_equals_full_attention(n, algorithm, layout):
    want_out, want_grads = _reference_attention()
    results = run(_attention_worker, n, algorithm, layout, timeout=120)
    whole = lambda i: unshard_sequence([r[i] for r in results], layout, dim=2)  # noqa: E731
    torch.testing.assert_close(whole(0), want_out, atol=1e-5, rtol=0)
    for j, name in enumerate("qkv"):
        got = unshard_sequence([r[1][j] for r in results], layout, dim=2)
        torch.testing.assert_close(got, want_grads[j], atol=1e-5, rtol=0, msg=f"d{name}")


def test_work_per_rank_contiguous_is_unbalanced_zigzag_even():
    """Unmasked scores per rank, counted by the code that computes them, against the count
    from the chunk geometry: contiguous rank r computes r full blocks and one triangle."""
    n = 4
    for layout, c in (("contiguous", S // n), ("zigzag", S // (2 * n))):
        scores = [w["scores"] for _, _, w, _ in run(_attention_worker, n, "ring", layout)]
        want = [sum(unmasked_scores("full", c) * sum(j < i for j in range(2 * n))
                    + unmasked_scores("diagonal", c) for i in chunk_ids(layout, r, n))
                for r in range(n)]
        assert scores == want, (layout, scores, want)
        if layout == "contiguous":
            assert scores == sorted(scores)      # → (2N−1) : 1 as chunks grow: ((2N−1)c + 1)/(c + 1)
            assert scores[-1] * (c + 1) == scores[0] * ((2 * n - 1) * c + 1)
        else:
            assert len(set(scores)) == 1
        assert sum(scores) == S * (S + 1) // 2           # together: the whole causal triangle


def test_traffic_per_algorithm_matches_the_formulas():
    n, fp32 = 4, 4
    kv_block = 2 * B * KV * (S // n) * D * fp32         # this rank's K and V
    q_block = B * A * (S // n) * D * fp32
    kv_moved = kv_block * (A // KV if KV % n else 1)    # Ulysses repeats K/V heads when they do not divide
    for algorithm, ops, sent in (
            ("ring", {"send", "recv"}, (3 * n - 2) * kv_block),     # K/V n−1 hops twice, dK/dV n hops
            ("allgather", {"all_gather", "reduce_scatter"}, 2 * (n - 1) * kv_block),
            # q, k, v in and the output back, forward and backward: each sends (n−1)/n of itself
            ("ulysses", {"all_to_all"}, 2 * (n - 1) * (2 * q_block + kv_moved) // n)):
        for *_, summary in run(_attention_worker, n, algorithm, "zigzag"):
            assert set(summary) == ops, (algorithm, summary)
            assert sum(s["sent_bytes"] for s in summary.values()) == sent, (algorithm, summary)


def _saved_worker(algorithm):
    n, r = dist.get_world_size(), dist.get_rank()
    q, k, v, _ = _qkv()
    local = [shard_sequence(t, "zigzag", r, n, dim=2).requires_grad_() for t in (q, k, v)]
    with SavedActivations() as act:      # q, k, v as activations (x·1), not leaves
        FN[algorithm](*(t * 1 for t in local), None, "zigzag")
    return act.bytes


def test_ring_saves_one_kv_block_allgather_all_of_them():
    n = 4
    kv_block = 2 * B * KV * (S // n) * D * 4
    q_block, lse = B * A * (S // n) * D * 4, B * A * (S // n) * 4
    ring, gathered = (run(_saved_worker, n, a)[0] for a in ("ring", "allgather"))
    assert ring == 2 * q_block + kv_block + lse          # q, out, lse and this rank's K/V
    assert gathered - ring == (n - 1) * kv_block


# ------------------------------------------------------------------ the model

def _model_worker(algorithm, layout, seq):
    n, r = dist.get_world_size(), dist.get_rank()
    model = apply_context_parallel(TinyLlama(CFG), None, layout=layout, algorithm=algorithm)
    tokens, targets = (shard_sequence(t, layout, r, n) for t in random_tokens(2, seq, CFG.vocab_size))
    loss = model.loss(tokens, targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
        g /= n
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / n, grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_model_loss_and_gradients_equal_one_process(n, algorithm, layout):
    seq = 16
    ref = TinyLlama(CFG)
    tokens, targets = random_tokens(2, seq, CFG.vocab_size)
    want = ref.loss(tokens, targets)
    want.backward()
    for loss, grads in run(_model_worker, n, algorithm, layout, seq, timeout=120):
        assert abs(loss - want.item()) < 1e-5
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=0, msg=name)


def test_positions_follow_the_layout():
    assert positions("zigzag", 1, 2, 8).tolist() == [2, 3, 4, 5]
    assert positions("contiguous", 1, 2, 8).tolist() == [4, 5, 6, 7]
    x = torch.arange(24).view(1, 24)
    for layout in LAYOUTS:
        parts = [shard_sequence(x, layout, r, 3) for r in range(3)]
        assert torch.equal(unshard_sequence(parts, layout), x)
        for r, part in enumerate(parts):       # a token's id is its position here
            assert torch.equal(part[0], positions(layout, r, 3, 24))


# ------------------------------------------------------------------ bad input

def test_bad_input_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"sequence length 12 must divide by 8 \(2N chunks, N = 4"):
        check_context_parallel(CFG, 4, "ring", "zigzag", seq=12)
    with pytest.raises(ValueError, match="sequence length 10 must divide by 4"):
        check_context_parallel(CFG, 4, "ring", "contiguous", seq=10)
    with pytest.raises(ValueError, match=r"4 query heads of a rank .* over cp=8"):
        check_context_parallel(CFG, 8, "ulysses")
    with pytest.raises(ValueError, match=r"2 query heads of a rank \(n_heads=4, tp=2\) over cp=4"):
        check_context_parallel(CFG, 4, "ulysses", tp=2)
    with pytest.raises(ValueError, match="unknown context-parallel algorithm 'tree'"):
        check_context_parallel(CFG, 2, "tree")
    with pytest.raises(ValueError, match="unknown layout 'striped'"):
        check_context_parallel(CFG, 2, "ring", "striped")
    with pytest.raises(ValueError, match="must divide by 4"):
        shard_sequence(torch.zeros(1, 6), "zigzag", 0, 2)


class _MyCore(AttentionCore):
    pass


def _apply_twice(core_type):
    model = TinyLlama(CFG)
    if core_type == "custom":
        model.blocks[0].attn.core = _MyCore()
    apply_context_parallel(model, None)
    apply_context_parallel(model, None)


def test_a_core_it_cannot_wrap_and_a_second_transform_are_refused():
    with pytest.raises(WorkerError, match="cannot wrap a _MyCore"):
        run(_apply_twice, 1, "custom")
    with pytest.raises(WorkerError, match="context-parallel already"):
        run(_apply_twice, 1, "plain")


def _recompute_worker(cfg):
    n, r = dist.get_world_size(), dist.get_rank()
    model = apply_context_parallel(TinyLlama(cfg), None)
    tokens, targets = (shard_sequence(t, "zigzag", r, n) for t in random_tokens(2, 16, cfg.vocab_size))
    model.loss(tokens, targets).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)
    return grads / n


@pytest.mark.parametrize("changes", [{"recompute": "full"}, {"recompute": "selective"},
                                     {"attn_impl": "sdpa"}], ids=str)
def test_other_model_settings_keep_the_gradients(changes):
    """Full recomputation reruns the ring in backward; selective and sdpa change nothing
    (the context-parallel core saves no scores and computes its own blocks)."""
    cfg = CFG.replace(**changes)
    ref = TinyLlama(cfg)
    ref.loss(*random_tokens(2, 16, cfg.vocab_size)).backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters()])
    torch.testing.assert_close(run(_recompute_worker, 2, cfg)[0], want, atol=1e-5, rtol=0)
