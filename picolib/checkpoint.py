"""Checkpoints that any mesh can resume (lesson 10), with `torch.distributed.checkpoint`.

What is saved is the *logical* state: the single-process model's parameters and AdamW state,
under the single-process names (`blocks.5.attn.wq.weight`, not stage 1's `blocks.1...`),
whole tensors, and the step. So a checkpoint written at dp2×tp2 resumes at tp4, pp2 or on one
process: resuming builds the whole model from it and applies the same transforms as a fresh
start, which cut out each rank's slice (`apply_tensor_parallel` shards a whole model). The
optimizer state is cut the same way: a model whose weights are the state, transformed alike.

Saving is a collective. A rank turns what it holds into whole tensors — ZeRO's flat shards
all-gathered over the replicas, tensor-parallel slices all-gathered over tp (a KV head held
by several tp ranks once) — and hands them to `dcp.save`; DCP writes every tensor once,
from one of the ranks that hold it, each rank its own file. Pipeline stages hold different
tensors, so they write different parts. At the sizes of these lessons the whole tensors fit
on a rank; a production checkpoint keeps the shards as DTensors instead and lets DCP reshard.

Versions, and never losing a run. `save(root, ...)` writes `root/step-NNNNNN/` (the step the
run continues from): every rank writes into `root/.step-NNNNNN.tmp`, and once all ranks are
done rank 0 renames it — a rename is atomic, so a step folder exists only complete; a kill at
any moment leaves at worst a `.tmp` folder, which the next save removes. Then the oldest
complete folders beyond `keep` are renamed away and deleted. `latest(root)` is the newest
complete step (or `root` itself when it is a step folder); `check_resume` and `check_save`
refuse a folder that cannot work before any rank starts.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .mappings import gather_along
from .tensor_parallel import ColumnParallelLinear, ParallelAttention, RowParallelLinear
from .vocab_parallel import VocabParallelEmbedding

__all__ = ["STATE", "save", "load", "global_name", "latest", "step_folders", "check_resume",
           "check_save"]

STATE = ("exp_avg", "exp_avg_sq")   # AdamW's state per parameter (and its step count)


def global_name(stage, name: str) -> str:
    """A stage's parameter name in the whole model: its block i is the model's block layers[i]."""
    return re.sub(r"^blocks\.(\d+)\.", lambda m: f"blocks.{stage.layers[int(m.group(1))]}.", name)


def _tp_layouts(stage) -> dict[str, tuple[int, int, object]]:
    """{parameter name: (dim, replicas, group)} for the tensor-parallel slices of `stage`."""
    out = {}
    for mname, m in stage.named_modules():
        prefix = mname + "." if mname else ""
        if isinstance(m, ColumnParallelLinear | VocabParallelEmbedding):
            out[prefix + "weight"] = (0, 1, m.group)
            if getattr(m, "bias", None) is not None and isinstance(m, ColumnParallelLinear):
                out[prefix + "bias"] = (0, 1, m.group)
        elif isinstance(m, RowParallelLinear):
            out[prefix + "weight"] = (1, 1, m.group)
        if isinstance(m, ParallelAttention) and m.replicas > 1:   # KV heads held by `replicas` ranks
            for lin in ("wk", "wv"):
                for p in ("weight", "bias"):
                    if prefix + f"{lin}.{p}" in out:
                        out[prefix + f"{lin}.{p}"] = (0, m.replicas, m.group)
    return out


def _whole(t: torch.Tensor, layout) -> torch.Tensor:
    if layout is None:
        return t.detach().clone()
    dim, replicas, group = layout
    whole = gather_along(t.detach().contiguous(), dim, group)
    return torch.cat(whole.chunk(dist.get_world_size(group), dim)[::replicas], dim)


def _zero_flat(wrapper, key: str | None) -> dict[str, torch.Tensor]:
    """{name: tensor} of a ZeRO wrapper's masters (key None) or optimizer state `key`,
    all-gathered from the shards (a collective over its group)."""
    return {n: t for u in wrapper.units
            for n, t in u.gather(u.master if key is None else u.state[key], wrapper.group).items()}


def _local_state(stage, wrapper, optimizer, zero: bool) -> tuple[dict, dict, int]:
    """(params, {state key: tensors}, step) of one stage, by its local names, as held here:
    through the data-parallel contract (`wrapper.state_dict()`, whole tensors by name; ZeRO
    gathers its shards), whichever wrapper it is (`optimizer`, `zero`: unused)."""
    sd = wrapper.state_dict()
    names = [n for n, p in stage.named_parameters() if p.requires_grad]
    params = {n: sd["model"][n] for n in names}
    optim = sd["optimizer"]["state"]
    state = {k: {n: optim[n][k] if k in optim.get(n, {}) else torch.zeros_like(params[n])
                 for n in names} for k in STATE}
    step = max((int(s["step"]) for s in optim.values() if "step" in s), default=0)
    return params, state, step


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


def check_resume(path, model_cfg) -> Path:
    """The step folder to resume from, after checking that it exists, is complete and holds a
    model of `model_cfg`'s shapes (read from DCP's metadata, no tensor loaded)."""
    from torch.distributed.checkpoint import FileSystemReader

    from .model import TinyLlama
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
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in TinyLlama(model_cfg).named_parameters()}
    for name, shape in shapes.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise ValueError(f"--resume {step}: the checkpoint has no tensor {name!r}; "
                             f"was it written with another --preset?")
        if tuple(meta.size) != shape:
            raise ValueError(f"--resume {step}: {name} is {tuple(meta.size)} in the checkpoint "
                             f"but {shape} in this model; was it written with another --preset?")
    extra = sorted(k[6:] for k in saved if k.startswith("model.") and k[6:] not in shapes)
    if extra:
        raise ValueError(f"--resume {step}: the checkpoint holds tensors this model lacks "
                         f"({', '.join(extra[:3])}); was it written with another --preset?")
    return step


def _sync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root, stages: dict, wrappers: dict, optimizers: list, zero: bool, next_step: int,
         keep: int = 2) -> Path:
    """Write the logical state of all ranks' stages as `root/step-NNNNNN` (every rank calls
    it), atomically, then keep only the newest `keep` step folders. Returns the folder."""
    root = Path(root)
    final, tmp = root / f"step-{next_step:06d}", root / f".step-{next_step:06d}.tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():                       # a save killed before it finished
            shutil.rmtree(tmp)
    dist.barrier()
    sd = {}
    for s, stage in stages.items():
        params, state, step = _local_state(stage, wrappers[s], optimizers[0] if not zero else None, zero)
        layouts = _tp_layouts(stage)
        for name, t in params.items():
            g = global_name(stage, name)
            sd[f"model.{g}"] = _whole(t, layouts.get(name)).float()
            for k in STATE:
                sd[f"optim.{k}.{g}"] = _whole(state[k][name], layouts.get(name)).float()
    sd["optim.step"] = torch.tensor(step)
    sd["next_step"] = torch.tensor(next_step)
    dcp.save(sd, checkpoint_id=str(tmp))     # DCP fsyncs each file it writes
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
        for left in root.glob(".old-step-*"):  # deletions a kill interrupted
            shutil.rmtree(left, ignore_errors=True)
    dist.barrier()
    return final


def load(path, model_cfg, names: list[str] | None = None) -> tuple[dict, dict, int, int]:
    """Read a checkpoint into whole tensors: (params, {state key: tensors}, optimizer step,
    next data step), for the parameters `names` (default: all of a TinyLlama of `model_cfg`)."""
    from .model import TinyLlama
    shapes = {n: p.shape for n, p in TinyLlama(model_cfg).named_parameters()}
    names = list(shapes) if names is None else names
    sd = {f"model.{n}": torch.empty(shapes[n]) for n in names}
    sd.update({f"optim.{k}.{n}": torch.empty(shapes[n]) for k in STATE for n in names})
    sd["optim.step"], sd["next_step"] = torch.tensor(0), torch.tensor(0)
    dcp.load(sd, checkpoint_id=str(path))
    params = {n: sd[f"model.{n}"] for n in names}
    state = {k: {n: sd[f"optim.{k}.{n}"] for n in names} for k in STATE}
    return params, state, int(sd["optim.step"]), int(sd["next_step"])
