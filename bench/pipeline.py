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

Second part, rows `bubble_<schedule>_4ranks`: picolib alone, p = 4, m = 8, with cost
emulation (each op sleeps to a fixed cost, F = B = W = COST for a 2-block stage, BW = B + W,
half for half-size stages). Its "peer" is the simulator (ideal devices, same op lists and
costs): picolib_s / peer_s are the measured / simulated makespans, and `measured` /
`simulated` the bubble_ratio of each (goal: within 10 %); `simulated_with_comm` adds the
median hand-over time between ranks measured in the run (`comm_latency`).
"""
from __future__ import annotations

import json
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
from picolib.pipeline_parallel import run_schedule, split_stages  # noqa: E402
from picolib.pipeline_schedules import from_torch, make_schedule  # noqa: E402
from picolib.pipeline_simulator import comm_latency, simulate, validate  # noqa: E402
from picolib.timeline import Timeline, bubble_ratio, merge  # noqa: E402

CFG = LlamaConfig(vocab_size=256, hidden=128, n_layers=8, n_heads=4, n_kv_heads=2,
                  ffn_hidden=256, max_seq=64, attn_impl="sdpa")
M, MB, SEQ = 8, 4, 64
WARMUP, ROUND, ROUNDS = 2, 2, 8          # 2 + 16 timed steps per side
COST = 0.4                               # seconds per emulated op (bubble part): long enough that
                                         # the hand-over between ranks (a few ms here) stays small
OUT = ROOT / "bench" / "results" / "pipeline.json"
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


def bench_worker(p):
    from torch.distributed import pipelining as tpp
    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    tokens, targets = random_tokens(MB * M, SEQ, CFG.vocab_size, seed=0)
    rows = []
    for name, peer_name, v in ROWS:
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
        for _ in range(ROUNDS):
            pico += [_timed(pico_step) for _ in range(ROUND)]
            peer_t += [_timed(torch_step) for _ in range(ROUND)]
        a, b = statistics.median(pico), statistics.median(peer_t)
        rows.append({"name": f"{name}_{p}ranks", "picolib_s": round(a, 5), "peer_s": round(b, 5),
                     "ratio": round(a / b, 3), "world_size": p, "schedule_peer": peer_name,
                     "stages": n_stages, "micro_batches": M, "timed_steps": len(pico),
                     "params": param_count(CFG), "tokens_per_step": M * MB * SEQ,
                     "torch": torch.__version__})
    return rows


def bubble_worker(cases):
    rank, out = dist.get_rank(), {}
    tokens, targets = random_tokens(MB * 8, 16, CFG.vocab_size, seed=0)
    cfg = CFG.replace(hidden=32, ffn_hidden=64)
    for name, p, m, v in cases:
        model = TinyLlama(cfg)
        sched = make_schedule(name, p, m, v)
        mine = {s: st for s, st in enumerate(split_stages(model, sched.n_stages)) if s in sched.stages_of(rank)}
        args = (list(tokens[:2 * m].chunk(m)), list(targets[:2 * m].chunk(m)))
        run_schedule(sched, mine, *args)                         # warm-up
        k = sched.n_stages // p
        tl = Timeline(emulate={"F": COST / k, "B": COST / k, "W": COST / k, "BW": 2 * COST / k})
        dist.barrier()
        run_schedule(sched, mine, *args, timeline=tl)
        out[name] = tl.events
    return out


def main():
    rows = []
    for p in (2, 4):
        rows += run(bench_worker, p, p, timeout=600)[0]
    cases = [("afab", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb_h1", 4, 8, 1),
             ("dualpipev", 4, 8, 1)]
    events = run(bubble_worker, 4, cases, timeout=600)
    bubbles = []
    for name, p, m, v in cases:
        s = make_schedule(name, p, m, v)
        k = s.n_stages // p
        meas = bubble_ratio(merge([e[name] for e in events]))
        sim = bubble_ratio(simulate(s, {"F": COST / k, "B": COST / k, "W": COST / k}))
        ev_m = merge([e[name] for e in events])
        hop = comm_latency(ev_m, s)
        sim_c = bubble_ratio(simulate(s, {"F": COST / k, "B": COST / k, "W": COST / k, "comm": hop}))
        span_m = max(e["end"] for e in ev_m)
        span_s = max(e["end"] for e in simulate(s, {"F": COST / k, "B": COST / k, "W": COST / k}))
        bubbles.append({"name": f"bubble_{name}_4ranks", "picolib_s": round(span_m, 4),
                        "peer_s": round(span_s, 4), "ratio": round(span_m / span_s, 3),
                        "peer": "simulate() on ideal devices, same op lists and emulated costs",
                        "measured": round(meas, 4), "simulated": round(sim, 4),
                        "rel_diff": round(meas / sim - 1, 3), "comm_s": round(hop, 5),
                        "simulated_with_comm": round(sim_c, 4), "cost_s": COST, "micro_batches": m})
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(rows + bubbles, indent=1) + "\n")
    print("| schedule | picolib (s) | torch.distributed.pipelining (s) | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} ({r['schedule_peer']}) | {r['picolib_s']:.4f} | {r['peer_s']:.4f} | {r['ratio']:.2f} |")
    print("\n| schedule (p=4, m=8) | measured bubble | simulated | difference | simulated with measured hop |")
    print("|---|---|---|---|---|")
    for b in bubbles:
        print(f"| {b['name']} | {b['measured']:.3f} | {b['simulated']:.3f} | {b['rel_diff']:+.1%} | "
              f"{b['simulated_with_comm']:.3f} ({b['comm_s'] * 1e3:.1f} ms) |")


if __name__ == "__main__":
    main()
