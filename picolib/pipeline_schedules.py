"""Pipeline schedules as plain data (lesson 07).

A schedule says, for every rank, the ordered list of operations it runs:

    Op("F", stage, mb)    forward of micro-batch `mb` through stage `stage`
    Op("BW", stage, mb)   its full backward (input and weight gradients)
    Op("B", stage, mb)    backward for the input only (∂L/∂x, what the previous stage waits for)
    Op("W", stage, mb)    backward for the weights (∂L/∂W, needed only before the optimizer)

Stages are the model's pieces in data-flow order 0..S-1; `Schedule.stage_ranks[s]` is the
rank that holds stage s. With v stages per rank ("virtual stages", chunks) a rank holds
several pieces: interleaved 1F1B loops (rank r holds stages r, r+p, r+2p, ...), DualPipeV
folds (rank r holds stages r and 2p−1−r, a V).

The generators: `afab` (GPipe), `one_f_one_b`, `interleaved_1f1b`, `zb_h1`, `dualpipev`;
`make_schedule(name, p, m, v)` checks the numbers first. Checking a schedule and playing it
on ideal devices is `pipeline_simulator.py`; running it on real ranks, `pipeline_parallel.py`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Op", "Schedule", "afab", "one_f_one_b", "interleaved_1f1b", "zb_h1", "dualpipev",
           "SCHEDULES", "make_schedule", "bubble_formula", "from_torch"]


@dataclass(frozen=True)
class Op:
    kind: str   # "F", "B", "W" or "BW"
    stage: int
    mb: int

    def __repr__(self):
        return f"{self.kind}(s{self.stage},mb{self.mb})"


@dataclass
class Schedule:
    name: str
    n_micro: int
    stage_ranks: tuple       # rank of each stage, in data-flow order
    ops: list                # ops[rank] = [Op, ...] in execution order

    @property
    def n_ranks(self) -> int:
        return len(self.ops)

    @property
    def n_stages(self) -> int:
        return len(self.stage_ranks)

    def stages_of(self, rank: int) -> list[int]:
        """The stages a rank holds; the position in this list is the chunk index."""
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]

    def chunk(self, stage: int) -> int:
        return self.stages_of(self.stage_ranks[stage]).index(stage)


# --------------------------------------------------------------------------- generators

def afab(p: int, m: int) -> Schedule:
    """All forward, all backward (GPipe): every rank runs F0..F(m−1), then BW0..BW(m−1)."""
    ops = [[Op("F", r, i) for i in range(m)] + [Op("BW", r, i) for i in range(m)] for r in range(p)]
    return Schedule("afab", m, tuple(range(p)), ops)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: rank r warms up with p−1−r forwards, then alternates one F and one BW, then
    drains the backwards. At most p−r micro-batches wait for their backward on rank r."""
    ops = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [Op("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [Op("F", r, warm + i), Op("BW", r, i)]
        seq += [Op("BW", r, i) for i in range(m - warm, m)]
        ops.append(seq)
    return Schedule("1f1b", m, tuple(range(p)), ops)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): stage c·p + r lives on rank r,
    chunk c. Forwards go in rounds of p micro-batches through chunk 0, then chunk 1, ...;
    backwards in the same rounds from the last chunk down. Needs m to divide by p."""
    S, total = p * v, m * v

    def nth(k, kind, r):
        c = (k // p) % v
        if kind == "BW":
            c = v - 1 - c
        return Op(kind, c * p + r, (k // (p * v)) * p + k % p)

    ops = []
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * p, total)
        seq = [nth(k, "F", r) for k in range(warm)]
        for i in range(total - warm):
            seq += [nth(warm + i, "F", r), nth(i, "BW", r)]
        seq += [nth(i, "BW", r) for i in range(total - warm, total)]
        ops.append(seq)
    return Schedule("interleaved", m, tuple(s % p for s in range(S)), ops)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B and W. B goes as early as
    possible (the previous stage waits for it), W fills the time a rank would sit idle. Rank r
    keeps at most p−r micro-batches alive (until their W), as 1F1B does. Built by playing the
    pipeline in unit steps (F = B = W = 1) with the priorities B, then F, then W."""
    ops = [[] for _ in range(p)]
    done: dict[tuple, int] = {}                    # (kind, stage, mb) -> step it finished
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    t = 0
    while any(x < m for x in nw):
        for r in range(p):
            b_ready = nb[r] < nf[r] and (r == p - 1 or done.get(("B", r + 1, nb[r]), t) < t)
            f_ready = nf[r] < m and nf[r] - nw[r] < p - r and (
                r == 0 or done.get(("F", r - 1, nf[r]), t) < t)
            if b_ready:
                op = Op("B", r, nb[r]); nb[r] += 1
            elif f_ready:
                op = Op("F", r, nf[r]); nf[r] += 1
            elif nw[r] < nb[r]:
                op = Op("W", r, nw[r]); nw[r] += 1
            else:
                continue
            ops[r].append(op)
            done[(op.kind, op.stage, op.mb)] = t
        t += 1
    return Schedule("zb_h1", m, tuple(range(p)), ops)


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek, the "cut-in-half" DualPipe): 2p stages folded into a V, rank r
    holds stage r (chunk 0, going down) and stage 2p−1−r (chunk 1, coming back up); the last
    rank turns the data around, rank 0 holds both the embedding and the loss. Every rank
    overlaps a forward of one chunk with a backward of the other in the steady state and
    defers W's into the gaps. Eight phases as in DeepSeek's reference; needs m ≥ 2p."""
    ops = []
    for r in range(p):
        seq, f, b, wq = [], [0, 0], [0, 0], deque()
        stage = (r, 2 * p - 1 - r)

        def F(c):
            seq.append(Op("F", stage[c], f[c])); f[c] += 1

        def B(c, zb=False):
            seq.append(Op("B" if zb else "BW", stage[c], b[c]))
            if zb:
                wq.append(Op("W", stage[c], b[c]))
            b[c] += 1

        for _ in range((p - r - 1) * 2):                # 1: forwards of chunk 0
            F(0)
        for _ in range(r + 1):                          # 2: F0 F1
            F(0); F(1)
        for _ in range(p - r - 1):                      # 3: B1 W F1 (zero bubble)
            B(1, zb=True); seq.append(wq.popleft()); F(1)
        for _ in range(m - 2 * p + r + 1):              # 4: steady: F0 B1 F1 B0
            F(0); B(1); F(1); B(0)
        for _ in range(p - r - 1):                      # 5: B1 F1 B0
            B(1); F(1); B(0)
        zb = False
        for i in range(r + 1):                          # 6: B1 B0, second half split
            if i == (r + 1) // 2 and r % 2 == 1:
                zb = True
            B(1, zb)
            if i == (r + 1) // 2 and r % 2 == 0:
                zb = True
            B(0, zb)
        for _ in range(p - r - 1):                      # 7: W B0
            seq.append(wq.popleft()); B(0, zb=True)
        seq += list(wq)                                 # 8: the remaining W's
        ops.append(seq)
    ranks = tuple(list(range(p)) + list(reversed(range(p))))
    return Schedule("dualpipev", m, ranks, ops)


def from_torch(pipeline_order: dict, n_micro: int, name: str = "torch") -> Schedule:
    """A torch.distributed.pipelining schedule's `pipeline_order` ({rank: [action or None]})
    as a picolib Schedule: F → F, B (full backward) → BW, I (input) → B, W → W; overlapped
    F/B pairs are split into their two ops; communication actions are dropped."""
    kinds = {"F": "F", "B": "BW", "I": "B", "W": "W"}
    ops, stage_ranks = [[] for _ in pipeline_order], {}
    for r in sorted(pipeline_order):
        for a in pipeline_order[r]:
            for act in (a.sub_actions or (a,)) if a is not None else ():
                kind = kinds.get(act.computation_type.value)
                if kind is not None:
                    ops[r].append(Op(kind, act.stage_index, act.microbatch_index))
                    stage_ranks[act.stage_index] = r
    return Schedule(name, n_micro, tuple(stage_ranks[s] for s in range(len(stage_ranks))), ops)


SCHEDULES = {"afab": "any m ≥ 1", "1f1b": "any m ≥ 1",
             "interleaved": "v ≥ 2 and m a multiple of p",
             "zb_h1": "any m ≥ 1", "dualpipev": "m ≥ 2p"}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The named schedule for p ranks and m micro-batches (v chunks per rank for
    "interleaved"; "dualpipev" always has 2). Raises ValueError on numbers it cannot take."""
    if name not in SCHEDULES:
        needs = "; ".join(f"{k} ({v})" for k, v in SCHEDULES.items())
        raise ValueError(f"unknown schedule {name!r}; choose one of: {needs}")
    for what, x in (("p (ranks)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{what} must be a positive int, not {x!r}")
    if name == "interleaved":
        if v < 2:
            raise ValueError(f"interleaved needs v ≥ 2 chunks per rank, got v={v}")
        if m % p:
            raise ValueError(f"interleaved needs m to be a multiple of p: m={m}, p={p}")
        return interleaved_1f1b(p, m, v)
    if v != 1 and name != "dualpipev":
        raise ValueError(f"{name} has one stage per rank; v={v} is for 'interleaved'")
    if name == "dualpipev":
        if v not in (1, 2):
            raise ValueError(f"dualpipev always holds v=2 chunks per rank, got v={v}")
        if m < 2 * p:
            raise ValueError(f"dualpipev needs m ≥ 2p micro-batches: m={m}, p={p} (2p={2 * p})")
        return dualpipev(p, m)
    return {"afab": afab, "1f1b": one_f_one_b, "zb_h1": zb_h1}[name](p, m)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal time of (interleaved) 1F1B / AFAB with equal micro-batches:
    (p−1)/(v·m). v = 1 gives AFAB's and 1F1B's (p−1)/m."""
    return (p - 1) / (v * m)
