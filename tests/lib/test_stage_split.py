"""The one stage split (picolib.parallel_layout.stage_layers): uneven where the layers do not
divide, one layer fewer on the end stages first, as Llama 3 405B cuts 126 layers on 16
stages. The trainer builds such stages (`compose.build`: each a `model.part(...)`) and one
step on real gloo ranks gives the single-process loss and gradients: a 3-stage pipeline of 4
layers (1, 2, 1) alone, with two data-parallel replicas, and with tensor parallelism, and an
interleaved pipeline of 2 ranks × 3 chunks on 8 layers (1, 1, 2, 2, 1, 1). fp32; loss and
gradients within atol 1e-5 (the micro-batch and replica sums run in another order)."""
import pytest
import torch

from picolib.compose import TrainConfig, check_config
from picolib.launch import run
from picolib.model import TinyLlama, random_tokens
from picolib.parallel_layout import rank_stages, stage_layers, stage_ranges
from picolib.pipeline_parallel import partition

CASES = {
    "pp3": dict(pp=3, micro_batches=3, batch=6),
    "dp2 × pp3": dict(dp=2, pp=3, micro_batches=3, batch=12),
    "tp2 × pp3": dict(tp=2, pp=3, micro_batches=3, batch=6),
    "interleaved pp2 × 3 chunks": dict(preset="small", pp=2, schedule="interleaved", chunks=3,
                                       micro_batches=2, batch=4),
}


def test_the_split_is_uneven_at_the_ends_first():
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]         # Llama 3 405B (§3.3.2)
    assert stage_layers(126, 32) == [3] + [4] * 30 + [3]         # the same, 2 chunks a rank
    assert stage_layers(4, 3) == [1, 2, 1] and stage_layers(8, 6) == [1, 1, 2, 2, 1, 1]
    assert stage_layers(10, 4) == [2, 3, 3, 2] and stage_layers(80, 4) == [20] * 4
    assert partition(4, 3) == stage_ranges(4, 3) == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="4 layers cannot fill 5 stages"):
        stage_layers(4, 5)


def test_the_trainer_takes_uneven_stages_and_refuses_too_few_layers():
    cfg = TrainConfig(pp=3, micro_batches=3, batch=3)
    check_config(cfg, 3)
    assert [[(s, r) for s, r, _, _ in rank_stages(cfg, 4, p)] for p in range(3)] == \
        [[(0, range(0, 1))], [(1, range(1, 3))], [(2, range(3, 4))]]
    with pytest.raises(ValueError, match="n_layers=4 is fewer than the 6 pipeline stages"):
        check_config(TrainConfig(pp=3, schedule="interleaved", chunks=2, micro_batches=3, batch=3), 3)


def test_rank_stages_reads_the_schedule():
    """What a pipeline rank holds, counted by hand from the schedules' stage maps: interleaved
    puts stages r, r+p, ... on rank r; DualPipeV folds the 2p stages into a V (rank r: r and
    2p−1−r), so rank 0 holds both the embedding and the head."""
    from picolib.parallel_layout import Layout
    inter = Layout(pp=2, schedule="interleaved", chunks=3, micro_batches=2)   # 8 layers: 1,1,2,2,1,1
    assert rank_stages(inter, 8, 0) == [(0, range(0, 1), True, False), (2, range(2, 4), False, False),
                                        (4, range(6, 7), False, False)]
    assert rank_stages(inter, 8, 1) == [(1, range(1, 2), False, False), (3, range(4, 6), False, False),
                                        (5, range(7, 8), False, True)]
    v = Layout(pp=2, schedule="dualpipev", micro_batches=4)
    assert rank_stages(v, 4, 0) == [(0, range(0, 1), True, False), (3, range(3, 4), False, True)]
    assert rank_stages(v, 4, 1) == [(1, range(1, 2), False, False), (2, range(2, 3), False, False)]
    assert rank_stages(Layout(), 4, 0) == [(0, range(0, 4), True, True)]
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 2\), not 2"):
        rank_stages(v, 4, 2)


def _one_step(cfg):
    """The trainer's build and step on this rank; its loss and every gradient it holds, as
    (name in the one-process model, box offsets, box sizes, gradient)."""
    import torch.distributed as dist

    from picolib import train
    from picolib.compose import build
    from picolib.step import forward_backward
    from picolib.param_placement import placements
    from picolib.mesh import Mesh
    mesh = Mesh(**{d: getattr(cfg, d) for d in ("pp", "dp", "cp", "tp")})
    stages, wrappers, _, sched, _ = build(cfg, mesh)
    tokens, targets = train._batch(cfg, None, 0, mesh)
    loss = forward_backward(cfg, stages, wrappers, sched, mesh, tokens, targets, None)
    for w in wrappers.values():
        w.finish_gradient_sync()
    held = {s: dict(m.named_parameters()) for s, m in stages.items()}
    grads = [(p.name, p.offsets, p.sizes, held[p.stage][p.local].grad.clone())
             for p in placements(cfg, dist.get_rank())]
    return None if loss is None else float(loss), grads, {s: len(m.blocks) for s, m in stages.items()}


@pytest.mark.parametrize("name", CASES)
def test_uneven_stages_equal_one_process(name):
    cfg = TrainConfig(**CASES[name], seq=16, steps=1, data="random", progress=False)
    check_config(cfg)
    model = TinyLlama(cfg.model_config())
    tokens, targets = random_tokens(cfg.batch, cfg.seq, cfg.model_config().vocab_size, seed=0)
    loss = model.loss(tokens, targets)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    results = run(_one_step, cfg.world_size, cfg, timeout=120)
    layers = {}
    for _, _, blocks in results:
        layers.update(blocks)
    n_stages = cfg.pp * cfg.v
    assert [layers[s] for s in range(n_stages)] == stage_layers(cfg.model_config().n_layers, n_stages)
    losses = [r[0] for r in results if r[0] is not None]   # each last-stage rank: its replica's
    assert len(losses) == cfg.dp * cfg.tp and sum(losses) / len(losses) == pytest.approx(loss.item(), abs=1e-5)
    seen = set()
    for _, grads, _ in results:
        for n, offsets, sizes, grad in grads:
            box = reference[n][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            torch.testing.assert_close(grad, box, atol=1e-5, rtol=0, msg=f"{name}: {n}")
            seen.add(n)
    assert seen == set(reference)                # every parameter held and compared
