"""One MFU convention (issue 49.4): `picolib.plan_search.model_flops_per_token` against an
independent count — torch's FlopCounterMode over a real forward and backward — and the
trainer's logged MFU against the planner's predicted MFU for the same configuration.

FlopCounterMode counts matmul FLOPs only (and knows no causal mask: it sees the whole s × s
square of eager attention), so it is compared with the whole-square count (`causal=False`);
the convention also counts each norm weight as a parameter (6 FLOPs per token each, (2L + 1)·h
of them), which the counter, seeing no matmul there, leaves out: exactly that difference is
the tolerance, nothing else."""
import pytest
from torch.utils.flop_counter import FlopCounterMode

from picolib.hardware import hardware
from picolib.launch import run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.moe import apply_moe
from picolib.plan_search import model_flops_per_token, step_time
from picolib.planner import MoEShape, Parallelism
from picolib.train import TrainConfig, train

CFG = LlamaConfig(vocab_size=96, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                  max_seq=16, attn_impl="eager")


@pytest.mark.parametrize("moe", [None, MoEShape(4, 2, 64)], ids=["dense", "moe 4 experts top-2"])
def test_convention_counts_what_torch_counts_in_a_step(moe):
    b, s = 3, 16
    model = TinyLlama(CFG)
    if moe is not None:
        apply_moe(model, n_experts=moe.n_experts, top_k=moe.top_k)
    x, y = random_tokens(b, s, CFG.vocab_size, seed=0)
    with FlopCounterMode(display=False) as counter:
        model.loss(x, y).backward()
    norms = 6 * (2 * CFG.n_layers + 1) * CFG.hidden
    ours = (model_flops_per_token(CFG, s, moe, causal=False) - norms) * b * s
    assert counter.get_total_flops() == pytest.approx(ours, rel=1e-12)


def _train(cfgs):
    return [train(cfg)[0] for cfg in cfgs]


def test_trainer_logs_the_mfu_the_planner_predicts_for_its_step_time():
    """Same configuration, same peak (the planner's H100 fp32 peak given to the trainer):
    MFU × seconds × ranks — the model FLOPs over the peak — is the same number on both."""
    peak = hardware("H100-SXM").peak("fp32")
    configs = [TrainConfig(steps=1, progress=False, data="random", batch=4, seq=16, dp=2,
                           peak_tflops=peak / 1e12, **kw)
               for kw in (dict(), dict(experts=4, top_k=2, ep=2), dict(recompute="full"))]
    for cfg, rec in zip(configs, run(_train, 2, configs, timeout=240)[0]):
        par = Parallelism.of(cfg, activations="picolib", flash=False)   # the trainer's layout as it is
        planned = step_time(cfg.model_config(), par, "H100-SXM")
        assert rec["mfu"] * rec["seconds"] * cfg.world_size == pytest.approx(
            planned["mfu"] * planned["seconds"] * par.n_gpus, rel=1e-9), cfg
        assert rec["hfu"] == pytest.approx(rec["mfu"] * (4 / 3 if cfg.recompute == "full" else 1), rel=1e-12)
