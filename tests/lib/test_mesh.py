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


# Mesh(dp=4, cp=2) on 8 ranks with ep=2, drawn by hand (rank = 2·dp + cp):
#   dp coordinate:   0      1   |   2      3        two ep blocks of 2 dp coordinates
#   cp=0:           r0     r2   |  r4     r6
#   cp=1:           r1     r3   |  r5     r7
# ep: a block's ranks of one cp coordinate share the experts, half each;
# edp: the same place in every block, over cp: they hold the same experts.
EP_BY_HAND = {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
              "edp": [[0, 1, 4, 5], [2, 3, 6, 7]]}


def _expert_layout(without_unflatten):
    if without_unflatten:            # the path for a torch without DeviceMesh._unflatten
        from torch.distributed.device_mesh import DeviceMesh
        del DeviceMesh._unflatten
    mesh = Mesh(dp=4, cp=2)
    ep, edp = mesh.expert_groups(2)
    assert mesh.expert_groups(2) == (ep, edp) and mesh.group("ep") is ep and mesh.group("edp") is edp
    out = {}
    for name, g in (("ep", ep), ("edp", edp)):   # who answers an all-gather over the group
        got = torch.zeros(dist.get_world_size(g))
        comm.all_gather(got, torch.tensor([float(dist.get_rank())]), group=g)
        out[name] = [int(v) for v in got.tolist()]
    errors = []
    for bad in (lambda: mesh.expert_groups(4), lambda: mesh.expert_groups(3)):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    return out, mesh.layout(), mesh.describe(), errors


@pytest.mark.parametrize("without_unflatten", [False, True])
def test_the_ep_groups_are_a_view_of_dp_as_drawn_by_hand(without_unflatten):
    for rank, (members, layout, text, errors) in enumerate(
            run(_expert_layout, 8, without_unflatten, timeout=120)):
        for name, rows in EP_BY_HAND.items():
            mine = next(row for row in rows if rank in row)
            assert members[name] == mine == layout[name], (rank, name)
        assert layout["dp"] == [rank % 2 + 2 * i for i in range(4)]
        assert layout["cp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert text.splitlines()[0] == (f"rank {rank} of Mesh(dp=4, cp=2) with ep=2: pp=0 "
                                        f"dp={rank // 2} cp={rank % 2} tp=0 ep={rank // 2 % 2}")
        assert f"  edp    {layout['edp']}" in text.splitlines()
        assert errors == ["this mesh's experts are laid out over ep=2 already",
                          "the ep size 3 must divide dp=4 (EP groups are made of dp ranks)"]


def test_ep_before_expert_groups_is_a_clear_error():
    def worker():
        try:
            Mesh(dp=2).group("ep")
        except ValueError as e:
            return str(e)
    assert run(worker, 2, timeout=60) == ["'ep' is a view of dp: call mesh.expert_groups(ep) "
                                          "first, then mesh.group('ep') alone"] * 2
