"""The CUDA/NCCL path. Runs only where CUDA is available; elsewhere every test here is
skipped, and says so. (The launcher's design — ranks forked from a clean server, never
from the caller — is tested on the CPU too, in test_launch.py.)"""
import gc
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from picolib import launch
from picolib.launch import run
from picolib.compose import TrainConfig
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig, TinyLlama, random_tokens

ROOT = Path(__file__).resolve().parents[2]

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
    # a first step allocates cuBLAS's workspace through the allocator (33 MB seen on an H100),
    # and an earlier test's graph freed by the cycle collector mid-forward would shrink `grown`
    model.loss(tokens, targets).backward()
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with SavedActivations(model) as act:
        loss = model.loss(tokens, targets)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert act.bytes == pytest.approx(grown, rel=ALLOCATOR_RTOL)
    loss.backward()


# ---------------------------------------------------------------- every technique on CUDA tensors
# One GPU cannot host a multi-rank NCCL group, but gloo ranks can share it and reduce, gather,
# scatter and exchange CUDA tensors (gloo cannot send them point to point: picolib.comm stages
# those messages through CPU copies). Each layout trains a few steps on CUDA tensors and must
# follow the same layout's run on the CPU.

BASE = TrainConfig(steps=3, batch=8, seq=32, preset="tiny", data="random", progress=False,
                   lr=3e-3, clip_grad=0.5)
LAYOUTS = {
    "DDP dp2": dict(dp=2),
    "ZeRO-1 dp2": dict(dp=2, zero=1),
    "ZeRO-3 dp2": dict(dp=2, zero=3),
    "TP+SP tp2": dict(tp=2, sp=True),
    "CP ring cp2": dict(cp=2, cp_algorithm="ring"),
    "EP ep2 (all-to-all)": dict(dp=2, ep=2, experts=4, top_k=2),
    "PP 1f1b pp2 (sends through the CPU)": dict(pp=2, micro_batches=2),
    "PP interleaved pp2": dict(pp=2, micro_batches=4, schedule="interleaved", chunks=2),
    "dp2 tp2 pp2 sp ZeRO-1": dict(dp=2, tp=2, pp=2, sp=True, zero=1, micro_batches=2),
}


def _train_and_look(cfg):
    """Train, then say where every parameter and optimizer-state tensor of this rank lived."""
    import picolib.train as trainer
    built = []

    def keep(*args):
        built.append(trainer_build(*args))
        return built[-1]
    trainer_build, trainer.build = trainer.build, keep
    try:
        records = trainer.train(cfg)
    finally:
        trainer.build = trainer_build
    stages, wrappers, *_ = built[0]
    stages = stages.values() if isinstance(stages, dict) else stages
    where = {p.device.type for s in stages for p in s.parameters()}
    where |= {v.device.type for w in wrappers.values() for st in w.optimizer.state.values()
              for v in st.values() if torch.is_tensor(v) and v.dim()}
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], sorted(where)


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_technique_on_cuda_tensors_over_gloo_equals_the_cpu(name):
    cfg = replace(BASE, **LAYOUTS[name])
    gpu = run(_train_and_look, cfg.world_size, cfg, backend="gloo", device="cuda", timeout=240)
    cpu = run(_train_and_look, cfg.world_size, cfg, backend="gloo", timeout=240)
    assert all(where == ["cuda"] for *_, where in gpu), [w for *_, w in gpu]
    assert all(where == ["cpu"] for *_, where in cpu)
    (gpu_loss, gpu_norm, _), (cpu_loss, cpu_norm, _) = gpu[0], cpu[0]
    # fp32 on two devices: kernels sum in other orders; 3 AdamW steps keep it near 1e-5
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-4), (gpu_loss, cpu_loss)
    assert gpu_norm == pytest.approx(cpu_norm, rel=1e-3), (gpu_norm, cpu_norm)


# ---------------------------------------------------------------- the trainer on NCCL

def test_the_trainer_on_nccl_with_a_150m_model_reports_mfu(tmp_path):
    """`--nproc 1` on NCCL, the 150m preset in bf16 for a few steps: tokens/s and MFU against
    the H100's dense bf16 peak (989 TFLOP/s), written to the log."""
    log = tmp_path / "log.jsonl"
    argv = [sys.executable, "-m", "picolib.train", "--nproc", "1", "--backend", "nccl",
            "--preset", "150m", "--precision", "bf16", "--batch", "8", "--seq", "1024",
            "--steps", "8", "--data", "random", "--no-progress", "--log", str(log)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    last = records[-1]
    print(f"150m preset, bf16, 8 x 1024 tokens, {torch.cuda.get_device_name()}: "
          f"{last['tokens_per_s']:,.0f} tokens/s, MFU {last['mfu']:.3f}, loss {last['loss']:.3f}")
    (tmp_path.parent / "gpu_trainer.json").write_text(json.dumps(records))
    assert records[-1]["loss"] < records[0]["loss"]
    assert 0.05 < last["mfu"] < 1.0   # a real rate: not an idle GPU, not past the peak


# ---------------------------------------------------------------- a notebook's kernel, then ranks

def test_a_kernel_that_ran_backward_on_cuda_can_still_launch_ranks_that_train():
    """What a learner does: a cell trains on the GPU in the kernel (CUDA initialised, autograd's
    threads started), and a later cell launches ranks that train. Forked straight from the
    kernel they could not (torch refuses autograd and CUDA after fork); the fork server makes
    them."""
    import nbformat
    from nbclient import NotebookClient
    cells = [
        "import torch\nfrom picolib.model import LlamaConfig, TinyLlama, random_tokens\n"
        "cfg = LlamaConfig(hidden=64, n_layers=2)\n"
        "x, y = (t.cuda() for t in random_tokens(2, 32, cfg.vocab_size, seed=0))\n"
        "TinyLlama(cfg).cuda().loss(x, y).backward()",
        "from dataclasses import replace\nfrom picolib.compose import TrainConfig\n"
        "from picolib.launch import run\nfrom picolib.train import train\n"
        "cfg = TrainConfig(steps=2, dp=2, data='random', progress=False)\n"
        "gloo = run(train, 2, cfg, backend='gloo', device='cuda')\n"
        "nccl = run(train, 1, replace(cfg, dp=1), backend='nccl')\n"
        "print('losses', [r['loss'] for r in gloo[0]], [r['loss'] for r in nccl[0]])",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "losses" in text, nb.cells[1].outputs
