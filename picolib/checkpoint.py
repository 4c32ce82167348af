"""Checkpoints that any mesh can resume (lesson 10b), with `torch.distributed.checkpoint`.

What is saved is the *logical* state: the single-process model's parameters and AdamW state
under the single-process names (`blocks.5.attn.wq.weight`, not stage 1's `blocks.1...`;
expert 3, not some rank's local expert 1), with their whole shapes, and the step. So a
checkpoint written at dp2×tp2 resumes at tp4, pp2 or on one process.

Sharded: no rank ever builds a whole tensor. Each rank hands DCP only the boxes of the whole
tensors it answers for, read from where each parameter lives (`picolib.param_placement`): its tp
slices, its pipeline stages, its experts, and of what its data-parallel replicas share, its
own part (the wrapper's `holdings()`: its ZeRO shard; with DDP a 1/n slice of the replicated tensor);
a box held by several tp ranks (a norm, a KV head) is written by the first of them. A flat
ZeRO range of a 2-D slice is at most three boxes (`layout.boxes_of_range`). DCP writes every
element once, in parallel, each rank its own file, from views of the rank's own tensors
(one box copied at a time). Loading asks each rank's own boxes — the whole local tensors of a
DDP replica, the shard of a ZeRO rank — and DCP reads them out of whatever boxes were saved:
it reshards. They land straight in the built model's parameters, ZeRO's master shards and
the optimizer state; then ZeRO refreshes its compute copy (`Holdings.after_load`).

DTensor cannot describe ZeRO's flat ranges, and a ShardedTensor must list every rank's
shards; so a rank's boxes of one tensor are a small `_Boxes` object that speaks DCP's
checkpointable protocol (`__create_write_items__`, `__create_chunk_list__`), found by
planners that look up its boxes by offset.

Versions, and never losing a run. `save(root, ...)` writes `root/step-NNNNNN/` (the step the
run continues from): every rank writes into `root/.step-NNNNNN.tmp`, and once all ranks are
done rank 0 renames it — a rename is atomic, so a step folder exists only complete; a kill at
any moment leaves at worst a `.tmp` folder, which the next complete save removes. Then the oldest
complete folders beyond `keep` are renamed away and deleted. `latest(root)` is the newest
complete step (or `root` itself when it is a step folder); `check_resume` and `check_save`
refuse a folder that cannot work before any rank starts.
"""
from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .flat import STATE
from .param_placement import boxes_of_range, global_shapes, placements

__all__ = ["STATE", "save", "tidy", "load", "load_into", "latest", "step_folders", "check_resume",
           "check_save"]

KEYS = ("model",) + tuple(f"optim.{k}" for k in STATE)   # one whole tensor each, per parameter


class _Boxes:
    """This rank's boxes of one whole tensor of shape `shape`: [(offsets, tensor)]."""

    def __init__(self, shape):
        self.shape, self.boxes = torch.Size(shape), {}

    def add(self, offsets, tensor):
        self.boxes[torch.Size(offsets)] = tensor

    def size(self):
        return self.shape

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.shape))
                for off, t in self.boxes.items()]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.boxes.items()]

    def box(self, index: MetadataIndex):
        return self.boxes[torch.Size(index.offset)]


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        return obj.box(index) if isinstance(obj, _Boxes) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # DefaultLoadPlanner's set-up would turn the objects it does not know into None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        return obj.box(index) if isinstance(obj, _Boxes) else super().lookup_tensor(index)


def _state_dict(cfg, stages: dict, wrappers: dict, optimizers: list, own: bool):
    """({key: _Boxes} of this rank's boxes, Holdings per stage). `own`: only what this rank
    answers for (a save); else all it holds (a load)."""
    place = {(p.stage, p.local): p for p in placements(cfg, dist.get_rank())}
    sd, held = {}, {}
    for s in stages:
        held[s] = h = wrappers[s].holdings()
        for item in h.items:
            p = place[(s, item.name)]
            lo, hi = (item.own_lo, item.own_hi) if own else (item.lo, item.hi)
            if hi <= lo or (own and not p.first):
                continue
            flats = {"model": item.value, **{f"optim.{k}": item.state[k] for k in STATE}}
            for local, sizes, at in boxes_of_range(p.sizes, lo, hi):
                offsets = tuple(o + d for o, d in zip(p.offsets, local))
                start = lo - item.lo + at
                for key, flat in flats.items():
                    box = flat[start:start + math.prod(sizes)].view(sizes)
                    sd.setdefault(f"{key}.{p.name}", _Boxes(p.shape)).add(offsets, box)
    return sd, held


_STEP = re.compile(r"^step-(\d{6,})$")
_ALLOWED = re.compile(r"^(step-\d{6,}|\.step-\d{6,}\.tmp|\.old-step-\d{6,})$")


def step_folders(root) -> list[Path]:
    """The complete step folders of `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(path) -> Path | None:
    """The checkpoint to resume from: `path` itself when it is a step folder (it holds DCP's
    `.metadata`), else the newest complete `step-NNNNNN` inside it; None if there is none."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    steps = step_folders(path)
    return steps[-1] if steps else None


def check_save(root) -> None:
    """Refuse to save into a folder that holds something other than this trainer's steps."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--save {root}: it is a file, not a folder")
    if root.is_dir():
        other = sorted(p.name for p in root.iterdir() if not _ALLOWED.match(p.name))
        if other:
            shown = ", ".join(other[:5]) + (", …" if len(other) > 5 else "")
            raise ValueError(f"--save {root}: the folder holds other files ({shown}); checkpoints "
                             f"go into a new folder or one that holds only step-NNNNNN folders")


def _shapes(cfg) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the single-process model: of a TrainConfig (experts included) or of a
    LlamaConfig (dense)."""
    if hasattr(cfg, "model_config"):
        return global_shapes(cfg)
    from .model import TinyLlama
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in TinyLlama(cfg).named_parameters()}


def check_resume(path, cfg) -> Path:
    """The step folder to resume from, after checking that it exists, is complete and holds a
    model of `cfg`'s shapes (a TrainConfig, or a LlamaConfig; read from DCP's metadata, no
    tensor loaded)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not path.exists():
        raise ValueError(f"--resume {path}: no such folder")
    step = latest(path)
    if step is None:
        tmp = sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp")) if path.is_dir() else []
        why = f" (only incomplete saves: {', '.join(tmp)})" if tmp else ""
        raise ValueError(f"--resume {path}: no complete checkpoint in it{why}")
    try:
        saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable metadata means the same to the user
        raise ValueError(f"--resume {step}: its metadata cannot be read ({type(e).__name__}: {e})") from None
    shapes = _shapes(cfg)
    for name, shape in shapes.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise ValueError(f"--resume {step}: the checkpoint has no tensor {name!r}; "
                             f"was it written with another --preset or --experts?")
        if tuple(meta.size) != shape:
            raise ValueError(f"--resume {step}: {name} is {tuple(meta.size)} in the checkpoint "
                             f"but {shape} in this model; was it written with another --preset?")
    extra = sorted(k[6:] for k in saved if k.startswith("model.") and k[6:] not in shapes)
    if extra:
        raise ValueError(f"--resume {step}: the checkpoint holds tensors this model lacks "
                         f"({', '.join(extra[:3])}); was it written with another --preset or --experts?")
    return step


def _sync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root, cfg, stages: dict, wrappers: dict, optimizers: list, next_step: int,
         keep: int = 2, data_position: int | None = None) -> Path:
    """Write the logical state of all ranks' stages as `root/step-NNNNNN` (every rank calls
    it; each writes only the boxes it answers for), atomically, then keep only the newest
    `keep` step folders. `cfg`: the TrainConfig the ranks run. `data_position`: where the
    run is in its data — the index of the next global batch the data gives
    (`picolib.data.TokenData.batch_for_rank`'s step; default `next_step`). Returns the folder."""
    root = Path(root)
    final, tmp = root / f"step-{next_step:06d}", root / f".step-{next_step:06d}.tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():                       # a save killed before it finished
            shutil.rmtree(tmp)
    dist.barrier()
    sd, held = _state_dict(cfg, stages, wrappers, optimizers, own=True)
    sd["optim.step"] = torch.tensor(next(iter(held.values())).step)
    sd["next_step"] = torch.tensor(next_step)
    sd["data.position"] = torch.tensor(next_step if data_position is None else data_position)
    dcp.save(sd, checkpoint_id=str(tmp), planner=_SavePlanner())   # DCP fsyncs each file
    dist.barrier()                             # every rank's files are complete
    if rank0:
        if final.exists():                     # the same step saved again: replace it
            old = root / f".old-step-{next_step:06d}"
            final.rename(old)
            shutil.rmtree(old)
        tmp.rename(final)
        _sync_folder(root)
        for stale in step_folders(root)[:-keep] if keep > 0 else []:
            gone = root / f".old-{stale.name}"
            stale.rename(gone)                 # never a half-deleted step-NNNNNN
            shutil.rmtree(gone)
        tidy(root)
    dist.barrier()
    return final


def tidy(root) -> None:
    """Remove what a killed save or deletion left in `root` (`.step-N.tmp`, `.old-step-N`):
    never a step folder. The trainer's rank 0 calls it after each save and once at the start
    of a run that saves there, so a run killed during its last save's pruning, resumed with
    nothing left to train, still leaves only step folders."""
    for left in [*Path(root).glob(".old-step-*"), *Path(root).glob(".step-*.tmp")]:
        shutil.rmtree(left, ignore_errors=True)


def load_into(path, cfg, stages: dict, wrappers: dict, optimizers: list,
              into: dict | None = None) -> int:
    """Read a checkpoint (written on any mesh) straight into this rank's built stages, their
    data-parallel wrappers and optimizers — each rank reads only the boxes it holds — and
    return the step to continue from. Every rank calls it. `into`: a dict that receives
    "data_position", where the run was in its data (a checkpoint written before positions
    were saved: the step)."""
    sd, held = _state_dict(cfg, stages, wrappers, optimizers, own=False)
    sd["optim.step"], sd["next_step"] = torch.tensor(0), torch.tensor(0)
    has_position = "data.position" in _saved_keys(path)
    if has_position:
        sd["data.position"] = torch.tensor(0)
    dcp.load(sd, checkpoint_id=str(path), planner=_LoadPlanner())
    for h in held.values():
        h.step = int(sd["optim.step"])
        h.after_load()
    if into is not None:
        into["data_position"] = int(sd["data.position" if has_position else "next_step"])
    return int(sd["next_step"])


def _saved_keys(path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load(path, cfg, names: list[str] | None = None) -> tuple[dict, dict, int, int]:
    """Read a checkpoint into whole tensors, on one process (to look at it, or to generate
    from it): (params, {state key: tensors}, optimizer step, next data step), for the
    parameters `names` (default: all of the model of `cfg`, a TrainConfig or LlamaConfig)."""
    shapes = _shapes(cfg)
    names = list(shapes) if names is None else names
    sd = {f"model.{n}": torch.empty(shapes[n]) for n in names}
    sd.update({f"optim.{k}.{n}": torch.empty(shapes[n]) for k in STATE for n in names})
    sd["optim.step"], sd["next_step"] = torch.tensor(0), torch.tensor(0)
    dcp.load(sd, checkpoint_id=str(path))
    params = {n: sd[f"model.{n}"] for n in names}
    state = {k: {n: sd[f"optim.{k}.{n}"] for n in names} for k in STATE}
    return params, state, int(sd["optim.step"]), int(sd["next_step"])
