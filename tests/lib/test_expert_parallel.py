"""Expert parallelism equals one process holding all experts (fp32; atol 1e-6 on outputs,
aux loss and gradients of the layer — the values are O(1e-2) — and 1e-5 on the weights
after 3 Adam steps, as in tests/lib/test_composition.py).

Layer: ep = 1, 2, 4; top-1 and top-2; dropless and capacity 1.0 (tokens dropped); shared
expert on and off; both dispatchers. The reference is `MoE(token_groups=ep)`: each rank's
tokens are one capacity group, so the same tokens are dropped. Model: dp4 with ep2 (expert
gradients summed over the edp pairs only) and ep2×tp2 (attention tensor-parallel),
3 optimizer steps each, with the balancing loss in the loss."""
import pytest
import torch
import torch.distributed as dist

from picolib.comm import Ledger
from picolib.data_parallel import DDP
from picolib.expert_parallel import (ExpertParallelMoE, all_to_all_bytes, apply_expert_parallel,
                                     expert_gradient_groups)
from picolib.launch import WorkerError, run
from picolib.mesh import Mesh
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.moe import MoE, apply_moe
from picolib.tensor_parallel import apply_tensor_parallel
from picolib.zero import ZeRO

H, E, F = 16, 8, 24
CASES = [(k, cf, shared) for k in (1, 2) for cf in (None, 1.0) for shared in (False, True)]


def _layer(k, cf, shared, groups=1):
    return MoE(H, E, k, F, capacity_factor=cf, shared_hidden=12 if shared else 0,
               token_groups=groups, seed=3)


def _reference(ep, x, w, bias=None):
    out = {}
    for case in CASES:
        m = _layer(*case, groups=ep)
        if bias is not None:
            m.router.expert_bias.copy_(bias)
        xr = x.clone().requires_grad_()
        y = m(xr)
        ((y * w).sum() + m.aux_loss).backward()
        out[case] = (y.detach(), m.aux_loss.item(), m.dropped, xr.grad,
                     {n: p.grad.clone() for n, p in m.named_parameters()})
    return out


def _ep_worker(dispatcher, x, w, bias=None):
    ep, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for case in CASES:
        layer = ExpertParallelMoE(_layer(*case), None, dispatcher)
        if bias is not None:
            layer.router.expert_bias.copy_(bias)
        xs = x.chunk(ep)[r].clone().requires_grad_()
        with Ledger() as led:
            y = layer(xs)
        routing = layer.route(xs.detach())
        # the global loss is Σ_r (y_r·w_r) + mean_r aux_r; replicated weights sum their grads
        ((y * w.chunk(ep)[r]).sum() + layer.aux_loss / ep).backward()
        grads = {}
        for n, p in layer.named_parameters():
            g = p.grad.clone()
            if not n.startswith("experts."):
                dist.all_reduce(g)
            else:
                i, rest = n.split(".", 2)[1:]
                n = f"experts.{r * (E // ep) + int(i)}.{rest}"
            grads[n] = g
        out[case] = (y.detach(), layer.aux_loss.item(), layer.dropped, xs.grad, grads,
                     led.total("sent_bytes", "all_to_all"), routing)
    return out


def _compare(ref, results, ep, dispatcher):
    for case, (y_ref, aux_ref, dropped_ref, gx_ref, grads_ref) in ref.items():
        y = torch.cat([res[case][0] for res in results])
        gx = torch.cat([res[case][3] for res in results])
        torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=0, msg=f"{case} output")
        torch.testing.assert_close(gx, gx_ref, atol=1e-6, rtol=0, msg=f"{case} input grad")
        assert abs(sum(res[case][1] for res in results) / ep - aux_ref) < 1e-6, case
        assert sum(res[case][2] for res in results) == dropped_ref, case
        assert (dropped_ref > 0) == (case[1] is not None), case     # capacity 1.0 drops here
        for res in results:
            for name, g in res[case][4].items():
                torch.testing.assert_close(g, grads_ref[name], atol=1e-6, rtol=0, msg=f"{case} {name}")
        covered = {n for res in results for n in res[case][4]}
        assert covered == set(grads_ref), case                   # every gradient was compared


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_layer_equals_one_process(ep, dispatcher):
    g = torch.Generator().manual_seed(ep)
    x, w = torch.randn(8, 6, H, generator=g), torch.randn(8, 6, H, generator=g)
    results = run(_ep_worker, ep, dispatcher, x, w, timeout=120)
    _compare(_reference(ep, x, w), results, ep, dispatcher)
    if dispatcher == "alltoall":                                  # measured bytes = the routing's
        for case in CASES:
            formula = all_to_all_bytes([res[case][6] for res in results], E, H)
            for res, f in zip(results, formula, strict=True):           # ep = 1: all 0
                assert res[case][5] == f["counts"] + f["dispatch"] + f["combine"], (case, f)
            assert ep == 1 or sum(f["dispatch"] for f in formula) > 0


def test_a_rank_that_receives_no_tokens_still_works():
    """The bias sends every token to experts 0 and 1 (on rank 0 of 4): ranks 1-3 receive
    zero rows, run their experts on nothing and get zero gradients, not missing ones."""
    bias = torch.zeros(E)
    bias[:2] = 10.0
    x, w = torch.randn(8, 6, H), torch.randn(8, 6, H)
    results = run(_ep_worker, 4, "alltoall", x, w, bias, timeout=120)
    _compare(_reference(4, x, w, bias), results, 4, "alltoall")
    for r, res in enumerate(results[1:], start=1):
        for case in CASES:
            for name, g in res[case][4].items():
                if name.startswith("experts.") and int(name.split(".")[1]) // 2 == r:
                    assert g.abs().max() == 0, (r, name)


# ------------------------------------------------------------------ the model, with DP and TP

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                  max_seq=16)
MOE = dict(n_experts=4, expert_hidden=24, aux_weight=0.01)
STEPS, BATCH, SEQ, LR, EPS = 3, 8, 8, 1e-2, 1e-3


def _reference_train(dp, top_k, cf, shared):
    model = apply_moe(TinyLlama(CFG), top_k=top_k, capacity_factor=cf, shared_hidden=shared,
                      token_groups=dp, **MOE)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        tokens, targets = random_tokens(BATCH, SEQ, CFG.vocab_size, seed=100 + step)
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parallel_train(sizes, ep, top_k, cf, shared, ref, expert_groups=True):
    mesh = Mesh(**sizes)
    dp, n_dp = mesh.coordinate("dp"), mesh.size("dp")
    model = TinyLlama(CFG)
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh)
    apply_expert_parallel(model, mesh, ep=ep, top_k=top_k, capacity_factor=cf,
                          shared_hidden=shared, **MOE)
    ddp = DDP(model, mesh.group("dp"), groups=expert_gradient_groups(model) if expert_groups else None)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses, dropped = [], 0
    for step in range(STEPS):
        tokens, targets = (t.chunk(n_dp)[dp] for t in random_tokens(BATCH, SEQ, CFG.vocab_size,
                                                                   seed=100 + step))
        loss = model.loss(tokens, targets)
        loss.backward()
        dropped += sum(block.mlp.dropped for block in model.blocks)
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total, group=mesh.group("dp"))
        losses.append(total.item() / n_dp)
    if expert_groups:
        for a, b in zip(losses, ref[0], strict=True):
            assert abs(a - b) < 1e-5, (losses, ref[0])
    # the expected weights: the reference's, cut like this rank's
    expected = TinyLlama(CFG)
    expected.load_state_dict({n: v for n, v in ref[1].items() if ".mlp." not in n}, strict=False)
    if mesh.size("tp") > 1:
        apply_tensor_parallel(expected, mesh)
    want = {n: p for n, p in expected.named_parameters() if ".mlp." not in n}
    n_local, ep_rank = MOE["n_experts"] // ep, model.blocks[0].mlp.ep_rank
    errors, seen = {}, 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            i, tail = rest.split(".", 1)
            e = ref[1][f"{head}.mlp.experts.{ep_rank * n_local + int(i)}.{tail}"]
        else:
            e = ref[1][name] if ".mlp." in name else want[name]
        errors[name] = (p.detach() - e).abs().max().item()
        seen += 1
    assert seen == len(dict(model.named_parameters()))
    return max(errors.values()), dropped, ep_rank


@pytest.mark.parametrize("sizes, ep, top_k, cf, shared", [
    ({"dp": 4}, 2, 2, 1.0, 0),          # dp4 = 2 EP groups of 2: experts summed over edp pairs
    ({"dp": 4}, 2, 1, None, 16),
    ({"dp": 2, "tp": 2}, 2, 2, 1.0, 16),  # attention TP over tp, experts whole per EP rank
], ids=["dp2xep2-top2-drops", "dp2xep2-top1-shared", "ep2xtp2-top2-drops-shared"])
def test_model_trains_like_one_process(sizes, ep, top_k, cf, shared):
    ref = _reference_train(sizes["dp"], top_k, cf, shared)
    results = run(_parallel_train, 4, sizes, ep, top_k, cf, shared, ref, timeout=180)
    for err, dropped, _ in results:
        assert err < 1e-5, results
        assert (dropped > 0) == (cf is not None)
    assert sorted({r[2] for r in results}) == list(range(ep))


def test_reducing_the_experts_over_all_dp_ranks_is_wrong():
    """The same run with plain DDP: it sums different experts' gradients (ranks 0 and 1
    hold different experts at the same names) and the weights leave the reference."""
    ref = _reference_train(4, 1, None, 0)
    results = run(_parallel_train, 4, {"dp": 4}, 2, 1, None, 0, ref, False, timeout=180)
    assert all(err > 1e-3 for err, _, _ in results), results


def test_the_expert_gradients_are_summed_over_edp_only():
    """dp4, ep2: ranks {0, 2} hold experts 0-1, {1, 3} experts 2-3; DDP reduces the experts
    over those pairs (two small all-reduces per step), the rest over all 4."""
    def worker():
        mesh = Mesh(dp=4)
        model = apply_expert_parallel(TinyLlama(CFG), mesh, ep=2, top_k=1, **MOE)
        groups = expert_gradient_groups(model)
        ddp = DDP(model, mesh.group("dp"), groups=groups)
        sizes = sorted({b.group is None for b in ddp.buckets})
        return ([dist.get_process_group_ranks(g) for g in dict.fromkeys(groups.values())],
                model.blocks[0].mlp.ep_rank, sizes)
    results = run(worker, 4, timeout=60)
    assert [r[0] for r in results] == [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]
    assert [r[1] for r in results] == [0, 1, 0, 1]
    assert all(r[2] == [False, True] for r in results)


def _zero_sgd_step(stage, lr, scale_expert_groups):
    """One SGD step of dp4×ep2 under ZeRO with the experts' own groups; returns the
    largest distance of this rank's weights from the reference's (cut like this rank's)."""
    mesh = Mesh(dp=4)
    model = apply_expert_parallel(TinyLlama(CFG), mesh, ep=2, top_k=2, **MOE)
    groups = expert_gradient_groups(model)
    zero = ZeRO(model, stage, mesh.group("dp"), optimizer="sgd", lr=lr, groups=groups)
    if not scale_expert_groups:      # the mistake: average the experts over edp alone
        zero._scales = [1.0] * len(zero._scales)
    tokens, targets = (t.chunk(4)[mesh.coordinate("dp")] for t in random_tokens(BATCH, SEQ, 64, seed=5))
    model.loss(tokens, targets).backward()
    zero.step()
    ref = apply_moe(TinyLlama(CFG), top_k=2, token_groups=4, **MOE)
    ref.loss(*random_tokens(BATCH, SEQ, 64, seed=5)).backward()
    want = {n: p.detach() - lr * p.grad for n, p in ref.named_parameters()}
    r = model.blocks[0].mlp.ep_rank
    err = 0.0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            i, tail = rest.split(".", 1)
            name = f"{head}.mlp.experts.{2 * r + int(i)}.{tail}"
        err = max(err, (p.detach() - want[name]).abs().max().item())
    return err


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shards_the_experts_over_their_own_replicas(stage):
    """ZeRO(groups=): the experts' units are reduce-scattered over edp and still averaged
    over all dp = 4 ranks; SGD shows a wrong average (Adam would hide a constant factor)."""
    assert max(run(_zero_sgd_step, 4, stage, 0.5, True, timeout=120)) < 1e-6
    assert min(run(_zero_sgd_step, 4, stage, 0.5, False, timeout=120)) > 1e-4


# ------------------------------------------------------------------ bad input

def _bad(kwargs):
    with Ledger() as led:
        try:
            apply_expert_parallel(TinyLlama(CFG), kwargs.pop("mesh", None), **kwargs)
        except ValueError as e:
            return str(e), led.count()
    return "no error", led.count()


@pytest.mark.parametrize("kwargs, message", [
    ({"n_experts": 6, "top_k": 1}, "n_experts=6 does not divide by the ep size 4"),
    ({"n_experts": 4, "top_k": 5}, "top_k=5 is larger than n_experts=4"),
    ({"n_experts": 4, "top_k": 1, "capacity_factor": 0.0}, "capacity_factor must be > 0"),
    ({"n_experts": 4, "top_k": 1, "router": "relu"}, "unknown router 'relu'"),
    ({"n_experts": 4, "top_k": 1, "dispatcher": "ring"}, "unknown dispatcher 'ring'"),
])
def test_bad_input_is_refused_before_any_collective(kwargs, message):
    for text, collectives in run(_bad, 4, kwargs, timeout=60):
        assert message in text and collectives == 0, text


def test_ep_must_divide_dp_on_a_mesh():
    def worker():
        try:
            apply_expert_parallel(TinyLlama(CFG), Mesh(dp=4), ep=3, n_experts=6, top_k=1)
        except ValueError as e:
            return str(e)
    assert run(worker, 4, timeout=60) == ["the ep size 3 must divide dp=4 (EP groups are made of dp ranks)"] * 4


def test_expert_gradient_groups_need_a_mesh():
    def worker():
        model = apply_expert_parallel(TinyLlama(CFG), None, n_experts=4, top_k=1)
        expert_gradient_groups(model)
    with pytest.raises(WorkerError, match="need apply_expert_parallel over a Mesh"):
        run(worker, 2, timeout=60)
