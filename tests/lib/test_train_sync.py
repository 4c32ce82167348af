"""The trainer's step waits for the device nowhere (issue 49.1): forward, backward, the
gradient reduction, clipping and the update make no host synchronisation, apart from the
data-parallel wrappers' NaN/inf verdict (`check_finite`), which decides whether the update
may run. On the CPU there is no asynchronous device, so the test counts what would be a sync
on a GPU: a device value read by Python (`.item()`, `.tolist()`, `bool`, `float`, `int`)
inside `picolib.train._train_step` — except torch AdamW's reads of its step counter, which
it keeps on the host on a GPU too (`capturable=False`). With CUDA, `torch.cuda.set_sync_debug_mode("error")`
makes the device itself refuse a sync (that variant skips on this CPU machine)."""
import traceback

import pytest
import torch

from picolib.launch import run
from picolib.train import TrainConfig

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


class CountReads:
    """Counts the values Python reads out of tensors while open; each read's stack says
    whether the wrappers' finiteness verdict made it."""

    def __init__(self):
        self.reads, self.verdicts = [], 0

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, self._counting(name, real))
        return self

    def __exit__(self, *_):
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, real)

    def _counting(self, name, real):
        def read(tensor, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            if stack[-1].name == "_get_value" and "optim" in stack[-1].filename:
                pass    # AdamW's step counter: a host tensor on every device (not capturable)
            elif any(f.name == "check_finite" or "bad.item()" in (f.line or "") for f in stack):
                self.verdicts += 1
            else:
                self.reads.append(f"{name} at {stack[-1].filename}:{stack[-1].lineno}")
            return real(tensor, *args, **kwargs)
        return read


def test_the_counter_sees_every_kind_of_read():
    t = torch.ones(2)
    with CountReads() as c:
        t.sum().item(), t.tolist(), bool(t[0]), float(t[0]), int(t[0])
    assert len(c.reads) == 5, c.reads


def _reads_per_step(cfg):
    import picolib.train as trainer
    real, counts = trainer._train_step, []

    def counted(*args, **kwargs):
        with CountReads() as c:
            out = real(*args, **kwargs)
        counts.append((c.reads, c.verdicts))
        return out
    trainer._train_step = counted
    trainer.train(cfg)
    return counts


LAYOUTS = {
    "one process, 2 micro-batches, clipping": (1, dict(micro_batches=2, clip_grad=0.5)),
    "dp2 ZeRO-1 × pp2 1F1B": (4, dict(dp=2, pp=2, zero=1, micro_batches=2, clip_grad=0.5)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_step_reads_no_device_value(name):
    nproc, options = LAYOUTS[name]
    cfg = TrainConfig(steps=2, progress=False, **options)
    for rank, steps in enumerate(run(_reads_per_step, nproc, cfg, timeout=240)):
        for reads, _ in steps:
            assert reads == [], f"rank {rank} read device values in a step: {reads}"


def _train_under_sync_errors(cfg):
    """Train with CUDA's sync-debug mode "error" inside every step, except inside the
    wrappers' `finish_gradient_sync` (their NaN/inf verdict waits for the device)."""
    import picolib.train as trainer
    from picolib.data_parallel import DistributedDataParallel as DataParallel
    real_step, real_finish = trainer._train_step, DataParallel.finish_gradient_sync

    def with_mode(fn, mode):
        def wrapped(*args, **kwargs):
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(mode)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(before)
        return wrapped
    trainer._train_step = with_mode(real_step, "error")
    DataParallel.finish_gradient_sync = with_mode(real_finish, "default")
    return trainer.train(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sync-debug mode is CUDA's")
def test_on_cuda_a_step_makes_no_sync():
    cfg = TrainConfig(steps=2, progress=False, micro_batches=2, clip_grad=0.5)
    records = run(_train_under_sync_errors, 1, cfg, backend="nccl", timeout=240)[0]
    assert len(records) == 2
