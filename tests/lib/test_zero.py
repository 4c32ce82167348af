"""ZeRO-1/2/3 against single-process training, exact bytes of memory and traffic, the
seed's worked example, and the errors (picolib/zero.py, lesson 03)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from picolib.comm import Ledger
from picolib.launch import WorkerError, run
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.timeline import Timeline
from picolib.zero import (ZeRO, optimizer_state_factor, padded_numel, shard_bounds,
                          unit_numels, zero_memory_bytes, zero_traffic_bytes)

# Odd sizes on purpose: the root unit (2214 parameters) and each block (2142) do not
# divide by 4, so N = 4 pads every unit.
CFG = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                  ffn_hidden=23, max_seq=16, seed=3)
MB, SEQ, STEPS = 2, 8, 3
OPTS = {"sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01), "adam": dict(lr=1e-2)}
CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
# fp32 tolerances. SGD: only the order of the gradient averaging differs (≈1e-8 seen).
# Adam divides by √v, so those last-bit gradient differences move a weight by up to a few
# 1e-6 in three steps (3e-6 seen): atol 2e-5.
ATOL = {"sgd": 1e-6, "adam": 2e-5}


def batch(step, n):
    return random_tokens(MB * n, SEQ, CFG.vocab_size, seed=100 + step)


def reference(opt: str, n: int):
    model = TinyLlama(CFG)
    hp = OPTS[opt]
    optim = CLASSES[opt](model.parameters(), **hp)
    for step in range(STEPS):
        model.loss(*batch(step, n)).backward()
        optim.step()
        optim.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_all_stages(param_dtype=torch.float32):
    """On every rank: for each optimizer and stage, 3 steps on this rank's slice of the
    batch; the weights, the bytes held and the last step's ledger."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for opt, hp in OPTS.items():
        for stage in (1, 2, 3):
            model = TinyLlama(CFG)
            zero = ZeRO(model, stage, optimizer=CLASSES[opt], param_dtype=param_dtype, **hp)
            for step in range(STEPS):
                x, y = batch(step, n)
                with Ledger() as ledger, SavedActivations() as acts:
                    model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB]).backward()
                    zero.step()
                    zero.zero_grad()
            out[opt, stage] = dict(weights=zero.gather_parameters(), memory=zero.memory(),
                                   ledger=ledger.summary(), units=zero.unit_numels(),
                                   activations=acts.bytes, k=zero.state_factor())
    return out


@pytest.fixture(scope="module", params=[2, 4])
def trained(request):
    n = request.param
    return n, run(train_all_stages, n, timeout=240)


def test_units_are_padded_for_four_ranks():
    sizes = unit_numels(TinyLlama(CFG))
    assert sizes == [2214, 2142, 2142]
    assert all(padded_numel(s, 4) > s for s in sizes)


@pytest.mark.parametrize("opt", list(OPTS))
def test_every_stage_matches_single_process_training(trained, opt):
    n, ranks = trained
    ref = reference(opt, n)
    for stage in (1, 2, 3):
        for rank, res in enumerate(ranks):
            got = res[opt, stage]["weights"]
            assert set(got) == set(ref)
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], atol=ATOL[opt], rtol=0,
                                           msg=f"N={n} stage {stage} rank {rank} {name}")


def test_memory_bytes_match_the_formula_exactly(trained):
    n, ranks = trained
    for (opt, stage), res in ranks[0].items():
        k = optimizer_state_factor(opt, OPTS[opt].get("momentum", 0.0))
        assert res["k"] == k      # read from torch's optimizer state = the formula's k
        expected = zero_memory_bytes(stage, res["units"], n, k)
        assert res["memory"] == expected, (opt, stage)
    # fp32 Adam, the numbers spelled out: Ψ = 6498, padded for N
    psi = sum(padded_numel(s, n) for s in ranks[0]["adam", 1]["units"])
    assert ranks[0]["adam", 1]["memory"] == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi // n}
    assert ranks[0]["adam", 2]["memory"] == {"params": 4 * psi, "grads": 4 * psi // n, "optimizer": 8 * psi // n}
    assert ranks[0]["adam", 3]["memory"] == {"params": 4 * psi // n, "grads": 4 * psi // n, "optimizer": 8 * psi // n}


def test_traffic_per_step_is_two_or_three_psi(trained):
    n, ranks = trained
    for (opt, stage), res in ranks[1].items():
        units, led = res["units"], res["ledger"]
        one_psi = sum((n - 1) * padded_numel(s, n) * 4 // n for s in units)
        assert led["reduce_scatter"]["sent_bytes"] == one_psi
        assert led["all_gather"]["sent_bytes"] == (2 if stage == 3 else 1) * one_psi
        assert led["all_gather"]["calls"] == (2 if stage == 3 else 1) * len(units)
        assert set(led) == {"reduce_scatter", "all_gather"}
        total = sum(v["sent_bytes"] for v in led.values())
        assert total == zero_traffic_bytes(stage, units, n) == (3 if stage == 3 else 2) * one_psi


def test_saved_activations_are_not_sharded(trained):
    n, ranks = trained
    plain = TinyLlama(CFG)
    x, y = batch(0, n)
    with SavedActivations() as acts:
        plain.loss(x[:MB], y[:MB])
    for res in ranks[0].values():
        assert res["activations"] == acts.bytes > 0


def test_bf16_compute_with_fp32_master():
    """bf16 parameters and gradients, fp32 master and Adam state: 2 + 2 + 12/N bytes per
    parameter for ZeRO-1; all stages take bitwise the same steps; close to fp32 training."""
    n = 2

    def worker():
        r = dist.get_rank()
        out = {}
        for stage in (1, 2, 3):
            model = TinyLlama(CFG)
            zero = ZeRO(model, stage, optimizer="adam", param_dtype=torch.bfloat16, lr=1e-2)
            for step in range(STEPS):
                x, y = batch(step, n)
                model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB]).backward()
                zero.step()
                zero.zero_grad()
            out[stage] = (zero.gather_parameters(), zero.memory(), zero.unit_numels(),
                          zero.state_factor())
        return out

    res = run(worker, n, timeout=240)[0]
    units = res[1][2]
    k = optimizer_state_factor("adam", master=True)
    assert k == 12 == res[1][3]     # the formula, and read from the optimizer's state
    assert res[1][1] == zero_memory_bytes(1, units, n, k, param_bytes=2)
    psi = sum(padded_numel(s, n) for s in units)
    assert res[1][1] == {"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi // n}
    assert res[3][1] == {"params": 2 * psi // n, "grads": 2 * psi // n, "optimizer": 12 * psi // n}
    ref = reference("adam", n)
    for stage in (2, 3):
        for name, w in res[1][0].items():
            assert torch.equal(res[stage][0][name], w), (stage, name)
    # bf16 forward/backward against fp32 training: Adam moves a weight by at most about lr
    # per step, so no weight can be further off than 2·lr·steps; over 90% agree to 2e-3 (96% seen)
    # (a gradient near 0 may flip sign in bf16 and send its weight the other way)
    diff = torch.cat([(w - ref[name]).abs().flatten() for name, w in res[1][0].items()])
    assert diff.max() <= 2 * 1e-2 * STEPS
    assert (diff <= 2e-3).float().mean() >= 0.9


def seed_example(stage, opt):
    """The note's example: W = [1,2,3,4]; rank r sees x = r+1; loss ½(w·x)²."""
    r = dist.get_rank()

    def make():
        m = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            m.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        return m

    x = torch.full((1, 4), float(r + 1))
    m = make()
    zero = ZeRO(m, stage, optimizer=CLASSES[opt], lr=0.1)
    (0.5 * m(x) ** 2).sum().backward()
    zero.finish_gradient_sync()                 # the reduce-scatter; step() would call it
    grad_shard = zero.units[0].grad.clone()
    zero.step()
    state = {k: v.clone() for k, v in zero.units[0].state.items()}
    # plain DP: all-reduce (mean) the whole gradient, then torch.optim on every rank
    dp = make()
    (0.5 * dp(x) ** 2).sum().backward()
    dist.all_reduce(dp.weight.grad)
    dp.weight.grad /= dist.get_world_size()
    optim = CLASSES[opt](dp.parameters(), lr=0.1)
    optim.step()
    return zero.gather_parameters()["weight"], dp.weight.detach().clone(), grad_shard, state


@pytest.mark.parametrize("stage", [1, 3])
def test_seed_worked_example_exact(stage):
    for opt, expected in [("sgd", [-1.5, -0.5, 0.5, 1.5]), ("adam", [0.9, 1.9, 2.9, 3.9])]:
        ranks = run(seed_example, 2, stage, opt)
        for r, (w, dp_w, grad_shard, state) in enumerate(ranks):
            assert torch.equal(w, dp_w)                      # ZeRO = DP, bit for bit
            # the note's numbers, up to fp32 rounding: 0.1 has no exact binary form, and
            # torch computes 2 - 0.1·25 in one fused step → -0.50000006 (1 ulp = 6e-8)
            torch.testing.assert_close(w, torch.tensor([expected]), atol=6e-8, rtol=0)
            assert torch.equal(grad_shard, torch.tensor([25.0, 25.0]))  # (10 + 40) / 2, half each
            if opt == "adam":                                # m, v of this rank's 2 weights only
                assert torch.equal(state["exp_avg"], torch.tensor([2.5, 2.5]))
                assert torch.equal(state["exp_avg_sq"], torch.tensor([0.625, 0.625]))


def test_stage3_gathers_one_block_ahead_and_frees():
    """During block i's forward only the root, block i and (prefetched) block i+1 are whole;
    the prefetch of block i+1 is issued before block i computes."""
    def worker():
        model = TinyLlama(CFG.replace(n_layers=4))
        tl, whole, zero = Timeline(), [], None
        for blk in model.blocks:   # registered first, so they run before ZeRO's own hooks
            blk.register_forward_hook(lambda m, a, o: whole.append(
                [i for i, u in enumerate(zero.units) if not u.is_free()]))
        zero = ZeRO(model, 3, optimizer="sgd", lr=0.1, timeline=tl)
        x, y = random_tokens(1, SEQ, CFG.vocab_size)
        model.loss(x, y).backward()
        after = [u.is_free() for u in zero.units]
        zero.step()
        return whole, after, tl.events

    whole, after, events = run(worker, 2)[0]
    assert whole == [[0, 1, 2], [0, 2, 3], [0, 3, 4], [0, 4]]
    assert all(after)
    gathers = [e for e in events if e["name"] == "all_gather"]
    fwd = [e for e in events if e["name"] == "F"]
    assert len(gathers) == 2 * 5 and len(fwd) == 4
    for f in fwd[:-1]:   # unit u+1's all-gather was issued before unit u's forward began
        nxt = next(g for g in gathers if g["meta"]["unit"] == f["meta"]["unit"] + 1)
        assert nxt["start"] <= f["start"]


def test_in_flight_names_the_reduce_scatters_not_yet_waited_for():
    """`in_flight`: the flat gradient and shard of every reduce-scatter started and not yet
    waited for. Stage 1 lets every unit's run until the step; stage 2 waits as it goes, so at
    most one is in flight when a gradient lands; after the step none is left."""
    def worker(stage):
        model = TinyLlama(CFG.replace(n_layers=4))
        zero, seen = ZeRO(model, stage, optimizer="sgd", lr=0.1), []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _: seen.append(len(zero.in_flight())))
        x, y = random_tokens(1, SEQ, CFG.vocab_size)
        model.loss(x, y).backward()
        before_step = len(zero.in_flight())
        zero.step()
        return max(seen), before_step, len(zero.in_flight()), len(zero.units)

    _, before_step, after, units = run(worker, 2, 1)[0]
    assert before_step == 2 * units and after == 0        # stage 1: every unit's, until the step
    seen, before_step, after, _ = run(worker, 2, 2)[0]
    assert seen == 2 and before_step <= 2 and after == 0  # stage 2: one unit's at a time


def test_shard_bounds_and_formulas():
    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert padded_numel(10, 4) == 12 and padded_numel(12, 4) == 12
    # the textbook table, mixed precision (2 + 2 + 12), Ψ = 7.5e9 divisible by N = 64
    psi, n = 7_500_000_000, 64
    gb = [sum(zero_memory_bytes(s, psi, n, 12, param_bytes=2).values()) / 1e9 for s in range(4)]
    assert gb == [120.0, 31.40625, 16.640625, 1.875]   # the ZeRO paper's 120, 31.4, 16.6, 1.9 GB
    assert zero_traffic_bytes(0, 8, 4) == zero_traffic_bytes(1, 8, 4) == 2 * 6 * 4
    assert zero_traffic_bytes(3, 8, 4) == 3 * 6 * 4


def test_bad_input_raises_before_any_work():
    model = TinyLlama(CFG)
    for stage in (0, 4, True, "1"):
        with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
            ZeRO(model, stage)
    with pytest.raises(ValueError, match="not supported"):
        ZeRO(model, 1, optimizer="lamb")
    with pytest.raises(TypeError, match="momentum"):
        ZeRO(model, 1, optimizer="adam", momentum=0.9)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        ZeRO(mixed, 1)
    with pytest.raises(RuntimeError, match="process group"):
        ZeRO(model, 1)                 # no group in this (launcher) process
    with pytest.raises(ValueError, match="at least 1"):
        zero_memory_bytes(1, 100, 0, 8)
    with pytest.raises(ValueError):
        shard_bounds(10, 0, 0)


def test_group_of_size_zero_raises():
    def worker():
        sub = dist.new_group([0])      # rank 1 is not in it: a group of size 0 from there
        try:
            ZeRO(nn.Linear(3, 3), 1, group=sub)
        except ValueError as e:
            return str(e)
        return "built"

    assert run(worker, 2) == ["built", "rank 1 is not a member of the data-parallel group: "
                                       "it has size 0 here"]


class TrustRatio(torch.optim.Optimizer):
    """LAMB's idea in six lines: SGD scaled by ‖w‖/‖g‖ of the whole tensor — not element-wise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"] * float(p.norm() / p.grad.norm()))


def test_optimizer_errors_come_before_any_collective():
    """torch's own checks of the hyperparameters, then the element-wise probe: here there
    is no process group at all, so any collective would raise RuntimeError instead."""
    model = TinyLlama(CFG)
    for opt, kw, message in [(torch.optim.Adam, dict(lr=-0.1), r"Invalid learning rate: -0\.1"),
                             (torch.optim.AdamW, dict(betas=(1.0, 0.999)), r"Invalid beta parameter at index 0: 1\.0"),
                             (torch.optim.Adam, dict(eps=-1.0), r"Invalid epsilon value: -1\.0"),
                             (torch.optim.SGD, dict(lr=0.1, momentum=-0.9), r"Invalid momentum value: -0\.9")]:
        with pytest.raises(ValueError, match=message):
            ZeRO(model, 1, optimizer=opt, **kw)
    refused = [(torch.optim.Adafactor, "other values on the pieces"),
               (torch.optim.Muon, "Muon only supports 2D parameters"),
               (torch.optim.LBFGS, "closure"), (torch.optim.SparseAdam, "dense gradients"),
               (TrustRatio, "other values on the pieces")]
    for opt, why in refused:
        with pytest.raises(ValueError, match=rf"ZeRO cannot step {opt.__name__} on a flat shard: .*{why}"
                                             r".*element-wise optimizer"):
            ZeRO(model, 2, optimizer=opt)
    with pytest.raises(ValueError, match="'lion' is not supported"):
        ZeRO(model, 2, optimizer="lion")
    with pytest.raises(TypeError, match="returned list, not a torch.optim.Optimizer"):
        ZeRO(model, 2, optimizer=lambda params: list(params))
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, not 5"):
        ZeRO(model, 5, optimizer=torch.optim.Adam, lr=-1.0)     # the stage is checked first
    with pytest.raises(RuntimeError, match="process group"):   # an element-wise one passes
        ZeRO(model, 1, optimizer=lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5))
    assert all(p.grad is None for p in model.parameters())   # nothing was attached


def frozen_and_buffers_worker():
    """Rank r starts with a frozen norm weight of r + 1 and RoPE tables shifted by r;
    ZeRO makes them rank 0's on every rank, and training leaves the frozen weight alone."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (1, 2, 3):
        model = TinyLlama(CFG)
        model.norm.weight.requires_grad_(False)
        with torch.no_grad():
            model.norm.weight.fill_(r + 1.0)
            model.rope_cos.add_(r)
        zero = ZeRO(model, stage, optimizer="adam", lr=1e-2)
        x, y = batch(0, n)
        model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB]).backward()
        zero.step()
        out[stage] = (model.norm.weight.detach().clone(), model.rope_cos.clone(),
                      sorted(zero.gather_parameters()))
    return out


def test_frozen_parameters_and_buffers_come_from_rank_0():
    ranks = run(frozen_and_buffers_worker, 2, timeout=120)
    cos = TinyLlama(CFG).rope_cos
    for rank, res in enumerate(ranks):
        for stage, (norm, rope_cos, names) in res.items():
            assert torch.equal(norm, torch.ones(CFG.hidden)), (rank, stage)   # rank 0's 1.0
            assert torch.equal(rope_cos, cos), (rank, stage)                  # rank 0's, + 0
            assert "norm.weight" not in names and "embed.weight" in names


def non_finite_worker(stage, catch, bad_rank, element_only=False):
    """Step 1 is healthy; in step 2 rank `bad_rank` multiplies its loss by NaN (or, with
    `element_only`, makes one element of its norm-weight gradient inf)."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = TinyLlama(CFG)
    zero = ZeRO(model, stage, optimizer="adam", lr=1e-2)
    message = None
    for step in range(3):
        x, y = batch(step, n)
        loss = model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB])
        hook = None
        if step == 1 and r == bad_rank:
            if element_only:
                hook = model.norm.weight.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            else:
                loss = loss * float("nan")
        loss.backward()
        if hook is not None:
            hook.remove()
        before = zero.gather_parameters()
        if not catch:
            zero.step()
        else:
            try:
                zero.step()
            except FloatingPointError as e:
                message = str(e)
                untouched = all(torch.equal(w, before[k]) for k, w in zero.gather_parameters().items())
        zero.zero_grad()
    finite = all(torch.isfinite(w).all() for w in zero.gather_parameters().values())
    return message, untouched, finite, zero.steps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nan_loss_on_one_rank_is_reported_by_every_rank(stage, no_leftover_workers):
    with pytest.raises(WorkerError, match=r"step 2: a gradient is NaN or inf after the "
                                          r"reduce-scatter; the local gradient was non-finite on rank 1\."):
        run(non_finite_worker, 2, stage, False, 1, timeout=60)


@pytest.mark.parametrize("n, element_only", [(2, False), (4, True)])
def test_non_finite_step_leaves_the_weights_and_training_goes_on(n, element_only):
    """With N=4 rank 2 spoils one element only, which lands in rank 1's shard: the other
    ranks learn of it from the NaN rank 2 writes into every shard (no hang, no extra
    collective on healthy steps)."""
    bad = 1 if n == 2 else 2
    for stage in (1, 2, 3):
        for rank, (message, untouched, finite, steps) in enumerate(
                run(non_finite_worker, n, stage, True, bad, element_only, timeout=60)):
            assert message is not None and "step 2: " in message, (stage, rank, message)
            assert message.endswith("lower the learning rate") and f"non-finite on rank {bad}." in message
            assert untouched and finite, (stage, rank)
            assert steps == 2                  # steps 1 and 3 were taken, step 2 was not


def accumulate_twice_worker():
    m = nn.Linear(3, 2)
    zero = ZeRO(m, 1, optimizer="sgd", lr=0.1)
    m(torch.ones(1, 3)).sum().backward()
    try:
        m(torch.ones(1, 3)).sum().backward()   # a second synchronised backward before step()
    except RuntimeError as e:
        return str(e)


def test_second_synchronised_backward_before_step_is_refused():
    assert "already reduce-scattered: call step()" in run(accumulate_twice_worker, 1)[0]


class TwiceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3)])

    def forward(self, x):
        return self.blocks[0](self.blocks[0](x))


def unit_twice_worker():
    model = TwiceBlock()
    ZeRO(model, 3, optimizer="sgd", lr=0.1)
    try:
        model(torch.ones(1, 3))
    except RuntimeError as e:
        return str(e)


def test_stage3_unit_used_twice_in_one_forward_is_refused():
    """Gathering it again would be a collective that other ranks might not make."""
    assert "gathers unit 0 once per forward" in run(unit_twice_worker, 1)[0]
