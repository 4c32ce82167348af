"""Lesson 03's try-it bars come from formulas; here they meet the bytes that real ZeRO
ranks hold after one Adam step (ZeRO(...).memory(), measured on the tensors' storages)."""
import matplotlib
import pytest
import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.memory import measure
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.data_parallel import DDP
from picolib.tryit import knobs
from picolib.tryit.lesson03 import MODELS, per_rank, zero_bars
from picolib.zero import ZeRO, unit_numels

matplotlib.use("Agg")
CFG = LlamaConfig(vocab_size=61, hidden=18, n_layers=2, n_heads=3, n_kv_heads=1,
                  ffn_hidden=23, max_seq=16)   # the lesson's model: its units need padding


def _measured(stage, bf16):
    model = TinyLlama(CFG)
    x, y = random_tokens(2, 8, CFG.vocab_size, seed=dist.get_rank())
    if stage == 0:
        DDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model.loss(x, y).backward()
        opt.step()
        b = measure(model, opt)
        return {"params": b.params, "grads": b.grads, "optimizer": b.optimizer}
    zero = ZeRO(model, stage, optimizer="adam", lr=1e-3,
                param_dtype=torch.bfloat16 if bf16 else torch.float32)
    model.loss(x, y).backward()
    zero.step()
    return zero.memory()


def test_the_models_units_are_the_lessons():
    assert MODELS["tiny Llama"] == unit_numels(TinyLlama(CFG))


@pytest.mark.parametrize("stage, n", [(1, 2), (2, 3), (3, 4)])
def test_bars_equal_what_zero_ranks_hold(stage, n):
    want = per_rank(stage, n, MODELS["tiny Llama"], "fp32")
    for got in run(_measured, n, stage, False):
        assert got == want[f"ZeRO-{stage}"]
    for got in run(_measured, n, 0, False):
        assert got == want["DP"]


def test_bf16_bars_equal_zero1_with_bf16_weights():
    want = per_rank(1, 2, MODELS["tiny Llama"], "bf16 + fp32 master")["ZeRO-1"]
    for got in run(_measured, 2, 1, True):
        assert got == want


def test_the_knobs_cell_draws_and_returns_the_bars():
    # the lesson's cell opens on a meaningful setting: ZeRO-3 on 8 ranks, not N = 1
    mem = knobs(zero_bars, stage=[3, 1, 2], ranks=[8, 1, 2, 4, 16, 64, 256, 1024], model=list(MODELS))
    assert mem == per_rank(3, 8, MODELS["7.5B (ZeRO paper)"])
    assert sum(mem["DP"].values()) == 8 * sum(mem["ZeRO-3"].values())
    one = per_rank(3, 1, MODELS["7.5B (ZeRO paper)"])
    assert one["DP"] == one["ZeRO-3"]                 # N = 1: nobody to share with
    assert sum(zero_bars(3, 64)["ZeRO-3"].values()) == 120_000_000_000 // 64
    with pytest.raises(ValueError):
        per_rank(0, 2, 100)


def test_the_lessons_bars_pass_the_figure_check():
    import matplotlib.pyplot as plt
    from picolib.figure_check import problems
    from picolib.style import MEMORY
    from picolib.tryit.lesson03 import COLORS, plot_groups
    assert COLORS == {k: MEMORY[k] for k in ("params", "grads", "optimizer")}
    fig, ax = plt.subplots(figsize=(6, 3.8), layout="constrained")
    plot_groups({f"N = {n}": per_rank(3, n, MODELS["tiny Llama"], "fp32") for n in (1, 8)}, ax=ax)
    assert ax.get_ylabel() == "KiB per rank"          # binary units for memory
    assert problems(fig) == []
    plt.close(fig)


# ---------------------------------------------------------------- lesson 03 §6: ZeRO-3's backward order
COSTS = {"F": 0.03, "B": 0.06, "all_gather": 0.02, "reduce_scatter": 0.02}   # the lesson's emulated costs


def backward_order(events, rank: int, costs: dict) -> dict:
    """What `rank`'s ZeRO-3 backward did with its gradients, read off its timeline events:
    "done", the blocks whose backward (B) ended before the first reduce-scatter started (their
    whole gradients held until then); "rs_hidden", the blocks whose reduce-scatter ran under
    some B for at least half its emulated cost; "waited", the blocks whose reduce-scatter ended
    before block 1's B started; "gap", the time between block 2's B and block 1's."""
    mine = [e for e in events if e["rank"] == rank]
    back = {e["meta"]["unit"]: e for e in mine if e["name"] == "B"}
    rs = [e for e in mine if e["name"] == "reduce_scatter"]

    def under_compute(e):
        return any(min(e["end"], c["end"]) - max(e["start"], c["start"]) >= 0.5 * costs[e["name"]]
                   for c in back.values())
    return dict(done=sorted(u for u, e in back.items() if e["end"] <= rs[0]["start"]),
                rs_hidden=[e["meta"]["unit"] for e in rs if under_compute(e)],
                waited=[e["meta"]["unit"] for e in rs if e["end"] <= back[1]["start"]],
                gap=back[1]["start"] - back[2]["end"])


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero3_reduce_scatters_wait_for_the_last_gather_and_two_stay_in_flight(prefetch):
    """The lesson's §6 timelines: a block's whole gradient stays until backward has issued its
    last all-gather (one order on every rank); `_drain(keep=1)` keeps at most two reduce-scatters
    in flight, so before block 1's backward a rank waits for those of blocks 4 and 3."""
    from picolib.timeline import Timeline, merge

    def zero3_timeline(cfg):       # the lesson's zero3_step: one ZeRO-3 step, recorded with emulated costs
        tl, model = Timeline(emulate=COSTS), TinyLlama(cfg)
        zero = ZeRO(model, 3, optimizer=torch.optim.Adam, lr=1e-3, prefetch=prefetch, timeline=tl)
        model.loss(*random_tokens(2, 8, cfg.vocab_size, seed=dist.get_rank())).backward()
        zero.step()
        return tl.events

    events = merge(run(zero3_timeline, 2, CFG.replace(n_layers=4)))
    for r in (0, 1):
        o = backward_order(events, r, COSTS)
        assert o["done"] == ([2, 3, 4] if prefetch else [1, 2, 3, 4]), (r, o)
        assert o["rs_hidden"] == ([2] if prefetch else []), (r, o)
        if prefetch:
            assert o["waited"][:2] == [4, 3], (r, o)
            assert o["gap"] >= 2 * COSTS["reduce_scatter"] * 0.99, (r, o)


# ---------------------------------------------------------------- lesson 03 §7: FSDP2 beside picolib
def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor
    return sum((t._local_tensor if isinstance(t, DTensor) else t).numel() * 4 for t in tensors)


def fsdp2_vs_zero(cfg, reshard_after_forward: bool, mb: int, seq: int) -> tuple:
    """On every rank: one Adam step of PyTorch's FSDP2 (`fully_shard` on each block, then on
    the root) and one of picolib's ZeRO-3 (`reshard_after_forward=True`) or ZeRO-2 (False) on
    the same micro-batch. Returns (FSDP2's bytes held — the local shards of its DTensors —,
    FSDP2's calls {op: count}, the elements of each of FSDP2's units (its shards' sum × N),
    ZeRO's `memory()`, ZeRO's ledger summary, ZeRO's unit sizes). FSDP2's calls are counted by
    PyTorch's `CommDebugMode` (a dispatch mode that sees each c10d collective)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from picolib.comm import Ledger

    x, y = random_tokens(mb, seq, cfg.vocab_size, seed=dist.get_rank())
    model = TinyLlama(cfg)
    for block in model.blocks:                  # bottom-up: each block, then the root
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with CommDebugMode() as seen:
        model.loss(x, y).backward()
        opt.step()
    counts = {"all_gather": 0, "reduce_scatter": 0}
    for op, k in seen.get_comm_counts().items():     # c10d._allgather_base_, _reduce_scatter_base_
        name = str(op).replace("allgather", "all_gather")
        for kind in counts:
            counts[kind] += k if kind in name else 0
    n = dist.get_world_size()
    units = [_local_bytes(block.parameters()) // 4 * n for block in model.blocks]
    units.append(_local_bytes(p for name, p in model.named_parameters() if not name.startswith("blocks.")) // 4 * n)
    fsdp = {"params": _local_bytes(model.parameters()),
            "grads": _local_bytes(p.grad for p in model.parameters()),
            "optimizer": _local_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step")}
    ours = TinyLlama(cfg)
    zero = ZeRO(ours, 3 if reshard_after_forward else 2, optimizer=torch.optim.Adam, lr=1e-3)
    with Ledger() as led:
        ours.loss(x, y).backward()
        zero.step()
    return fsdp, counts, units, zero.memory(), led.summary(), zero.unit_numels()


@pytest.mark.parametrize("n, reshard_after_forward", [(2, True), (2, False), (4, True), (4, False)])
def test_fsdp2_holds_zero3_bytes_and_makes_zero3_or_zero2_calls(n, reshard_after_forward):
    """Lesson 03 §7: FSDP2 holds ZeRO-3's bytes per rank between steps with either setting (with
    True: picolib ZeRO-3's, to the byte), and makes ZeRO-3's calls with True (each unit gathered
    before forward and again before backward), ZeRO-2's with False — one call per unit."""
    from picolib.requirements import needs
    from picolib.zero import zero_memory_bytes
    if not needs("2.7", "FSDP2 on the CPU"):   # CPU stream events: torch ≥ 2.7 (pytorch/pytorch#145935)
        pytest.skip("FSDP2 on the CPU needs torch 2.7")
    fcfg = LlamaConfig(vocab_size=64, hidden=16, n_layers=2, n_heads=2, n_kv_heads=1,
                       ffn_hidden=32, max_seq=16)              # every dim 0 divides by 2 and 4
    fsdp, fcalls, funits, zmem, zled, znumels = run(fsdp2_vs_zero, n, fcfg, reshard_after_forward, 2, 8)[0]
    assert fsdp == zero_memory_bytes(3, znumels, n, 8)
    if reshard_after_forward:
        assert fsdp == zmem
    assert fcalls["all_gather"] == zled["all_gather"]["calls"] == (6 if reshard_after_forward else 3)
    assert fcalls["reduce_scatter"] == zled["reduce_scatter"]["calls"] == 3
    assert sorted(funits) == sorted(znumels)
