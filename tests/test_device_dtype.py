"""Library code creates tensors on the device and dtype of the model it works on, never
implicitly on the CPU in fp32. On this CPU the device cannot differ, so the test moves the
tiny Llama to float64: a shard, a norm or a receive buffer made in fp32 would show as a
dtype mismatch, or as a loss that agrees with the float64 reference only to fp32 precision
(atol 1e-10 here; fp32 would be off by ~1e-7). tests/test_gpu.py does the same on CUDA."""
import pytest
import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.pipeline_parallel import build_stages, run_schedule, stage_grads
from picolib.pipeline_schedules import make_schedule
from picolib.sequence_parallel import SPLlama
from picolib.tensor_parallel import TPLlama

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
ATOL = 1e-10


def _reference_loss():
    tokens, targets = random_tokens(2, 8, CFG.vocab_size, seed=5)
    return TinyLlama(CFG).double().loss(tokens, targets).item(), tokens, targets


def _tensor_parallel(kind, tokens, targets):
    wrap = {"tp": TPLlama, "sp": SPLlama}[kind]
    model = wrap(TinyLlama(CFG).double())
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.item(), {p.dtype for p in model.parameters()}, {p.grad.dtype for p in model.parameters()}


@pytest.mark.parametrize("kind", ["tp", "sp"])
def test_tensor_and_sequence_parallel_keep_float64(kind):
    ref, tokens, targets = _reference_loss()
    for loss, dtypes, grad_dtypes in run(_tensor_parallel, 2, kind, tokens, targets):
        assert dtypes == grad_dtypes == {torch.float64}
        assert abs(loss - ref) < ATOL


def _pipeline(tokens, targets):
    sched = make_schedule("1f1b", 2, 2)
    model = TinyLlama(CFG).double()
    stages = build_stages(model, sched.n_stages)
    mine = {s: stages[s] for s in sched.stages_of(dist.get_rank())}
    out = run_schedule(sched, mine, list(tokens.chunk(2)), list(targets.chunk(2)))
    grads = {k: g for st in mine.values() for k, g in stage_grads(st, model).items()}
    return out["loss"], {g.dtype for g in grads.values()}


def test_pipeline_receive_buffers_follow_the_model_dtype():
    ref, tokens, targets = _reference_loss()
    results = run(_pipeline, 2, tokens, targets)
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == 1 and abs(float(losses[0]) - ref) < ATOL
    assert all(dtypes == {torch.float64} for _, dtypes in results)
