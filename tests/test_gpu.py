"""The CUDA/NCCL path. Runs only where CUDA is available; elsewhere every test here is
skipped, and says so. (The launcher's design — ranks forked from a clean server, never
from the caller — is tested on the CPU too, in test_launch.py.)"""
import pytest
import torch
import torch.distributed as dist

from picolib import launch
from picolib.launch import run
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig, TinyLlama, random_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the GPU tests need one")

# Counted saved-activation bytes against the CUDA allocator: they agreed within 1.3 % on an
# H100 for h >= 256 (fp32 and bf16); the rest is the allocator's rounding and the loss.
ALLOCATOR_RTOL = 0.013


def _nccl_one_rank():
    t = torch.full((4,), 2.0, device=launch.device())
    dist.all_reduce(t)
    c = torch.ones(2)  # a CPU tensor goes over gloo in the same group
    dist.all_reduce(c)
    return str(launch.device()), t.device.type, t.sum().item(), c.sum().item()


def test_one_rank_under_nccl():
    (dev, where, total, cpu_total), = run(_nccl_one_rank, 1, backend="nccl")
    assert dev == "cuda:0" and where == "cuda" and total == 8.0 and cpu_total == 2.0


def _train_step(cfg, tokens, targets):
    model = TinyLlama(cfg).to(launch.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model.loss(tokens.to(launch.device()), targets.to(launch.device()))
    loss.backward()
    opt.step()
    on_device = all(p.device == launch.device() for p in model.parameters())
    return loss.item(), {n: p.detach() for n, p in model.named_parameters()}, on_device


def test_a_training_step_on_cuda_in_a_rank_matches_the_cpu():
    # the caller trains first (backward and CUDA both touched): the rank must still work
    cfg = LlamaConfig(hidden=64, n_layers=2)
    tokens, targets = random_tokens(2, 32, cfg.vocab_size, seed=3)
    TinyLlama(cfg).cuda().loss(tokens.cuda(), targets.cuda()).backward()
    (loss, params, on_device), = run(_train_step, 1, cfg, tokens, targets)
    ref_loss, ref_params, _ = _train_step(cfg, tokens, targets)  # here: launch.device() is CPU
    assert on_device
    assert abs(loss - ref_loss) < 1e-4  # fp32 on two devices: summation order differs
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, atol=1e-5, rtol=1e-4)


def _gpu_seen():
    return torch.cuda.is_available(), torch.cuda.device_count()


def test_gloo_ranks_under_auto_do_not_see_the_gpu():
    n = torch.cuda.device_count() + 1  # more ranks than GPUs: auto picks gloo
    assert run(_gpu_seen, n) == [(False, 0)] * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [256, 512])
def test_counted_activation_bytes_match_the_cuda_allocator(dtype, hidden):
    cfg = LlamaConfig(hidden=hidden, n_heads=8, n_kv_heads=4, ffn_hidden=2 * hidden,
                      n_layers=2, vocab_size=1024, max_seq=256)
    model = TinyLlama(cfg).to("cuda", dtype)
    tokens, targets = (t.cuda() for t in random_tokens(4, 256, cfg.vocab_size, seed=0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with SavedActivations(model) as act:
        loss = model.loss(tokens, targets)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert act.bytes == pytest.approx(grown, rel=ALLOCATOR_RTOL)
    loss.backward()
