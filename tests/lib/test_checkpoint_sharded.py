"""Sharded checkpoints (picolib/checkpoint.py): every rank hands DCP only the boxes it answers
for, so a save allocates no whole tensor — each rank's extra peak during a save on 8 ranks is
measured (every tensor created during it, the clones DCP makes included, plus Python's own
allocations) and bounded by the state that rank writes; DCP's plan validation checks at every
save that the boxes tile each whole tensor with no overlap. Loading reshards: a checkpoint
resumes on other meshes, ZeRO stages and ep sizes and continues the one-process curve."""
import math
import tracemalloc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from picolib import checkpoint
from picolib.compose import TrainConfig, build, check_config
from picolib.launch import run
from picolib.param_placement import placements
from picolib.mesh import Mesh
from picolib.train import train

STEPS = 6


def _losses(nproc, **options):
    cfg = TrainConfig(**{"steps": STEPS, "progress": False, **options})
    check_config(cfg, nproc)
    return [r["loss"] for r in run(train, nproc, cfg, timeout=240)[0]]


def _close(got, want, tol=2e-5):
    return max(abs(a - b) for a, b in zip(got, want, strict=True)) <= tol


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The one-process curve, and a checkpoint of step 3 written at dp2×tp2 ZeRO-1."""
    ckpt = tmp_path_factory.mktemp("dense") / "ckpt"
    first = _losses(4, dp=2, tp=2, zero=1, micro_batches=2, steps=3, save=str(ckpt))
    want = _losses(1, micro_batches=2)
    assert _close(first, want[:3])
    return ckpt, want


@pytest.mark.parametrize("nproc, options", [
    (4, dict(tp=4)), (4, dict(pp=2, tp=2)), (1, {}), (2, dict(dp=2, zero=3)),
    (4, dict(dp=4, zero=2)), (4, dict(pp=2, dp=2, zero=1, schedule="interleaved")),
], ids=["tp4", "pp2×tp2", "one process", "dp2 ZeRO-3", "dp4 ZeRO-2", "pp2×dp2 interleaved ZeRO-1"])
def test_resume_on_another_mesh_continues_the_curve(dense, nproc, options):
    ckpt, want = dense
    rest = _losses(nproc, micro_batches=2, resume=str(ckpt), **options)
    assert _close(rest, want[3:]), (rest, want)


MOE = dict(experts=4, top_k=2)


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """The one-process MoE curve, and a checkpoint of step 3 written at dp4 ep2."""
    ckpt = tmp_path_factory.mktemp("experts") / "ckpt"
    want = _losses(1, micro_batches=4, **MOE)
    first = _losses(4, dp=4, ep=2, steps=3, save=str(ckpt), **MOE)
    assert _close(first, want[:3])
    return ckpt, want


@pytest.mark.parametrize("nproc, options", [
    (4, dict(dp=4, ep=4)), (4, dict(dp=4, ep=1, zero=1)), (1, dict(micro_batches=4)),
    (8, dict(dp=4, tp=2, ep=2, zero=2)),
], ids=["dp4 ep4", "dp4 ep1 ZeRO-1", "one process", "dp4×tp2 ep2 ZeRO-2"])
def test_experts_are_saved_and_resumed_at_any_ep(experts, nproc, options):
    """Saved at dp4 ep2 (each rank's micro-batch one token group): every resumed layout with
    the same four token groups per step continues the one-process curve."""
    ckpt, want = experts
    rest = _losses(nproc, resume=str(ckpt), **MOE, **options)
    assert _close(rest, want[3:]), (rest, want)


class _TensorBytes(TorchDispatchMode):
    """Bytes of the tensors created while active and still alive, and their peak (each
    storage once; a storage is freed when the last tensor created on it is gone)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self._refs = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and \
                    t.untyped_storage().data_ptr() not in inputs:      # not a view, not in place
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key not in self.live:
                    self.live[key] = [0, nbytes]
                    self.now += nbytes
                    self.peak = max(self.peak, self.now)
                self.live[key][0] += 1
                self._refs.append(weakref.ref(t, lambda r, key=key: self._gone(key)))
        return out

    def _gone(self, key):
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[key]
                self.now -= entry[1]


def _save_and_measure(cfg, folder):
    mesh = Mesh("cpu", **{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    stages, wrappers, optimizers, *_ = build(cfg, mesh)
    for s, m in stages.items():                      # gradients and optimizer state to save
        for p in m.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    for opt in optimizers:
        opt.step()
    held = {s: wrappers[s].holdings() for s in stages}
    place = {(p.stage, p.local): p for p in placements(cfg, dist.get_rank())}
    own = sum((h.own_hi - h.own_lo) * 4 * 3 for s, hs in held.items() for h in hs.items
              if place[(s, h.name)].first)          # fp32 values, exp_avg, exp_avg_sq
    largest = max(math.prod(p.sizes) * 4 for p in place.values())
    checkpoint.save(folder, cfg, stages, wrappers, optimizers, 1)   # DCP's imports, caches
    dist.barrier()
    tracemalloc.start()
    with _TensorBytes() as tensors:
        checkpoint.save(folder, cfg, stages, wrappers, optimizers, 2)
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mine = sum(f.stat().st_size for f in (folder / "step-000002").glob(f"__{dist.get_rank()}_*"))
    return dict(tensors=tensors.peak, python=python_peak, own=own, largest=largest, file=mine)


def test_a_save_on_8_ranks_allocates_no_more_than_the_rank_writes(tmp_path):
    """dp2×pp2×tp2 ZeRO-1, the base preset (6.4 M parameters), the second save (the first
    imports and caches). Per rank, measured: the tensors created during the save peak at no
    more than the state it writes plus one box (DCP copies each box out of its view and keeps
    the copies until the rank's file is closed), and Python's own allocations (DCP's plans and
    metadata; rank 0 gathers every rank's) stay under 4 MiB — they grow with the number of
    boxes, not their bytes. Together far below the stage's whole tensors, which a save that
    gathered them would hold."""
    cfg = TrainConfig(preset="base", dp=2, pp=2, tp=2, zero=1, micro_batches=2, progress=False)
    check_config(cfg, 8)
    got = run(_save_and_measure, 8, cfg, tmp_path / "ckpt", timeout=300)
    whole_stage = sum(math.prod(s) for s in
                      {p.name: p.shape for p in placements(cfg, 0)}.values()) * 4 * 3
    for rank, m in enumerate(got):
        assert m["own"] > 0 and m["file"] >= m["own"], (rank, m)       # it wrote its part
        assert m["tensors"] <= m["own"] + m["largest"], (rank, m)
        assert m["python"] <= 4 * 2 ** 20, (rank, m)
        assert m["tensors"] + m["python"] < whole_stage / 2, (rank, m, whole_stage)
    assert sum(m["own"] for m in got) == sum(
        math.prod(s) for s in checkpoint._shapes(cfg).values()) * 4 * 3   # every element once


@pytest.mark.parametrize("zero", [1, 0], ids=["ZeRO-1", "DDP"])
def test_bf16_compute_copies_are_refreshed_from_the_loaded_fp32_masters(tmp_path, zero):
    """bf16 compute (ZeRO and DDP) keeps fp32 masters apart from the bf16 parameters: a
    resume loads the masters and remakes the bf16 copies from them (`Holdings.after_load`)."""
    options = dict(dp=2, zero=zero, precision="bf16", micro_batches=2)
    straight = _losses(2, **options)
    _losses(2, **options, steps=3, save=str(tmp_path / "ckpt"))
    rest = _losses(2, **options, resume=str(tmp_path / "ckpt"))
    assert _close(rest, straight[3:], 1e-6), (rest, straight)
