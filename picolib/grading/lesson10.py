"""Checks for lesson 10 (the 5-D trainer).

- `check_mesh_coordinates(coordinates, rank_of)`: `coordinates(rank, sizes)` → {"pp": i,
  "dp": j, "cp": k, "tp": l}, where `rank` sits in a mesh of `sizes` ({"pp": .., "dp": ..,
  "cp": .., "tp": ..}, picolib's order, outermost first); `rank_of(coords, sizes)` → the rank.
- `check_mesh_groups(fn)`: `fn(rank, sizes)` → {"pp": [...], "dp": [...], "cp": [...],
  "tp": [...], "dp_cp": [...]}: the global ranks of `rank`'s group along each dimension, and
  of its replica group over dp and cp together (the ranks ZeRO and DDP reduce over), each
  list in the group's own order.
- `check_composition(fn)`: `fn(cfg)` → [(technique, dims), ...]: the steps `compose.build`
  takes for a TrainConfig ("tensor", "context", "expert", "pipeline", "data"), in its order, each
  with the mesh dimensions its group spans (("dp", "cp") for the replicas of a dp × cp run).
- `check_state_bytes(fn)`: `fn(cfg, dp=, tp=, pp=, cp=, zero=)` → the bytes of parameters,
  gradients and AdamW state (fp32) the busiest rank holds after a step of picolib's trainer.

The references are not formulas: the composition is what `compose.build` calls on 8 real ranks
(on `meta`, each technique's entry point recording its group); the coordinates and groups are what PyTorch's DeviceMesh
(picolib.mesh.Mesh) hands each rank of real 6-, 8- and 16-rank runs; the bytes are the
`state_bytes` the trainer measures on 6 and 8 ranks. Runs are made once per session (cached).
"""
from __future__ import annotations

from functools import lru_cache

import torch.distributed as dist

from ..launch import run
from ..mesh import DIMS, Mesh
from ..planner import Parallelism, rank_units
from ._core import call_student, compare, report

__all__ = ["check_mesh_coordinates", "check_mesh_groups", "check_state_bytes", "check_composition"]

MESHES = {  # world size → meshes on it (unnamed dimensions have size 1)
    6: ({"dp": 3, "tp": 2}, {"pp": 3, "cp": 2}),
    8: ({"pp": 2, "dp": 2, "tp": 2}, {"dp": 2, "cp": 4}, {"pp": 4, "tp": 2}),
    16: ({"pp": 2, "dp": 2, "cp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 4}),
}
GROUPS = (*DIMS, "dp_cp")
SHOWN = 8  # problems listed in full; the rest are counted


def _full(sizes: dict) -> dict:
    return {d: sizes.get(d, 1) for d in DIMS}


def _mesh_worker(meshes) -> list[dict]:
    """On one rank: for each mesh, this rank's coordinate along every dimension (DeviceMesh's
    get_local_rank) and its groups' global ranks (the process groups themselves)."""
    out = []
    for sizes in meshes:
        mesh = Mesh(**sizes)
        groups = {d: dist.get_process_group_ranks(mesh.group(d)) for d in DIMS}
        groups["dp_cp"] = dist.get_process_group_ranks(mesh.group("dp", "cp"))
        out.append({"coords": {d: mesh.coordinate(d) for d in DIMS}, "groups": groups,
                    "layout": mesh.device_mesh.mesh.tolist()})
    return out


@lru_cache(maxsize=None)
def measured_meshes() -> list[tuple[dict, list[dict]]]:
    """[(sizes, [rank 0's view, rank 1's view, ...])] for every mesh in MESHES, from real
    ranks (one launch.run per world size; cached)."""
    out = []
    for world, meshes in MESHES.items():
        views = run(_mesh_worker, world, meshes, timeout=120)
        for i, sizes in enumerate(meshes):
            out.append((_full(sizes), [views[r][i] for r in range(world)]))
    return out


def _describe(sizes: dict) -> str:
    return " × ".join(f"{d}={n}" for d, n in sizes.items() if n > 1)


def _cap(problems: list[str]) -> list[str]:
    if len(problems) <= SHOWN:
        return problems
    return problems[:SHOWN] + [f"… and {len(problems) - SHOWN} more"]


def _reversed_coordinates(rank: int, sizes: dict) -> dict:
    """The layout with the order turned round (tp outermost): a common slip, named in hints."""
    out = {}
    for d in DIMS:
        out[d] = rank % sizes[d]
        rank //= sizes[d]
    return out


def check_mesh_coordinates(coordinates, rank_of) -> None:
    """Every rank of seven meshes on 6, 8 and 16 ranks: `coordinates` must give what
    DeviceMesh gave that rank, `rank_of` must invert it (and agree with DeviceMesh's layout)."""
    call_student(coordinates, 0, _full(MESHES[6][0]))   # fail at once if it is not written
    problems, checks, turned = [], 0, True       # turned: every answer is the order turned round
    for sizes, views in measured_meshes():
        for rank, view in enumerate(views):
            want = view["coords"]
            got = call_student(coordinates, rank, dict(sizes))
            checks += 1
            try:
                got = {d: int(got[d]) for d in DIMS}
            except (TypeError, KeyError, ValueError, IndexError):
                problems.append(f"{_describe(sizes)}, rank {rank}: expected a dict with keys "
                                f"{list(DIMS)}, got {got!r}")
                continue
            turned = turned and got == _reversed_coordinates(rank, sizes)
            if got != want:
                problems.append(f"{_describe(sizes)}, rank {rank}: got {got}, DeviceMesh gave {want}")
            where = view["layout"]
            for d in DIMS:
                where = where[want[d]]
            back = call_student(rank_of, dict(want), dict(sizes))
            checks += 1
            if back != rank or where != rank:
                problems.append(f"{_describe(sizes)}: rank_of({want}) gave {back!r}, the mesh "
                                f"holds rank {where} there")
    hint = ("the order is turned round: pp is outermost and tp innermost, so consecutive ranks "
            "are TP neighbours (tp changes fastest)") if turned and problems else ""
    problems = _cap(problems) + ([f"hint: {hint}"] if hint else [])
    report("rank ↔ mesh coordinates against DeviceMesh", problems, checks)


def check_mesh_groups(fn) -> None:
    """Every rank of the seven meshes: each group's global ranks in the group's order, as the
    process groups of `Mesh.group` hold them."""
    call_student(fn, 0, _full(MESHES[6][0]))          # fail at once if it is not written
    problems, checks = [], 0
    dp_cp_kinds, order_1d = [], False      # what each wrong dp_cp was; a 1-D group reordered
    for sizes, views in measured_meshes():
        for rank, view in enumerate(views):
            got = call_student(fn, rank, dict(sizes))
            checks += 1
            if not isinstance(got, dict) or set(GROUPS) - set(got):
                problems.append(f"{_describe(sizes)}, rank {rank}: expected a dict with keys "
                                f"{list(GROUPS)}, got {got!r}")
                continue
            for name in GROUPS:
                g, want = got[name], view["groups"][name]
                try:
                    g = [int(r) for r in g]
                except (TypeError, ValueError):
                    pass
                if g == want:
                    continue
                same = sorted(map(str, g)) == sorted(map(str, want))
                order = " (the right ranks in the wrong order)" if same else ""
                problems.append(f"{_describe(sizes)}, rank {rank}, {name}: got {g!r}, "
                                f"Mesh.group holds {want}{order}")
                if name != "dp_cp":
                    order_1d |= same
                    continue
                dp, cp = sizes["dp"], sizes["cp"]      # want: dp outer, cp inner
                cp_outer = [want[i * cp + j] for j in range(cp) for i in range(dp)]
                dp_cp_kinds.append("cp outer" if g == cp_outer else
                                   "one dimension" if g in (view["groups"]["dp"], view["groups"]["cp"])
                                   else "other")
    hint = []
    if dp_cp_kinds and set(dp_cp_kinds) == {"one dimension"}:
        hint.append("hint: dp_cp is dp and cp together — every rank that differs from this one "
                    "only in dp and cp — not one of the two")
    if dp_cp_kinds and set(dp_cp_kinds) == {"cp outer"}:
        hint.append("hint: dp_cp lists dp outer and cp inner, as the grid is (cp changes fastest)")
    if order_1d:
        hint.append("hint: a group's ranks come in the order of their coordinate along it")
    report("process groups of the mesh against Mesh.group", _cap(problems) + hint, checks)


# --------------------------------------------------------------------------- state bytes

STATE_CASES = {  # world size → trainer configurations (tiny preset, fp32, AdamW, one step)
    8: ({"dp": 2, "tp": 2, "pp": 2, "zero": 0, "micro_batches": 2, "batch": 4},
        {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "micro_batches": 2, "batch": 4},
        {"dp": 2, "cp": 2, "tp": 2, "zero": 2, "batch": 4},
        {"dp": 4, "pp": 2, "zero": 2, "micro_batches": 2, "batch": 8}),
    6: ({"dp": 3, "tp": 2, "zero": 1, "batch": 6},
        {"dp": 3, "pp": 2, "zero": 2, "micro_batches": 2, "batch": 6},
        {"dp": 6, "zero": 3, "batch": 6},
        {"dp": 3, "cp": 2, "zero": 1, "batch": 6}),
}


def _config(case: dict):
    from ..train import TrainConfig
    return TrainConfig(**case, seq=16, steps=1, data="random", progress=False, peak_tflops=1.0)


def _state_worker(cases) -> list[int]:
    from ..train import train
    return [train(_config(c))[0]["state_bytes"] for c in cases]


@lru_cache(maxsize=None)
def measured_state_bytes() -> list[tuple[dict, int]]:
    """[(configuration, busiest rank's state bytes)] from the trainer (cached)."""
    out = []
    for world, cases in STATE_CASES.items():
        got = run(_state_worker, world, cases, timeout=180)[0]
        out += list(zip(cases, got))
    return out


def _degrees(case: dict) -> dict:
    return {d: case.get(d, 1) for d in ("dp", "tp", "pp", "cp")} | {"zero": case["zero"]}


def _what_it_tests(case: dict) -> list[str]:
    d = _degrees(case)
    notes = []
    if d["pp"] > 1:
        notes.append("the busiest rank is the last pipeline stage: the final norm and the head "
                     "(h + v·h/tp) outweigh the first stage's embedding (v·h/tp)")
    n = d["dp"] * d["cp"]
    cfg, par = _config(case).model_config(), Parallelism(**d)
    if d["zero"] and any(u % n for r in range(d["pp"]) for u in rank_units(cfg, par, r)):
        notes.append(f"ZeRO pads each unit (the stage's own embedding/norm/head, then every "
                     f"block) to a multiple of the {n} ranks it is cut over, then cuts it")
    if d["cp"] > 1 and d["zero"]:
        notes.append("ZeRO shards over dp × cp: the context-parallel ranks hold the same "
                     "weights, so they are replicas too")
    if d["zero"] == 2:
        notes.append("after the step ZeRO-2 holds only its shard of the gradients")
    return notes


def check_state_bytes(fn) -> None:
    """Eight configurations of the tiny Llama on 6 and 8 ranks (DDP and ZeRO-1/2/3 with TP,
    PP and CP), each against the trainer's measured state bytes of its busiest rank."""
    cfg = _config(STATE_CASES[6][0]).model_config()
    call_student(fn, cfg, **_degrees(STATE_CASES[6][0]))   # fail at once if not written
    problems = []
    measured = measured_state_bytes()
    for case, want in measured:
        degrees = _degrees(case)
        got = call_student(fn, cfg, **degrees)
        what = ", ".join(f"{k}={v}" for k, v in degrees.items() if k == "zero" or v > 1)
        wrong = compare(what, got, want)
        if wrong:
            problems.append(wrong[0] + " (bytes measured by the trainer)" + "".join(
                f"\n      this case tests: {note}" for note in _what_it_tests(case)))
    report("state bytes of the busiest rank against the trainer", problems, len(measured))


# --------------------------------------------------------------------------- the composition

COMPOSITIONS = (  # 8 ranks each, the tiny preset (4 query heads, 2 KV heads, 4 layers)
    {"pp": 2, "dp": 2, "tp": 2, "sp": True, "micro_batches": 2},
    {"dp": 2, "cp": 2, "tp": 2},
    {"pp": 2, "cp": 2, "tp": 2, "micro_batches": 2},
    {"pp": 2, "dp": 4, "experts": 4, "top_k": 2, "ep": 2, "micro_batches": 2},
    {"dp": 4, "tp": 2, "experts": 4, "top_k": 2, "ep": 1},
)
TECHNIQUES = ("tensor", "context", "expert", "pipeline", "data")
_DEGREE = {"tensor": "tp", "context": "cp", "pipeline": "pp"}


def _composition_config(case: dict):
    from ..train import TrainConfig
    return TrainConfig(**case, batch=8, seq=16, steps=1, data="random", progress=False)


def _composition_worker(cases) -> list[list]:
    """On a rank: `compose.build` of every case on `meta`, its `log` giving (technique, the
    group it was applied over) in order; each group as the mesh dimensions it spans."""
    from .. import compose
    out = []
    for case in cases:
        cfg, log = _composition_config(case), []
        mesh = Mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, device="meta")
        compose.build(cfg, mesh, log=log)
        out.append([(name, mesh.spanned(dist.get_process_group_ranks(group))) for name, group in log])
    return out


@lru_cache(maxsize=None)
def measured_compositions() -> tuple:
    """((case, [(technique, dims), ...]) ...): what `compose.build` called, in order, and the
    mesh dimensions each call's group spans (rank 0's view; one 8-rank run, cached)."""
    views = run(_composition_worker, 8, COMPOSITIONS, timeout=120)
    return tuple(zip(COMPOSITIONS, views[0]))


def _order_reason(first: str, then: str) -> str:
    """Why the library applies `first` before `then` (both in its answer)."""
    if then == "data":
        return "data parallelism wraps what the other steps left on this rank: it comes last"
    if then == "pipeline":
        return (f"the stages are cut from the model the steps before made, so each keeps its "
                f"{first}-parallel parts: the cut comes after {first}")
    if (first, then) == ("tensor", "context"):
        return "context parallelism wraps the attention core TP made, so it rings only this rank's heads"
    return f"transform applies {' → '.join(TECHNIQUES[:4])}, then build wraps data parallelism"


def _step_problems(where: str, cfg, got: list, want: list) -> list[str]:
    """One line per wrong step of one case: a step that does not belong, one missing, the
    wrong dimensions, the wrong order."""
    names_got, names_want = [n for n, _ in got], [n for n, _ in want]
    out = []
    for name in dict.fromkeys(names_got):
        if name not in names_want:
            if name == "expert" and cfg.experts:
                why = "ep = 1: every rank keeps every expert (apply_moe, no group) — no expert step"
            elif name == "expert":
                why = "no experts in this configuration"
            elif name == "data":
                why = "dp · cp = 1"
            else:
                why = f"{_DEGREE.get(name, name)} = 1: transform skips it"
            out.append(f"{where}: {name} — {why}")
    for name, dims in want:
        if name not in names_got:
            degree = (f"ep = {cfg.ep} with {cfg.experts} experts" if name == "expert" else
                      f"dp · cp = {cfg.dp * cfg.cp}" if name == "data" else
                      f"{_DEGREE[name]} = {getattr(cfg, _DEGREE[name])}")
            out.append(f"{where}: no {name} step, but {degree}")
            continue
        mine = dict(got)[name]
        if tuple(mine) != dims:
            hint = (" — context-parallel ranks hold the same weights (they see other tokens), so "
                    "the replicas are dp × cp" if name == "data" and "cp" in dims and "cp" not in mine
                    else "")
            out.append(f"{where}: {name} over {tuple(mine)}, but its group spans {dims}{hint}")
    common = [n for n in names_got if n in names_want]
    expected = [n for n in names_want if n in names_got]
    if not out and common != expected:
        i = next(i for i, (a, b) in enumerate(zip(common, expected)) if a != b)
        out.append(f"{where}: the order {common}, expected {expected} — {expected[i]} before "
                   f"{common[i]}: {_order_reason(expected[i], common[i])}")
    return out


def check_composition(fn) -> None:
    """Five configurations on 8 ranks (TP+SP, CP, PP, experts over ep dp ranks or on every
    rank): `fn(cfg)` → [(technique, dims), ...] must be what `compose.build` does
    there — measured by running it on `meta` with each technique's entry point recording its
    group — in its order, each over the mesh dimensions its group spans."""
    call_student(fn, _composition_config(COMPOSITIONS[0]))   # fail at once if it is not written
    problems, checks = [], 0
    for case, want in measured_compositions():
        cfg = _composition_config(case)
        where = ", ".join(f"{k}={v}" for k, v in case.items() if k != "micro_batches")
        got = call_student(fn, cfg)
        checks += 1
        try:
            got = [(str(name), tuple(dims)) for name, dims in got]
        except (TypeError, ValueError):
            problems.append(f"{where}: expected a list of (technique, dims) pairs, got {got!r}")
            continue
        unknown = [n for n, _ in got if n not in TECHNIQUES]
        if unknown:
            problems.append(f"{where}: unknown technique {unknown[0]!r}; name them {list(TECHNIQUES)}")
            continue
        problems += _step_problems(where, cfg, got, [(n, tuple(d)) for n, d in want])
    report("the composition against compose.build", _cap(problems), checks)
