"""Lesson 10 checks: each passes a right answer and fails the stub and plausible wrong ones
(the order turned round, a stride off by one dimension, a forgotten dimension, ZeRO without
padding, the wrong pipeline stage, shards over dp alone)."""
import re
import contextlib
import pytest

from picolib.grading import ExerciseFailed
from picolib.grading.lesson10 import check_mesh_coordinates, check_mesh_groups, check_state_bytes

DIMS = ("pp", "dp", "cp", "tp")


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def stub(*args, **kwargs):
    raise NotImplementedError


def coordinates(rank, sizes, order=DIMS):
    out = {}
    for d in reversed(order):            # the innermost dimension changes fastest
        out[d] = rank % sizes[d]
        rank //= sizes[d]
    return {d: out[d] for d in DIMS}


def rank_of(coords, sizes, order=DIMS):
    rank = 0
    for d in order:
        rank = rank * sizes[d] + coords[d]
    return rank


def test_mesh_coordinates():
    check_mesh_coordinates(coordinates, rank_of)
    with fails("not written yet"):
        check_mesh_coordinates(stub, rank_of)
    backwards = tuple(reversed(DIMS))     # tp outermost: "column-major"
    with fails("the order is turned round"):
        check_mesh_coordinates(lambda r, s: coordinates(r, s, backwards),
                               lambda c, s: rank_of(c, s, backwards))

    def off_by_one(rank, sizes):          # each stride includes its own dimension
        out, stride = {}, 1
        for d in reversed(DIMS):
            stride *= sizes[d]
            out[d] = rank // stride % sizes[d]
        return {d: out[d] for d in DIMS}
    with fails("DeviceMesh gave") as info:
        check_mesh_coordinates(off_by_one, rank_of)
    assert "turned round" not in info.value.details       # the order hint only when it fits every rank
    with fails(r"rank_of\(.*'cp': 1"):   # cp left out
        check_mesh_coordinates(coordinates, lambda c, s: rank_of(c, s, ("pp", "dp", "tp")))


def groups_of(rank, sizes, replica_order=("dp", "cp"), order=DIMS):
    me = coordinates(rank, sizes, order)
    out = {d: [rank_of({**me, d: i}, sizes, order) for i in range(sizes[d])] for d in DIMS}
    a, b = replica_order
    out["dp_cp"] = [rank_of({**me, a: i, b: j}, sizes, order)
                    for i in range(sizes[a]) for j in range(sizes[b])]
    return out


def test_mesh_groups():
    check_mesh_groups(groups_of)
    with fails("not written yet"):
        check_mesh_groups(stub)
    with fails(r"dp_cp: got .*\(the right ranks in the wrong order\)") as info:
        check_mesh_groups(lambda r, s: groups_of(r, s, replica_order=("cp", "dp")))
    assert "hint: dp_cp lists dp outer and cp inner" in info.value.details
    assert "not one of the two" not in info.value.details

    def dp_only(rank, sizes):            # the replicas taken as the dp group alone
        out = groups_of(rank, sizes)
        return {**out, "dp_cp": out["dp"]}
    with fails(r"dp_cp: got") as info:
        check_mesh_groups(dp_only)
    assert "hint: dp_cp is dp and cp together" in info.value.details
    assert "dp outer and cp inner" not in info.value.details

    def whole_world(rank, sizes):        # a wrong list that no hint explains: no hint
        out = groups_of(rank, sizes)
        return {**out, "dp_cp": list(range(sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]))}
    with fails(r"dp_cp: got") as info:
        check_mesh_groups(whole_world)
    assert "hint" not in info.value.details

    def by_filter(rank, sizes):          # right, written differently: filter the world
        me = coordinates(rank, sizes)
        world = range(sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"])
        out = groups_of(rank, sizes)
        out["dp_cp"] = [r for r in world
                        if all(coordinates(r, sizes)[d] == me[d] for d in ("pp", "tp"))]
        return out
    check_mesh_groups(by_filter)
    with fails("tp: got"):
        check_mesh_groups(lambda r, s: groups_of(r, s, order=tuple(reversed(DIMS))))
    with fails("expected a dict with keys"):
        check_mesh_groups(lambda r, s: {d: g for d, g in groups_of(r, s).items() if d != "dp_cp"})


def state_bytes(cfg, dp, tp, pp, cp, zero, pad=True, stages=None, shard_over_cp=True,
                zero2_sharded_grads=True, embed_split=True):
    h, d, v = cfg.hidden, cfg.head_dim, cfg.vocab_size
    block = (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * d * h // tp + 3 * h * cfg.ffn_hidden // tp + 2 * h
    table = v * h // tp if embed_split else v * h
    n = dp * cp if shard_over_cp else dp

    def on_stage(s):
        root = (table if s == 0 else 0) + (h + table if s == pp - 1 else 0)
        units = ([root] if root else []) + [block] * (cfg.n_layers // pp)
        full = sum(-(-u // n) * n for u in units) if zero and pad else sum(units)
        shard = full // n
        grads = shard if zero >= 2 and (zero2_sharded_grads or zero == 3) else full
        return 4 * (shard if zero == 3 else full) + 4 * grads + 8 * (shard if zero else full)
    return max(on_stage(s) for s in (range(pp) if stages is None else stages))


def test_state_bytes():
    check_state_bytes(state_bytes)
    with fails("not written yet"):
        check_state_bytes(stub)
    with fails("ZeRO pads each unit"):
        check_state_bytes(lambda cfg, **k: state_bytes(cfg, **k, pad=False))
    with fails("the busiest rank is the last pipeline stage"):
        check_state_bytes(lambda cfg, **k: state_bytes(cfg, **k, stages=[0]))
    with fails("ZeRO shards over dp × cp"):
        check_state_bytes(lambda cfg, **k: state_bytes(cfg, **k, shard_over_cp=False))
    with fails("only its shard of the gradients"):
        check_state_bytes(lambda cfg, **k: state_bytes(cfg, **k, zero2_sharded_grads=False))
    with fails("dp=3, tp=2, zero=1: got"):  # the tables not split by tp
        check_state_bytes(lambda cfg, **k: state_bytes(cfg, **k, embed_split=False))


# ---------------------------------------------------------------- issue 55: the composition
from picolib.grading import check_composition  # noqa: E402


def composition(cfg, order=("tensor", "context", "expert", "pipeline", "data"), replicas=("dp", "cp"),
                skip_ones=True, expert_when_moe=False):
    steps = {"tensor": (cfg.tp > 1, ("tp",)), "context": (cfg.cp > 1, ("cp",)),
             "expert": (bool(cfg.experts) and (cfg.ep > 1 or expert_when_moe), ("dp",)),
             "pipeline": (cfg.pp > 1, ("pp",)),
             "data": (cfg.dp * cfg.cp > 1, tuple(d for d in replicas if getattr(cfg, d) > 1))}
    return [(name, steps[name][1]) for name in order if steps[name][0] or not skip_ones]


def composition_by_walking_the_code(cfg):
    """Right, written differently: the steps appended as compose.transform and build read."""
    out = []
    if cfg.tp > 1:
        out.append(("tensor", ["tp"]))
    if cfg.cp > 1:
        out.append(("context", ["cp"]))
    if cfg.experts and cfg.ep > 1:
        out.append(("expert", ["dp"]))
    if cfg.pp > 1:
        out.append(("pipeline", ["pp"]))
    replicas = [d for d, n in (("dp", cfg.dp), ("cp", cfg.cp)) if n > 1]
    return out + ([("data", replicas)] if replicas else [])


def test_composition_names_each_mistake():
    check_composition(composition)
    check_composition(composition_by_walking_the_code)
    with fails("not written yet"):
        check_composition(stub)
    with fails(r"the order \['context', 'tensor', 'data'\].*tensor before context: context "
               "parallelism wraps the attention core TP made"):
        check_composition(lambda c: composition(c, order=("context", "tensor", "expert", "pipeline", "data")))
    with fails("pipeline before data: data parallelism wraps what the other steps left"):
        check_composition(lambda c: composition(c, order=("tensor", "context", "expert", "data", "pipeline")))
    with fails("tensor before pipeline: the stages are cut from the model the steps before made"):
        check_composition(lambda c: composition(c, order=("pipeline", "tensor", "context", "expert", "data")))
    with fails(r"dp=2, cp=2, tp=2: data over \('dp',\), but its group spans \('dp', 'cp'\) — "
               "context-parallel ranks hold the same weights"):
        check_composition(lambda c: composition(c, replicas=("dp",)))
    with fails("tensor — tp = 1: transform skips it"):
        check_composition(lambda c: composition(c, skip_ones=False))
    with fails("expert — ep = 1: every rank keeps every expert"):
        check_composition(lambda c: composition(c, expert_when_moe=True))
    with fails("no context step, but cp = 2"):
        check_composition(lambda c: [s for s in composition(c) if s[0] != "context"])
    with fails(r"tensor over \('dp',\), but its group spans \('tp',\)"):
        check_composition(lambda c: [(n, ("dp",) if n == "tensor" else d) for n, d in composition(c)])
    with fails("unknown technique 'tp'"):
        check_composition(lambda c: [("tp", ("tp",))])
    with fails("expected a list of"):
        check_composition(lambda c: None)
