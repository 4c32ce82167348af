"""The pipeline's one gradient path: every gradient — also the split backward's B (norms)
and W (weights) — arrives through autograd, so a hook that watches gradients arrive (what
DDP and ZeRO build on) sees each parameter exactly as often as one process would; and the
inputs of the executor are checked before any op runs."""
import pytest
import torch.distributed as dist

from picolib.launch import WorkerError, run
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.pipeline_parallel import split_stages, run_schedule
from picolib.pipeline_schedules import make_schedule

CFG = LlamaConfig(hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq=16)


def _hook_counts(name, m, v=1, stages_built=None):
    sched = make_schedule(name, 2, m, v)
    model = TinyLlama(CFG)
    stages = split_stages(model, stages_built or sched.n_stages)
    mine = {s: stages[s] for s in sched.stages_of(dist.get_rank())}
    counts = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for st in mine.values():
        for p in st.parameters():
            p.register_post_accumulate_grad_hook(
                lambda q: counts.__setitem__(names[id(q)], counts.get(names[id(q)], 0) + 1))
    tokens, targets = random_tokens(2 * m, 8, CFG.vocab_size, seed=1)
    run_schedule(sched, mine, list(tokens.chunk(m)), list(targets.chunk(m)))
    return counts


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb_h1", 1), ("dualpipev", 1)])
def test_every_gradient_arrives_through_autograd(name, v):
    """One arrival per parameter per micro-batch, as in one process accumulating m
    micro-batches (before: ZB-H1's weights and norms got `.grad` assigned, 0 arrivals)."""
    m = 4
    counts = {}
    for c in run(_hook_counts, 2, name, m, v):
        counts.update(c)
    expected = {n for n, _ in TinyLlama(CFG).named_parameters()}
    assert counts.keys() == expected
    assert set(counts.values()) == {m}, counts


@pytest.mark.parametrize("args, message", [
    (("1f1b", 4, 1, 4), "stage 1 of this 2-stage schedule must not embed and must end in the head"),
])
def test_stages_built_for_another_schedule_are_refused(args, message):
    with pytest.raises(WorkerError, match=message):
        run(_hook_counts, 2, *args)


def _bad_micro_batches(kind):
    sched = make_schedule("1f1b", 2, 4)
    stages = split_stages(TinyLlama(CFG), 2)
    tokens, targets = random_tokens(8, 8, CFG.vocab_size, seed=1)
    tk, tg = list(tokens.chunk(4)), list(targets.chunk(4))
    if kind == "few":
        tk, tg = tk[:3], tg[:3]
    else:
        tk[2] = tk[2][:, :4]
    run_schedule(sched, {dist.get_rank(): stages[dist.get_rank()]}, tk, tg)


@pytest.mark.parametrize("kind, message", [("few", "runs m=4 micro-batches; got 3"),
                                           ("unequal", "must all have one shape")])
def test_wrong_micro_batches_are_a_clear_error(kind, message):
    with pytest.raises(WorkerError, match=message):
        run(_bad_micro_batches, 2, kind)
