"""Library code creates tensors on the device and dtype of the model it works on, never
implicitly on the CPU in fp32. On this CPU the device cannot differ, so the test moves the
tiny Llama to float64: a shard, a norm or a receive buffer made in fp32 would show as a
dtype mismatch, or as a loss that agrees with the float64 reference only to fp32 precision
(atol 1e-10 here; fp32 would be off by ~1e-7). tests/lib/test_gpu.py does the same on CUDA."""
import pytest
import torch
import torch.distributed as dist

from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.pipeline_parallel import split_stages, run_schedule, stage_grads
from picolib.pipeline_schedules import make_schedule
from picolib.tensor_parallel import apply_tensor_parallel

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
ATOL = 1e-10


def _reference_loss():
    tokens, targets = random_tokens(2, 8, CFG.vocab_size, seed=5)
    return TinyLlama(CFG).double().loss(tokens, targets).item(), tokens, targets


def _tensor_parallel(kind, tokens, targets):
    model = apply_tensor_parallel(TinyLlama(CFG).double(), sequence_parallel=kind == "sp")
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
    stages = split_stages(model, sched.n_stages)
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


def _pipeline_sp(tokens, targets):
    """tp2 × pp2 with sequence parallelism: the stages send (b, s/tp, h) float64 messages."""
    from picolib.mesh import Mesh
    from picolib.tensor_parallel import apply_tensor_parallel
    mesh = Mesh(pp=2, tp=2)
    pp = mesh.coordinate("pp")
    model = apply_tensor_parallel(TinyLlama(CFG).double(), mesh, sequence_parallel=True)
    stage = split_stages(model, 2)[pp]
    out = run_schedule(make_schedule("1f1b", 2, 2), {pp: stage}, list(tokens.chunk(2)),
                       list(targets.chunk(2)), group_ranks=mesh.peers("pp"))
    return out["loss"], stage.hidden_shape(*tokens.chunk(2)[0].shape), {
        p.grad.dtype for p in stage.parameters()}


def test_pipeline_of_a_sequence_parallel_model_keeps_float64_and_sends_s_over_tp():
    ref, tokens, targets = _reference_loss()
    results = run(_pipeline_sp, 4, tokens, targets)
    losses = [float(loss) for loss, _, _ in results if loss is not None]
    assert len(losses) == 2 and all(abs(loss - ref) < ATOL for loss in losses)
    for _, shape, dtypes in results:
        assert shape == (1, tokens.shape[1] // 2, CFG.hidden) and dtypes == {torch.float64}
