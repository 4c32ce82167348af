"""The mesh: named dimensions over real ranks. Each group is checked by communicating over
it (who answers an all-gather), against layouts written out by hand."""
import pytest
import torch
import torch.distributed as dist

from picolib import comm
from picolib.launch import run
from picolib.mesh import Mesh, check_mesh

# Mesh(pp=2, dp=2, tp=2) on 8 ranks, drawn by hand: pp outermost, tp innermost
#   pp=0: dp=0 [0 1]  dp=1 [2 3]      pp=1: dp=0 [4 5]  dp=1 [6 7]
BY_HAND = {
    ("tp",): [[0, 1], [2, 3], [4, 5], [6, 7]],
    ("dp",): [[0, 2], [1, 3], [4, 6], [5, 7]],
    ("pp",): [[0, 4], [1, 5], [2, 6], [3, 7]],
    ("dp", "tp"): [[0, 1, 2, 3], [4, 5, 6, 7]],
    ("pp", "dp"): [[0, 2, 4, 6], [1, 3, 5, 7]],
    ("cp",): [[r] for r in range(8)],
}


def _members():
    mesh = Mesh(pp=2, dp=2, tp=2)
    out = {}
    for names in BY_HAND:
        g = mesh.group(*names)
        me = torch.tensor([float(dist.get_rank())])
        got = torch.zeros(dist.get_world_size(g))
        comm.all_gather(got, me, group=g)
        out[names] = [int(v) for v in got.tolist()]
    coords = {n: mesh.coordinate(n) for n in ("pp", "dp", "cp", "tp")}
    return out, coords, mesh.peers("pp"), mesh.size("dp", "tp"), repr(mesh)


def test_groups_and_coordinates_match_the_layout_drawn_by_hand():
    for rank, (members, coords, pp_peers, size, text) in enumerate(run(_members, 8, timeout=120)):
        for names, rows in BY_HAND.items():
            mine = next(row for row in rows if rank in row)
            assert members[names] == mine, (rank, names)
        assert pp_peers == members[("pp",)]
        # coordinates: position of this rank in its row along each dimension
        assert coords["tp"] == BY_HAND[("tp",)][rank // 2].index(rank)
        assert coords["dp"] == next(r for r in BY_HAND[("dp",)] if rank in r).index(rank)
        assert coords["pp"] == next(r for r in BY_HAND[("pp",)] if rank in r).index(rank)
        assert coords["cp"] == 0 and size == 4 and text == "Mesh(pp=2, dp=2, tp=2)"


@pytest.mark.parametrize("world, sizes, message", [
    (4, {"dp": 2, "tp": 3}, "has 6 ranks, but the world has 4"),
    (4, {"dp": 2}, "has 2 ranks, but the world has 4"),
    (4, {"xp": 4}, "unknown mesh dimension"),
    (4, {"dp": 0, "tp": 4}, "dp must be a positive int"),
    (4, {"dp": 2.0, "tp": 2}, "dp must be a positive int"),
])
def test_bad_degrees_are_refused_before_any_process_starts(world, sizes, message):
    with pytest.raises(ValueError, match=message):
        check_mesh(world, **sizes)


def test_a_mesh_outside_a_rank_is_a_clear_error():
    with pytest.raises(RuntimeError, match="inside a rank"):
        Mesh(dp=1)
