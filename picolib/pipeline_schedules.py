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

Most schedules are one pipeline: every micro-batch crosses stages 0..S-1. DualPipe runs two
pipelines at once (`Schedule.pipes`): stages 0..p−1 carry the first half of the
micro-batches from rank 0 to rank p−1, stages p..2p−1 (a second copy of the model) carry the
other half from rank p−1 back to rank 0. `Schedule.overlap[r]` marks the positions i where
ops i and i+1 of rank r form one overlapped "F&B" chunk (DeepSeek's forward of one
direction run together with a backward of the other): the executor runs them one after the
other, the simulator can time them as one chunk.

The generators: `afab` (GPipe), `one_f_one_b`, `interleaved_1f1b`, `zb_h1` (the Zero Bubble
paper's hand-made ZB-H1), `zb_greedy` (B, then F, then W, whichever is ready), `dualpipev`,
`dualpipe`; `make_schedule(name, p, m, v)` checks the numbers first; `idle_formula` and
`bubble_formula` are the published closed forms. The generators open the file; the
`Schedule` record follows them. Checking a schedule and playing it on ideal devices is
`pipeline_simulator.py`; running it on real ranks, `pipeline_parallel.py`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["Op", "Schedule", "afab", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_greedy",
           "dualpipev", "dualpipe", "SCHEDULES", "make_schedule", "bubble_formula",
           "idle_formula", "from_torch"]


@dataclass(frozen=True)
class Op:
    kind: str   # "F", "B", "W" or "BW"
    stage: int
    mb: int

    def __repr__(self):
        return f"{self.kind}(s{self.stage},mb{self.mb})"


# --------------------------------------------------------------------------- the generators

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
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): rank r holds v chunks, stages
    r, r+p, r+2p, ... 1F1B's loop over the rank's m·v chunk-ops: forwards go in rounds of p
    micro-batches through chunk 0, then chunk 1, ...; backwards in the same rounds from the
    last chunk down. Needs m to divide by p."""
    def forward(k, r):                          # rank r's k-th forward
        chunk, mb = (k // p) % v, (k // (p * v)) * p + k % p
        return Op("F", chunk * p + r, mb)

    def backward(k, r):                         # rank r's k-th backward: chunks in reverse
        chunk, mb = v - 1 - (k // p) % v, (k // (p * v)) * p + k % p
        return Op("BW", chunk * p + r, mb)

    ops = []
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * p, m * v)
        seq = [forward(k, r) for k in range(warm)]
        for i in range(m * v - warm):
            seq += [forward(warm + i, r), backward(i, r)]
        seq += [backward(i, r) for i in range(m * v - warm, m * v)]
        ops.append(seq)
    return Schedule("interleaved", m, tuple(s % p for s in range(p * v)), ops)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2.1): 1F1B with the
    backward split into B (∂L/∂x) and W (∂L/∂W), rank r's W's started r micro-batches late
    (lesson 07b §1). Idle per rank (p−1)(F+B−W) for W ≤ B; at most p micro-batches alive."""
    ops = []
    for r in range(p):
        seq, n = [], {"F": 0, "B": 0, "W": 0}     # ops of each kind so far: the next one's mb

        def run(*kinds):
            for kind in kinds:
                seq.append(Op(kind, r, n[kind]))
                n[kind] += 1

        for _ in range(min(p - r, m)):          # warm-up: 1F1B's p−1−r forwards and one more
            run("F")
        for _ in range(min(r, m - n["F"])):     # r rounds of B F: the W's start r late
            run("B", "F")
        while n["F"] < m:                       # steady state
            run("B", "W", "F")
        while n["B"] < m:                       # drain the backwards
            run("B", "W")
        while n["W"] < m:                       # the deferred W's fill the tail
            run("W")
        ops.append(seq)
    return Schedule("zb_h1", m, tuple(range(p)), ops)


def dualpipev_rank(p: int, m: int, r: int, stage: tuple, mbs: tuple):
    """Rank r's op list in DualPipeV (p ranks, m micro-batches) and the positions of its F&B
    pairs; chunk c is stage `stage[c]`, micro-batches `mbs[c]` (DualPipe passes its own)."""
    seq, pairs, f, b, wq = [], set(), [0, 0], [0, 0], deque()   # wq: the W's still to run

    def F(c):                                       # chunk c's next forward
        seq.append(Op("F", stage[c], mbs[c][f[c]])); f[c] += 1

    def B(c, split=False):                          # its next backward: BW, or B (W queued)
        seq.append(Op("B" if split else "BW", stage[c], mbs[c][b[c]]))
        if split:
            wq.append(Op("W", stage[c], mbs[c][b[c]]))
        b[c] += 1

    def W():                                        # the oldest queued W
        seq.append(wq.popleft())

    def FB(cf, cb):                                 # one overlapped F&B chunk
        pairs.add(len(seq)); F(cf); B(cb)

    for _ in range((p - r - 1) * 2):                # 1: forwards of chunk 0
        F(0)
    for _ in range(r + 1):                          # 2: F0 F1
        F(0); F(1)
    for _ in range(p - r - 1):                      # 3: B1 W F1 (zero bubble)
        B(1, split=True); W(); F(1)
    for i in range(m - 2 * p + r + 1):              # 4: steady: F0&B1, F1&B0
        if i == 0 and r == p - 1:                   # the turn rank's first: F0 then B1, not
            F(0); B(1)                              # overlapped (as DeepSeek's reference)
        else:
            FB(0, 1)
        FB(1, 0)
    for _ in range(p - r - 1):                      # 5: B1, F1&B0
        B(1); FB(1, 0)
    split = False
    for i in range(r + 1):                          # 6: B1 B0, the second half split
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        B(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        B(0, split)
    for _ in range(p - r - 1):                      # 7: W B0
        W(); B(0, split=True)
    while wq:                                       # 8: the remaining W's
        W()
    return seq, frozenset(pairs)


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek's "cut-in-half" DualPipe): 2p stages folded into a V, rank r holds
    stage r (chunk 0, going down) and 2p−1−r (chunk 1, coming back up). Needs m ≥ 2p."""
    ops, overlap = [], []
    for r in range(p):
        seq, pairs = dualpipev_rank(p, m, r, (r, 2 * p - 1 - r), (range(m), range(m)))
        ops.append(seq)
        overlap.append(pairs)
    ranks = tuple(list(range(p)) + list(reversed(range(p))))
    return Schedule("dualpipev", m, ranks, ops, overlap=overlap)


def dualpipe(p: int, m: int) -> Schedule:
    """DualPipe (DeepSeek-V3 technical report, §3.2.1): two pipelines, one copy of the model
    each. Micro-batches 0..m/2−1 go down stages 0..p−1 (ranks 0..p−1), m/2..m−1 up stages
    p..2p−1 (ranks p−1..0); ranks r and p−1−r hold the same layers (their gradients are summed,
    `pipeline_parallel.pair_gradient_groups`). Both run rank min(r, p−1−r)'s op order of a
    DualPipeV with p/2 ranks and m/2 micro-batches, each with its own stages. Needs p and m
    even, m ≥ 2p."""
    half, k = p // 2, m // 2
    down, up = range(0, k), range(k, m)
    ops, overlap = [], []
    for r in range(p):
        h = min(r, p - 1 - r)
        if r < half:   # chunk 0 = the down stage r, chunk 1 = the up stage that sits on r
            stage, mbs = (r, 2 * p - 1 - r), (down, up)
        else:          # the mirror: chunk 0 = the up stage, chunk 1 = the down stage r
            stage, mbs = (2 * p - 1 - r, r), (up, down)
        seq, pairs = dualpipev_rank(half, k, h, stage, mbs)
        ops.append(seq)
        overlap.append(pairs)
    ranks = tuple(list(range(p)) + list(reversed(range(p))))
    pipes = ((range(0, p), down), (range(p, 2 * p), up))
    return Schedule("dualpipe", m, ranks, ops, pipes=pipes, overlap=overlap)


# --------------------------------------------------------------------------- the record

@dataclass
class Schedule:
    name: str
    n_micro: int
    stage_ranks: tuple       # rank of each stage, in data-flow order
    ops: list                # ops[rank] = [Op, ...] in execution order
    pipes: tuple = None      # ((stages, micro-batches), ...); None: one pipeline, all of both
    overlap: list = field(default=None, repr=False)  # overlap[rank] = {i: ops i, i+1 are F&B}

    def __post_init__(self):
        if self.pipes is None:
            self.pipes = ((range(len(self.stage_ranks)), range(self.n_micro)),)
        if self.overlap is None:
            self.overlap = [frozenset() for _ in self.ops]

    def _pipe(self, stage: int):
        return next(pipe for pipe in self.pipes if stage in pipe[0])

    def is_first(self, stage: int) -> bool:
        """Does `stage` start its pipeline (it embeds the tokens)?"""
        return stage == self._pipe(stage)[0][0]

    def is_last(self, stage: int) -> bool:
        """Does `stage` end its pipeline (it computes the loss)?"""
        return stage == self._pipe(stage)[0][-1]

    def prev_stage(self, stage: int):
        """The stage whose output `stage` consumes (None for a first stage)."""
        return None if self.is_first(stage) else stage - 1

    def next_stage(self, stage: int):
        """The stage that consumes `stage`'s output (None for a last stage)."""
        return None if self.is_last(stage) else stage + 1

    def micro_batches(self, stage: int) -> range:
        """The micro-batches that pass through `stage`."""
        return self._pipe(stage)[1]

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
        """The stage's chunk on its rank: chunk 0 is the stage the data reaches first on that
        rank (the stage of its first op), chunk 1 the next (DualPipe's ranks p/2..p−1 meet
        their up stage first)."""
        rank = self.stage_ranks[stage]
        order = list(dict.fromkeys(op.stage for op in self.ops[rank]))
        order += [s for s in self.stages_of(rank) if s not in order]
        return order.index(stage)



# --------------------------------------------------------------------------- more generators

def zb_greedy(p: int, m: int) -> Schedule:
    """A greedy zero-bubble order (not the paper's ZB-H1): play the pipeline in unit steps
    (F = B = W = 1) and let each rank run, by priority, a ready B, else a ready F, else a W.
    Rank r keeps at most p−r micro-batches alive, as 1F1B. The W's only fill the cool-down:
    each rank idles (p−1)(F+B) with F = B = W, ⅔ of 1F1B's (p−1)(F+B+W); ZB-H1 reaches ⅓."""
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
    return Schedule("zb_greedy", m, tuple(range(p)), ops)


def from_torch(pipeline_order: dict, n_micro: int, name: str = "torch") -> Schedule:
    """A torch.distributed.pipelining schedule's `pipeline_order` ({rank: [action or None]})
    as a picolib Schedule: F → F, B (full backward) → BW, I (input) → B, W → W; overlapped
    F/B pairs are split into their two ops; communication actions are dropped."""
    kinds = {"F": "F", "B": "BW", "I": "B", "W": "W"}
    ops, stage_ranks = [[] for _ in pipeline_order], {}
    for r in sorted(pipeline_order):
        for a in pipeline_order[r]:
            for act in (getattr(a, "sub_actions", None) or (a,)) if a is not None else ():
                kind = kinds.get(act.computation_type.value)
                if kind is not None:
                    ops[r].append(Op(kind, act.stage_index, act.microbatch_index))
                    stage_ranks[act.stage_index] = r
    return Schedule(name, n_micro, tuple(stage_ranks[s] for s in range(len(stage_ranks))), ops)


SCHEDULES = {"afab": "any m ≥ 1", "1f1b": "any m ≥ 1",
             "interleaved": "v ≥ 2 and m a multiple of p",
             "zb_h1": "any m ≥ 1", "zb_greedy": "any m ≥ 1", "dualpipev": "m ≥ 2p",
             "dualpipe": "p even, m even and m ≥ 2p"}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The named schedule for p ranks and m micro-batches (v chunks per rank for
    "interleaved"; "dualpipe(v)" always has 2). Raises ValueError on numbers it cannot take."""
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
    if name in ("dualpipev", "dualpipe"):
        if v not in (1, 2):
            raise ValueError(f"{name} always holds v=2 chunks per rank, got v={v}")
        if name == "dualpipe" and (p % 2 or m % 2):
            raise ValueError(f"dualpipe needs an even p and an even m (half of the "
                             f"micro-batches per direction, ranks paired r ↔ p−1−r): p={p}, m={m}")
        if m < 2 * p:
            raise ValueError(f"{name} needs m ≥ 2p micro-batches: m={m}, p={p} (2p={2 * p})")
        return (dualpipev if name == "dualpipev" else dualpipe)(p, m)
    if v != 1:
        raise ValueError(f"{name} has one stage per rank; v={v} is for 'interleaved'")
    return {"afab": afab, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_greedy": zb_greedy}[name](p, m)


def idle_formula(name: str, p: int, cost: dict) -> float:
    """The published idle time per rank (for dualpipe(v): of the worst rank, with the F&B
    pairs timed as one chunk — simulate(overlap=True); equal to the op lists' count at
    F = B = W, with or without a speed-up F&B < F+B+W), in the simulator's terms: `cost` = {"F", "B", "W"[, "F&B"]} per op of
    one stage, B = the input-gradient half of the backward, W the weight half, F&B (default
    F + B + W, i.e. no overlap) an overlapped forward + full backward chunk.
      afab, 1f1b     (p−1)(F+B+W)                           (GPipe; Narayanan et al. 2021)
      interleaved    (p−1)(F+B+W) with costs of one chunk  (= 1/v of a stage of 1F1B)
      zb_h1          (p−1)(F+B−W)                           (Qi et al. 2024, for W ≤ B)
      dualpipe       (p/2−1)(F&B+B'−3W), B' = B+W          (DeepSeek-V3: B' = full backward)
      dualpipev      (p−1)(F&B+B'−3W): DualPipe of 2p stages on p ranks
    No formula for zb_greedy (None).

    DualPipeV counted on the op lists at F = B = W = c per op of its half-size stages
    (tests/lib/test_pipeline_dualpipe_bubble.py): idle (p−1)c when each op starts as soon as
    its own input is there (picolib's executor runs a pair so); 2(p−1)c when an F&B pair waits
    for both inputs (DeepSeek's overlapped chunk) — the formula with PP = 2p. With c half of a
    p-stage cut's op, the second is ZB-H1's (p−1)(F+B−W)."""
    F, B, W = cost["F"], cost["B"], cost["W"]
    FB = cost.get("F&B", F + B + W)
    full = B + W                                    # DeepSeek's B: the whole backward
    return {"afab": (p - 1) * (F + full), "1f1b": (p - 1) * (F + full),
            "interleaved": (p - 1) * (F + full), "zb_h1": (p - 1) * (F + B - W),
            "dualpipe": (p / 2 - 1) * (FB + full - 3 * W),
            "dualpipev": (p - 1) * (FB + full - 3 * W)}.get(name)


def bubble_formula(p: int, m: int, v: int = 1, schedule: str | None = None,
                   cost: dict | None = None) -> float:
    """Bubble time over ideal (busy) time, from the closed forms. Without `schedule`:
    (interleaved) 1F1B / AFAB with equal micro-batches, (p−1)/(v·m), for any costs. With
    `schedule` and `cost` (default F = B = W = 1, no F&B overlap): `idle_formula` over one
    rank's busy time, m(F+B+W) per stage it holds (v stages for interleaved, 2 for dualpipev,
    m/2 micro-batches through each of 2 for dualpipe). None where there is no formula."""
    if schedule is None:
        return (p - 1) / (v * m)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0, **(cost or {})}
    if "F&B" in cost:
        raise ValueError("bubble_formula assumes no overlap (F&B = F+B+W): with overlap the "
                         "ranks' busy times differ; use idle_formula for the worst rank")
    idle = idle_formula(schedule, p, cost)
    if idle is None:
        return None
    chunks = {"interleaved": v, "dualpipev": 2}.get(schedule, 1)
    return idle / (chunks * m * (cost["F"] + cost["B"] + cost["W"]))
