"""picolib.torch_compat: each wrapper of a private PyTorch API, called on this torch. `make
test-torch` runs this file under the oldest and newest torch picolib supports, so a release
that moves one of them fails here, by name, rather than somewhere inside a lesson."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from picolib import torch_compat
from picolib.launch import run


def _mesh_wrappers():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = torch_compat.flatten(mesh["dp", "tp"], "dp_tp")
    everyone = torch.ones(1)
    dist.all_reduce(everyone, group=flat.get_group())
    split = torch_compat.unflatten(mesh, "dp", 0, (1, 2), ("a", "b"))
    split_sizes = None if split is None else [split.size(i) for i in range(split.ndim)]
    return {"flat": flat.size(), "sum": everyone.item(), "split": split_sizes}


def test_flatten_and_unflatten_a_device_mesh():
    for out in run(_mesh_wrappers, 4, timeout=120):
        assert out["flat"] == 4 and out["sum"] == 4.0          # one group of all four ranks
        assert out["split"] in (None, [1, 2, 2])               # None: this torch has no _unflatten


def _local():
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    whole = torch.arange(8.0)
    d = distribute_tensor(whole, mesh, [Shard(0)])
    return torch_compat.local_tensor(d), torch_compat.local_tensor(whole)


def test_local_tensor_is_the_shard():
    for rank, (shard, plain) in enumerate(run(_local, 2, timeout=120)):
        assert torch.equal(shard, torch.arange(8.0)[4 * rank:4 * rank + 4])
        assert torch.equal(plain, torch.arange(8.0))


def test_fake_store_plays_a_rank_of_a_large_world():
    def rank_of_1024():
        dist.destroy_process_group()
        dist.init_process_group("fake", rank=5, world_size=1024, store=torch_compat.fake_store())
        t = torch.ones(3)
        dist.all_reduce(t)                     # returns at once, moves nothing
        return dist.get_world_size(), dist.get_rank()
    assert run(rank_of_1024, 1, timeout=120) == [(1024, 5)]


def test_current_autograd_node_and_dispatch_mode():
    seen = []

    class Record(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func._overloadpacket.__name__, torch_compat.current_autograd_node() is not None))
            return func(*args, **(kwargs or {}))

    w = torch.ones(3, requires_grad=True)
    with Record():
        (w * 2).sum().backward()
    assert ("mul", False) in seen                               # the forward: no node running
    assert any(node for _, node in seen)                        # the backward ran inside a node
    assert torch_compat.current_autograd_node() is None


def _ddp_buckets():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    for _ in range(2):
        ddp(torch.ones(2, 64)).sum().backward()
    return torch_compat.ddp_bucket_sizes(ddp)


def test_ddp_bucket_sizes_add_up_to_the_gradients():
    grads = 4 * sum(p.numel() for p in nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)).parameters())
    for sizes in run(_ddp_buckets, 2, timeout=120):
        assert sizes and sum(sizes) == grads                    # every gradient byte in some bucket


def test_scoped_library_undoes_its_registration():
    """A kernel registered in the block runs there, and the op's own kernel is back after."""
    x = torch.ones(2, 2)
    with torch_compat.scoped_library("aten", "IMPL") as lib:
        lib.impl("sub.Tensor", lambda a, b, alpha=1: a + b, "CPU")
        inside = (x - x).sum().item()
    assert inside == 8.0 and (x - x).sum().item() == 0.0


def test_inductor_metrics_count_the_kernels_one_compile_generates():
    metrics = torch_compat.inductor_metrics()
    metrics.reset()
    assert metrics.generated_kernel_count == 0
    x = torch.randn(64, 32)
    torch.compile(lambda t: (t * 2).relu().sum(-1))(x)
    assert metrics.generated_kernel_count >= 1
