"""Where a parameter lives (picolib/param_placement.py), checked against the transformed modules: on
every rank of several meshes, each local tensor has the described local name and shape, and
put in its box of the whole tensor it is the single-process model's values there (so the
copies hold the same values); counted once per set of copies, the boxes cover every element
of the model exactly once, at any size (640 ranks of a preset computed without a tensor)."""
import math

import pytest
import torch
import torch.distributed as dist

from picolib.compose import TrainConfig, build, check_config
from picolib.param_placement import boxes_of_range, global_shapes, placements
from picolib.parallel_layout import coordinates, rank_at
from picolib.launch import run
from picolib.mesh import Mesh
from picolib.model import TinyLlama, param_count
from picolib.moe import apply_moe
from picolib import tensor_parallel
from picolib.tensor_parallel import ROW, TP_PLAN, apply_tensor_parallel


def _reference(cfg):
    model = TinyLlama(cfg.model_config())
    if cfg.experts:
        apply_moe(model, n_experts=cfg.experts, top_k=cfg.top_k)
    return dict(model.named_parameters())


def _compare(cfg):
    mesh = Mesh("cpu", **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    stages, wrappers, *_ = build(cfg, mesh)
    whole, rank = _reference(cfg), dist.get_rank()
    described = placements(cfg, rank)
    held = {(s, n): p for s, m in stages.items() for n, p in m.named_parameters()}
    assert sorted((p.stage, p.local) for p in described) == sorted(held)
    for p in described:
        local = held[(p.stage, p.local)].detach()
        assert tuple(local.shape) == p.sizes, p
        box = whole[p.name][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]
        assert torch.equal(local, box), p.name
        assert rank in p.copies and rank in p.replicas and set(p.replicas) <= set(p.copies)
    return len(described)


MESHES = {
    "dp2×tp2 ZeRO-1": (4, dict(dp=2, tp=2, zero=1)),
    "tp4 (KV heads on two ranks each)": (4, dict(tp=4)),
    "pp2×tp2 interleaved": (4, dict(pp=2, tp=2, schedule="interleaved", micro_batches=2)),
    "dp2×cp2 ZeRO-2": (4, dict(dp=2, cp=2, zero=2)),
    "dp4 ep2 experts": (4, dict(dp=4, ep=2, experts=4, top_k=2)),
    "dp2×pp2×tp2 ep2": (8, dict(dp=2, pp=2, tp=2, ep=2, experts=4, top_k=2, zero=1, micro_batches=2)),
}


@pytest.mark.parametrize("name", MESHES)
def test_every_local_tensor_is_its_box_of_the_single_process_tensor(name):
    nproc, options = MESHES[name]
    cfg = TrainConfig(progress=False, **options)
    check_config(cfg, nproc)
    counts = run(_compare, nproc, cfg, timeout=240)
    assert all(c > 0 for c in counts)


def _shards_of_the_transform(cfg, plan):
    """On this rank: `apply_tensor_parallel` on a real model under TP_PLAN updated by `plan`;
    each tensor it leaves, against its box of the model's tensors from before the transform."""
    tensor_parallel.TP_PLAN.update(plan)        # the module's table (`run` sends globals by value)
    model = TinyLlama(cfg.model_config())
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = dict(apply_tensor_parallel(model).named_parameters())
    described = placements(cfg, dist.get_rank())
    assert sorted(p.local for p in described) == sorted(held)
    for p in described:
        box = whole[p.name][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]
        assert torch.equal(held[p.local].detach(), box), p.name
    return {p.name: p.sizes for p in described}


@pytest.mark.parametrize("tp, plan", [(4, {}), (2, {"mlp.w_up": ROW})])
def test_the_transform_and_placements_cut_as_the_one_plan_says(tp, plan, monkeypatch):
    """tensor_parallel.TP_PLAN decides each cut for both: the shards `apply_tensor_parallel`
    makes (real values, not materialized from placements) are the boxes `placements` gives, with
    the table as it is (tp=4: a KV head on two ranks) and with `w_up` changed to a row cut —
    which moves exactly the w_up boxes, in the transform and in placements alike."""
    cfg = TrainConfig(progress=False, tp=tp)
    before = {p.name: p.sizes for p in placements(cfg, 0)}
    for role, how in plan.items():
        monkeypatch.setitem(TP_PLAN, role, how)
    moved = {n for n, s in before.items() if {p.name: p.sizes for p in placements(cfg, 0)}[n] != s}
    n_layers = cfg.model_config().n_layers
    assert moved == {f"blocks.{i}.{r}.weight" for r in plan for i in range(n_layers)}
    sizes = run(_shards_of_the_transform, tp, cfg, plan, timeout=240)
    assert sizes[0] == {p.name: p.sizes for p in placements(cfg, 0)}


@pytest.mark.parametrize("options, world", [
    (dict(dp=2, tp=2), 4), (dict(tp=4, pp=2, micro_batches=2), 8),
    (dict(dp=4, ep=4, experts=4, tp=2, cp=2), 16),
    (dict(preset="base", dp=20, tp=8, pp=4, micro_batches=8, schedule="interleaved"), 640),
    (dict(preset="small", tp=8), 8),          # 4 KV heads on 8 ranks: each held twice
])
def test_boxes_counted_once_per_set_of_copies_cover_the_model_once(options, world):
    """Computed for every rank without building anything: for each parameter, the boxes of
    the ranks that are the first of their copies' replicas tile the whole tensor with no
    overlap; the element count equals `param_count`, an independent formula (dense models)."""
    cfg = TrainConfig(**options)
    shapes = global_shapes(cfg)
    seen = {n: torch.zeros(s, dtype=torch.int32) for n, s in shapes.items()} if world <= 16 else None
    total = 0
    for rank in range(world):
        assert rank_at(cfg, **coordinates(cfg, rank)) == rank
        for p in placements(cfg, rank):
            if p.first and rank == p.replicas[0]:
                total += math.prod(p.sizes)
                if seen is not None:
                    seen[p.name][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))] += 1
    assert total == sum(math.prod(s) for s in shapes.values())
    if not cfg.experts:
        assert total == param_count(cfg.model_config())
    if seen is not None:
        assert all(bool((c == 1).all()) for c in seen.values())


@pytest.mark.parametrize("sizes, lo, hi, n", [((5, 7), 3, 30, 3), ((5, 7), 7, 21, 1),
                                              ((5, 7), 2, 5, 1), ((9,), 2, 8, 1), ((5, 7), 4, 4, 0)])
def test_a_flat_range_of_a_slice_is_at_most_three_boxes(sizes, lo, hi, n):
    t = torch.arange(math.prod(sizes)).view(sizes)
    boxes = boxes_of_range(sizes, lo, hi)
    assert len(boxes) == n
    got = torch.cat([t[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                     for off, size, _ in boxes]) if boxes else torch.zeros(0, dtype=t.dtype)
    assert torch.equal(got, torch.arange(lo, hi))
    assert [at for _, _, at in boxes] == [sum(math.prod(b[1]) for b in boxes[:i]) for i in range(n)]
