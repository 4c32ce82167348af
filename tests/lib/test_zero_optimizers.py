"""ZeRO steps the user's torch.optim optimizer on each rank's flat fp32 shard (picolib/zero.py,
lesson 03): every element-wise optimizer equals one process, a learning-rate scheduler works
on `zero.optimizer`, and `state_dict()` — whole tensors by name, PyTorch's shape — round-trips
to another stage and to one process (DDP), which continue the run exactly."""
import torch
import torch.distributed as dist

from picolib.data_parallel import DDP
from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.flat import padded_numel, shard_bounds
from picolib.zero import ZeRO, unit_numels, zero_memory_bytes

CFG = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                  ffn_hidden=23, max_seq=16, seed=3)
MB, SEQ, STEPS, N = 2, 8, 3, 2
OPTIMIZERS = {
    "SGD momentum nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "Adam amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "AdamW fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "AdamW foreach": (torch.optim.AdamW, dict(lr=1e-2, foreach=True, weight_decay=0.1)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1)),
    "RMSprop centered momentum": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
}
# fp32: only the order of the gradient averaging differs; RMSprop and Adagrad divide by
# √(mean of g²) like Adam, which turns last-bit gradient differences into ≤ 1e-5 (seen)
ATOL = 5e-5


def batch(step):
    return random_tokens(MB * N, SEQ, CFG.vocab_size, seed=100 + step)


def schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)


def reference(cls, kw, steps=STEPS):
    model = TinyLlama(CFG)
    optim = cls(model.parameters(), **kw)
    sched = schedule(optim)
    for step in range(steps):
        model.loss(*batch(step)).backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def every_optimizer_worker():
    r = dist.get_rank()
    out = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        for stage in (1, 2, 3):
            model = TinyLlama(CFG)
            zero = ZeRO(model, stage, optimizer=cls, **kw)
            sched = schedule(zero.optimizer)
            for step in range(STEPS):
                x, y = batch(step)
                model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB]).backward()
                zero.step()
                zero.zero_grad()
                sched.step()
            out[name, stage] = (zero.gather_parameters(), zero.optimizer.param_groups[0]["lr"])
    return out


def test_every_elementwise_torch_optimizer_with_a_scheduler_equals_one_process():
    ranks = run(every_optimizer_worker, N, timeout=300)
    for name, (cls, kw) in OPTIMIZERS.items():
        ref = reference(cls, kw)
        for stage in (1, 2, 3):
            for rank, res in enumerate(ranks):
                got, lr = res[name, stage]
                assert lr == kw["lr"] * 0.5 ** STEPS            # the scheduler moved it
                for p in ref:
                    torch.testing.assert_close(got[p], ref[p], atol=ATOL, rtol=0,
                                               msg=f"{name} stage {stage} rank {rank} {p}")


def round_trip_worker():
    """Two AdamW steps under ZeRO-2, then `state_dict()`: (a) the same wrapper goes on,
    (b) a fresh ZeRO-3 loads it and goes on, (c) one process (DDP over a group of one rank,
    owning its AdamW) loads it and goes on with the whole batch. Also: after the gradient
    sync a unit's `master.grad` is its shard of the mean gradient, fp32."""
    r = dist.get_rank()
    kw = dict(optimizer=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    def local(model, step):
        x, y = batch(step)
        model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB]).backward()

    model = TinyLlama(CFG)
    zero = ZeRO(model, 2, **kw)
    for step in range(2):
        local(model, step)
        zero.step()
        zero.zero_grad()
    sd = zero.state_dict()
    twin = TinyLlama(CFG.replace(seed=99))           # other weights: all must come from sd
    zero3 = ZeRO(twin, 3, **kw)
    zero3.load_state_dict(sd)
    solo, _ = dist.new_subgroups(1)
    alone = TinyLlama(CFG.replace(seed=98))
    ddp = DDP(alone, solo, **kw)
    ddp.load_state_dict(sd)
    # the reduced gradient shard of step 3, checked against a whole mean gradient
    local(model, 2)
    zero.finish_gradient_sync()
    u = zero.units[-1]
    whole = TinyLlama(CFG)
    whole.load_state_dict(sd["model"], strict=False)
    whole.loss(*batch(2)).backward()
    flat = torch.cat([dict(whole.named_parameters())[n].grad.reshape(-1) for n in u.names])
    flat = torch.cat([flat, flat.new_zeros(padded_numel(u.numel, N) - u.numel)])
    lo, hi = shard_bounds(u.numel, N, r)
    grad_ok = (u.master.grad.dtype == torch.float32
               and torch.allclose(u.master.grad, flat[lo:hi], atol=1e-6, rtol=0))
    state_ok = zero.optimizer.state[u.master] is u.state and u.state["exp_avg"].shape == u.master.shape
    zero.step()
    local(twin, 2)
    zero3.step()
    alone.loss(*batch(2)).backward()
    ddp.step()
    return (zero.gather_parameters(), zero3.gather_parameters(),
            {n: p.detach().clone() for n, p in alone.named_parameters()},
            sorted(sd["optimizer"]["state"]["embed.weight"]), grad_ok, state_ok,
            sd["optimizer"]["param_groups"][0]["weight_decay"])


def test_state_dict_round_trips_to_another_stage_and_to_one_process():
    model = TinyLlama(CFG)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        model.loss(*batch(step)).backward()
        optim.step()
        optim.zero_grad()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    for rank, (same, stage3, alone, keys, grad_ok, state_ok, wd) in enumerate(
            run(round_trip_worker, N, timeout=240)):
        assert keys == ["exp_avg", "exp_avg_sq", "step"] and wd == 0.1
        assert grad_ok and state_ok, rank
        for got in (same, stage3, alone):
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], atol=2e-5, rtol=0, msg=f"rank {rank} {n}")


def param_groups_worker(stage):
    """AdamW with decay on the matrices and none on the 1-D weights, as param groups."""
    r = dist.get_rank()
    model = TinyLlama(CFG)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.5},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0,
               "lr": 3e-2}]
    zero = ZeRO(model, stage, optimizer=torch.optim.AdamW, lr=1e-2, param_groups=groups)
    for step in range(STEPS):
        x, y = batch(step)
        model.loss(x[r * MB:(r + 1) * MB], y[r * MB:(r + 1) * MB]).backward()
        zero.step()
        zero.zero_grad()
    pieces = [[g for g, *_ in u.pieces] for u in zero.units]     # each unit's groups here
    return zero.gather_parameters(), zero.memory(), pieces, zero.state_dict()["optimizer"]["param_groups"]


def test_param_groups_equal_one_process_with_the_same_groups():
    """A unit's shard is cut where its groups meet (one piece per unit and group): weight
    decay 0.5 on matrices, none and another lr on norm weights, equal to one process; the
    bytes are those without groups (same buffers); the groups come back by name."""
    model = TinyLlama(CFG)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.5},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0,
               "lr": 3e-2}]
    optim = torch.optim.AdamW(groups, lr=1e-2)
    for step in range(STEPS):
        model.loss(*batch(step)).backward()
        optim.step()
        optim.zero_grad()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    uniform = TinyLlama(CFG)                         # one group: the norms would decay too
    optim = torch.optim.AdamW(uniform.parameters(), lr=1e-2, weight_decay=0.5)
    for step in range(STEPS):
        uniform.loss(*batch(step)).backward()
        optim.step()
        optim.zero_grad()
    assert (uniform.norm.weight - ref["norm.weight"]).abs().max() > 1e-3
    one_d = sorted(n for n, p in model.named_parameters() if p.dim() < 2)
    for stage in (1, 2, 3):
        ranks = run(param_groups_worker, N, stage)
        # rank 0's shards hold matrices only; rank 1's are cut between the groups
        assert [sorted({g for unit in r[2] for g in unit}) for r in ranks] == [[0], [0, 1]]
        assert all(unit == [0, 1] for unit in ranks[1][2])
        for rank, (got, memory, pieces, saved) in enumerate(ranks):
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], atol=ATOL, rtol=0, msg=f"{stage} {rank} {n}")
            assert memory == zero_memory_bytes(stage, unit_numels(model), N, 8)   # as without groups
            assert sorted(saved[1]["params"]) == one_d and saved[1]["lr"] == 3e-2
