"""picolib's pipeline executor against torch.distributed.pipelining, side by side (lesson 07).

    .venv/bin/python bench/pipeline.py           # writes bench/results/pipeline.json

One run, 2 and 4 gloo ranks (picolib.launch.run) on this machine's CPU. Both sides cut the
same TinyLlama (below) into the same stages (picolib.pipeline_parallel.split_stages) and run
one training step (forward + backward of M micro-batches of MB × SEQ tokens, gradients
accumulated; no optimizer) with the same schedule family:

- 1f1b:        picolib one_f_one_b                       ↔ Schedule1F1B
- interleaved: picolib interleaved_1f1b, v = 2          ↔ ScheduleInterleaved1F1B
- zero bubble: torch's ScheduleInterleavedZeroBubble op lists (v = 2, split B/W), converted
               to a picolib Schedule and run by picolib's executor ↔ ScheduleInterleavedZeroBubble
- dualpipev:   picolib dualpipev                         ↔ ScheduleDualPipeV

Both sides of a row run in the same processes, in alternating rounds (picolib, torch,
picolib, ...), so a busy neighbour on the shared machine slows both. A step's time is from
a barrier to a barrier; a row reports the median over the timed steps. `ratio` =
picolib / peer.

Second part, the bubble: picolib alone, p = 4, m = 8, with cost emulation (each op sleeps
to a fixed cost, F = B = W = COST for a 2-block stage, BW = B + W, half for the half-size
stages of interleaved and DualPipeV), every schedule from AFAB to DualPipe. Its "peer" is the
simulator (ideal devices, the same op lists and costs), timing each op as the executor runs
it: an overlapped F&B pair of DualPipe(V) as its two ops one after the other
(`simulate(..., overlap=False)`). `measured` / `simulated` are the bubble_ratio of each;
`simulated_with_comm` adds the median hand-over time between ranks measured in the run
(`comm_latency`); `simulated_fb_chunk` times each F&B pair as one chunk that waits for both
inputs (DeepSeek's overlapped execution, `overlap=True`), which the closed form (`formula`)
counts. `replayed` is the simulator fed the run's own op durations (each op's measured
length: an emulated op lasts its cost plus whatever the loaded machine adds, `op_overrun_s`
its median) and hand-over time: the schedule the executor should have produced from the ops
it actually ran. The script fails (exit status 1, after writing the results) when a
schedule's measured bubble and its replay differ by more than TOLERANCE (5 %): the executor
added waits the op lists do not have, or the simulator counts the schedule wrong.
`--bubble-only` redoes the bubble part and keeps the side-by-side rows of the last run.

    .venv/bin/python bench/pipeline.py --only dualpipev --repeat 7

`--only NAME[,NAME]` redoes those side-by-side rows and keeps the others and the bubble part of
the last run; `--repeat N` times N alternating pairs of single steps (picolib, torch, picolib,
...) instead of ROUNDS rounds of ROUND, and a row adds the median of the N per-pair ratios, their
smallest and largest, and the machine's one-minute load average before and after the row.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picolib.launch import run  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, param_count, random_tokens  # noqa: E402
from picolib.pipeline_parallel import run_schedule, schedule_stages, split_stages  # noqa: E402
from picolib.pipeline_schedules import bubble_formula, from_torch, make_schedule  # noqa: E402
from _report import write  # noqa: E402
from picolib.pipeline_simulator import comm_latency, simulate, validate  # noqa: E402
from picolib.timeline import Timeline, bubble_ratio, merge  # noqa: E402

CFG = LlamaConfig(vocab_size=256, hidden=128, n_layers=8, n_heads=4, n_kv_heads=2,
                  ffn_hidden=256, max_seq=64, attn_impl="sdpa")
M, MB, SEQ = 8, 4, 64
WARMUP, ROUND, ROUNDS = 2, 2, 8          # 2 + 16 timed steps per side
COST = 1.0                               # seconds per emulated op (bubble part): long enough that
                                         # hand-overs and late wake-ups (ms) stay small beside it
TOLERANCE = 0.05                         # |measured / simulated − 1| allowed per schedule
BUBBLE_CASES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("dualpipev", 1),
                ("dualpipe", 1)]
ROWS = [("1f1b", "Schedule1F1B", 1), ("interleaved", "ScheduleInterleaved1F1B", 2),
        ("zero_bubble", "ScheduleInterleavedZeroBubble", 2), ("dualpipev", "ScheduleDualPipeV", 2)]


def _stage_ids(name, p, rank):
    if name == "1f1b":
        return [rank]
    if name == "dualpipev":
        return [rank, 2 * p - 1 - rank]
    return [rank, rank + p]                               # interleaved, looped


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _timed(step):
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def bench_worker(p, only=None, repeat=None):
    from torch.distributed import pipelining as tpp
    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    tokens, targets = random_tokens(MB * M, SEQ, CFG.vocab_size, seed=0)
    rows = []
    for name, peer_name, v in ROWS:
        if only is not None and name not in only:
            continue
        load0 = os.getloadavg()[0]
        n_stages = p * v
        ids = _stage_ids(name, p, rank)
        # torch side: its own copy of the model, the same stage split
        t_model = TinyLlama(CFG)
        t_all = split_stages(t_model, n_stages)
        t_stages = [tpp.PipelineStage(t_all[s], s, n_stages, torch.device("cpu")) for s in ids]
        cls = getattr(tpp, peer_name)
        peer = cls(t_stages[0] if v == 1 else t_stages, M, loss_fn=_loss)
        first, last = 0 in ids, n_stages - 1 in ids

        def torch_step():
            t_model.zero_grad(set_to_none=True)
            peer.step(*((tokens,) if first else ()), target=targets if last else None,
                      losses=[] if last else None)

        # picolib side
        sched = (validate(from_torch(peer.pipeline_order, M)) if name == "zero_bubble"
                 else make_schedule(name, p, M, v if name == "interleaved" else 1))
        assert sorted(sched.stages_of(rank)) == sorted(ids)
        p_model = TinyLlama(CFG)
        p_all = split_stages(p_model, n_stages)
        mine = {s: p_all[s] for s in ids}
        tok_mb, tgt_mb = list(tokens.chunk(M)), list(targets.chunk(M))

        def pico_step():
            p_model.zero_grad(set_to_none=True)
            run_schedule(sched, mine, tok_mb, tgt_mb)

        for _ in range(WARMUP):
            pico_step()
            torch_step()
        pico, peer_t = [], []
        for _ in range(repeat or ROUNDS):
            pico += [_timed(pico_step) for _ in range(1 if repeat else ROUND)]
            peer_t += [_timed(torch_step) for _ in range(1 if repeat else ROUND)]
        a, b = statistics.median(pico), statistics.median(peer_t)
        extra = {}
        if repeat:
            pairs = [x / y for x, y in zip(pico, peer_t)]
            extra = {"pair_ratio_median": round(statistics.median(pairs), 3),
                     "pair_ratio_min": round(min(pairs), 3), "pair_ratio_max": round(max(pairs), 3),
                     "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        rows.append({"name": f"{name}_{p}ranks", "picolib_s": round(a, 5), "peer_s": round(b, 5),
                     "ratio": round(a / b, 3), "world_size": p, "schedule_peer": peer_name,
                     "stages": n_stages, "micro_batches": M, "timed_steps": len(pico),
                     "params": param_count(CFG), "tokens_per_step": M * MB * SEQ,
                     "torch": torch.__version__, **extra})
    return rows


def _costs(sched, p):
    """Emulated seconds per op: COST for a stage of a p-stage cut, 1/k of it for k stages per
    rank (interleaved, DualPipeV); BW = B + W."""
    k = 1 if sched.name == "dualpipe" else sched.n_stages // p
    return {"F": COST / k, "B": COST / k, "W": COST / k, "BW": 2 * COST / k}


def bubble_worker(p, m):
    rank, out = dist.get_rank(), {}
    tokens, targets = random_tokens(MB * 8, 16, CFG.vocab_size, seed=0)
    cfg = CFG.replace(hidden=32, ffn_hidden=64)
    for name, v in BUBBLE_CASES:
        sched = make_schedule(name, p, m, v)
        stages = schedule_stages(TinyLlama(cfg), sched)
        mine = {s: st for s, st in stages.items() if s in sched.stages_of(rank)}
        args = (list(tokens[:2 * m].chunk(m)), list(targets[:2 * m].chunk(m)))
        run_schedule(sched, mine, *args)                         # warm-up
        tl = Timeline(emulate=_costs(sched, p))
        dist.barrier()
        run_schedule(sched, mine, *args, timeline=tl)
        out[name] = tl.events
    return out


def bubble_rows(p=4, m=8):
    events = run(bubble_worker, p, p, m, timeout=600)
    rows = []
    for name, v in BUBBLE_CASES:
        s = make_schedule(name, p, m, v)
        c = {k: _costs(s, p)[k] for k in ("F", "B", "W")}
        ev_m = merge([e[name] for e in events])
        hop = comm_latency(ev_m, s)
        sim = simulate(s, c, overlap=False)                       # as the executor runs it
        sim_c = simulate(s, c, overlap=False, comm=hop)
        took = {(e["name"], e["meta"]["stage"], e["meta"]["mb"]): e["end"] - e["start"] for e in ev_m}
        replay = simulate(s, lambda op: took[op.kind, op.stage, op.mb], overlap=False, comm=hop)
        meas, b_sim, b_sim_c = bubble_ratio(ev_m), bubble_ratio(sim), bubble_ratio(sim_c)
        b_replay = bubble_ratio(replay)
        formula = bubble_formula(p, m, v, schedule=name, cost=c)
        rows.append({"schedule": name, "measured": round(meas, 4), "simulated": round(b_sim, 4),
                     "simulated_with_comm": round(b_sim_c, 4), "comm_s": round(hop, 5),
                     "rel_diff": round(meas / b_sim - 1, 4),
                     "rel_diff_with_comm": round(meas / b_sim_c - 1, 4),
                     "replayed": round(b_replay, 4), "rel_diff_replayed": round(meas / b_replay - 1, 4),
                     "op_overrun_s": round(statistics.median(
                         took[op.kind, op.stage, op.mb] - _costs(s, p)[op.kind]
                         for seq in s.ops for op in seq), 5),
                     "simulated_fb_chunk": round(bubble_ratio(simulate(s, c)), 4),
                     "formula": None if formula is None else round(formula, 4),
                     "makespan_measured_s": round(max(e["end"] for e in ev_m), 4),
                     "makespan_simulated_s": round(max(e["end"] for e in sim), 4)})
        r = rows[-1]
        print(f"bubble {name:12s} measured {meas:.4f}  simulated {b_sim:.4f} ({r['rel_diff']:+.1%}), "
              f"with the measured hop {b_sim_c:.4f} ({r['rel_diff_with_comm']:+.1%}), replayed "
              f"{b_replay:.4f} ({r['rel_diff_replayed']:+.1%}); F&B as one chunk "
              f"{r['simulated_fb_chunk']:.4f}; formula {r['formula']}", flush=True)
    return {"p": p, "m": m, "cost_s": COST, "tolerance": TOLERANCE,
            "peer": "simulate() on ideal devices, same op lists and emulated costs", "rows": rows}


def _option(argv, flag, convert):
    if flag not in argv:
        return None
    i = argv.index(flag)
    if i + 1 == len(argv):
        sys.exit(f"{flag} needs a value")
    return convert(argv[i + 1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    only = _option(argv, "--only", lambda v: v.split(","))
    repeat = _option(argv, "--repeat", int)
    names = [name for name, _, _ in ROWS]
    if only is not None and set(only) - set(names):
        sys.exit(f"--only takes some of {names}, got {only}")
    if repeat is not None and repeat < 1:
        sys.exit(f"--repeat needs N ≥ 1, got {repeat}")
    if "--bubble-only" in argv or only is not None:   # keep the last run's other parts
        from _report import load
        last = load("pipeline")
    if "--bubble-only" in argv:
        rows = last["side_by_side"]
    else:
        rows = []
        for p in (2, 4):
            rows += run(bench_worker, p, p, only, repeat, timeout=900)[0]
    if only is not None:
        new = {r["name"]: r for r in rows}
        rows = [new.pop(r["name"], r) for r in last["side_by_side"]] + list(new.values())
        write("pipeline", {"side_by_side": rows, "bubble": last["bubble"]})
        return
    bubble = bubble_rows()
    write("pipeline", {"side_by_side": rows, "bubble": bubble})
    bad = [r for r in bubble["rows"] if abs(r["rel_diff_replayed"]) > TOLERANCE]
    if bad:
        sys.exit("measured and simulated bubbles differ by more than "
                 f"{TOLERANCE:.0%}: " + ", ".join(f"{r['schedule']} {r['measured']} vs "
                                                 f"{r['replayed']}" for r in bad))


if __name__ == "__main__":
    main()
