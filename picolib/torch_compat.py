"""Every private PyTorch API picolib relies on, in one place, across torch 2.6 to 2.15.

A name with a leading underscore may change in any release. picolib uses a few where torch has
no public way yet: flattening or splitting a `DeviceMesh`'s dimensions, the fake process group
the dry run prices 70B layouts on, a `DTensor`'s local shard, the autograd node running now,
the dispatch mode that sees every op, DDP's own bucket log, and a kernel registration undone
when a block ends. Each is wrapped here, so a
release that moves one breaks one function, and `tests/lib/test_torch_compat.py` (run under
the oldest and newest supported torch by `make test-torch`) calls every wrapper.
"""
from __future__ import annotations

import torch

__all__ = ["flatten", "unflatten", "fake_store", "local_tensor", "current_autograd_node",
           "TorchDispatchMode", "ddp_bucket_sizes", "scoped_library", "inductor_metrics"]

from torch.utils._python_dispatch import TorchDispatchMode   # public name in no release yet


def flatten(device_mesh, name: str):
    """One dimension made of the dimensions of `device_mesh` (a slice such as mesh["dp", "cp"]),
    with its own process group (`DeviceMesh._flatten`, torch ≥ 2.6). Collective: every rank
    calls it, in the same order."""
    return device_mesh._flatten(name)


def unflatten(device_mesh, dim: str, index: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    """`device_mesh` with dimension `dim` (at `index`) split into `names` of `sizes`, reusing the
    mesh's backend (`DeviceMesh._unflatten`: torch 2.11 takes the index, 2.13 the name); None
    where this torch has no such method or refuses, so the caller builds a new mesh."""
    if not hasattr(device_mesh, "_unflatten"):
        return None
    for which in (dim, index):
        try:
            return device_mesh._unflatten(which, sizes, names)
        except (ValueError, TypeError):       # refused before any group is made
            pass
    return None


def inductor_metrics():
    """Inductor's counters (`torch._inductor.metrics`: `reset()`, `generated_kernel_count`), the
    kernels one `torch.compile` generated (lesson 12's fusion)."""
    import torch._inductor.metrics as metrics
    return metrics


def fake_store():
    """The store of the "fake" process group, whose collectives return at once without moving a
    byte (torch's own test utility): one process plays a rank of any world size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (`DTensor._local_tensor`, without the autograd edge that
    `to_local()` adds); any other tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


def current_autograd_node():
    """The autograd node whose backward is running now, or None in a forward."""
    return torch._C._current_autograd_node()


def ddp_bucket_sizes(ddp) -> list[int]:
    """The bucket sizes in bytes that PyTorch's `DistributedDataParallel` logged after its first
    iteration (`_get_ddp_logging_data`: the bytes, comma-separated)."""
    logged = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return [int(x) for x in str(logged).split(",") if x.strip()]


def scoped_library(ns: str, kind: str):
    """A context manager giving a `torch.library.Library(ns, kind)` whose registrations are
    undone when the block ends (`torch.library._scoped_library`, what torch's own tests use;
    a plain Library's stay until the object is collected)."""
    return torch.library._scoped_library(ns, kind)
