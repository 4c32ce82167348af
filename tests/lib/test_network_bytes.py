"""picolib/network_bytes.py against an independent count: the mesh built as a tensor of rank
numbers (torch.arange reshaped, as DeviceMesh builds it), groups read off as its rows,
ring hops listed pair by pair and sorted into levels by looking up each GPU's node and
unit; and against hand counts on 16 GPUs."""
import itertools

import pytest
import torch

from picolib.hardware import Hardware, Level
from picolib.model import LlamaConfig
from picolib.network_bytes import DIMS, level_bytes
from picolib.planner import Parallelism, traffic

TINY = LlamaConfig(vocab_size=64, hidden=32, n_layers=8, n_heads=8, n_kv_heads=2,
                   ffn_hidden=64, max_seq=64)
TOY = Hardware("toy", 1e12, 2e12, 1e9, 1e9, (Level("node", 2, 1.0, 2.0), Level("leaf", 4, 0.5, 2.0),
                                            Level("spine", 8, 0.25, 2.0)))


def counted(cfg, par, order, hw):
    size = [getattr(par, d) for d in order]
    mesh = torch.arange(par.n_gpus).reshape(size)                  # rank = row-major over order
    gpu_units = {lv.name: [g // lv.gpus for g in range(par.n_gpus)] for lv in hw.levels}

    def level(a, b):
        for lv in hw.levels:
            if gpu_units[lv.name][a] == gpu_units[lv.name][b]:
                return lv.name
        return hw.levels[-1].name

    pp_of = {int(r): i for i in range(par.pp) for r in mesh.select(order.index("pp"), i).flatten()}
    out = {k: {lv.name: 0 for lv in hw.levels} for k in ("dp", "tp", "cp", "pp")}
    for kind, dims in (("dp", ("dp", "cp")), ("tp", ("tp",)), ("cp", ("cp",))):
        inner = [order.index(d) for d in order if d in dims]
        rest = [i for i in range(4) if i not in inner]
        rows = mesh.permute(rest + inner).reshape(-1, mesh.permute(rest + inner).shape[-len(inner):].numel())
        for row in rows.tolist():
            for a, b in zip(row, row[1:] + row[:1]):
                if len(row) > 1:
                    out[kind][level(a, b)] += traffic(cfg, par, pp_of[a])[kind]
    if par.pp > 1:
        rows = mesh.movedim(order.index("pp"), -1).reshape(-1, par.pp).tolist()
        stages = par.pp * par.v
        for row in rows:
            for s in range(stages - 1):   # one boundary: activations forward, gradients back
                a, b = row[s % par.pp], row[(s + 1) % par.pp]
                one_way = traffic(cfg, par, s % par.pp)["pp"] / _messages(s % par.pp, par)
                out["pp"][level(a, b)] += 2 * one_way
    return out


def _messages(rank, par):
    stages = range(rank, par.pp * par.v, par.pp)
    return sum(s < par.pp * par.v - 1 for s in stages) + sum(s > 0 for s in stages)


CASES = [Parallelism(dp=2, tp=2, pp=2, zero=1, micro_batches=2, seq=16),
         Parallelism(dp=4, tp=2, pp=1, cp=2, zero=2, sp=True, micro_batches=1, seq=16),
         Parallelism(dp=3, tp=2, pp=2, zero=0, micro_batches=2, seq=16),
         Parallelism(dp=2, tp=2, pp=2, cp=2, zero=1, micro_batches=4, seq=16, schedule="interleaved", chunks=2)]


@pytest.mark.parametrize("par", CASES)
def test_level_bytes_equal_an_enumeration_of_the_rings(par):
    for order in itertools.permutations(DIMS):
        got = level_bytes(TINY, par, order, TOY)
        want = counted(TINY, par, order, TOY)
        for kind in want:
            for lv in want[kind]:
                assert got[kind][lv] == pytest.approx(want[kind][lv], rel=1e-12, abs=1e-9), (order, kind, lv)
        for lv in got["total"]:
            assert got["total"][lv] == pytest.approx(sum(got[k][lv] for k in want))


def test_hand_counts_on_two_nodes():
    """16 GPUs, 8 per node (the H100 preset): tp8 × dp2."""
    par = Parallelism(dp=2, tp=8, zero=1, seq=64)
    per = traffic(TINY, par)
    inner = level_bytes(TINY, par, ("pp", "dp", "cp", "tp"))           # tp = a node
    assert inner["tp"] == {"node": 16 * per["tp"], "leaf": 0, "spine": 0}
    assert inner["dp"] == {"node": 0, "leaf": 16 * per["dp"], "spine": 0}
    outer = level_bytes(TINY, par, ("tp", "pp", "cp", "dp"))           # dp innermost
    assert outer["dp"] == {"node": 16 * per["dp"], "leaf": 0, "spine": 0}
    # tp groups {d, d+2, …, d+14}: hops 6→8 and 14→0 (+d) leave the node, the other 6 stay
    assert outer["tp"] == {"node": 12 * per["tp"], "leaf": 4 * per["tp"], "spine": 0}


def test_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="permutation"):
        level_bytes(TINY, Parallelism(dp=2), ("dp", "tp"))
    with pytest.raises(ValueError, match="DualPipe"):
        level_bytes(TINY, Parallelism(pp=2, micro_batches=4, schedule="dualpipev"), DIMS)
