"""TeraPipe against a micro-batch pipeline, batch 1 (lesson 08).

    .venv/bin/python bench/terapipe.py           # writes bench/results/terapipe.json

One run, 2 and 4 gloo ranks (picolib.launch.run) on this machine's CPU; one sequence of
SEQ ∈ {512, 1024, 2048} tokens per step (batch 1). Three ways to run the step, each on the
same TinyLlama cut into p stages of n_layers/p blocks:

- 1f1b:        lesson 07's executor, one_f_one_b(p, m=1) — the only micro-batch there is;
- tp_uniform:  TeraPipe, the best uniform slicing by the cost model (M ∈ {2, 4, ..., 32});
- tp_dp:       TeraPipe, the DP's slicing (slices in multiples of SEQ/32 tokens).

`ratios`: the DP slicing's speed-up over each baseline (plain 1F1B, uniform slicing) at the
same p, sequence and stages, emulated, measured and predicted (baseline time / DP time).

The cost model t(l, c) is measured first, in this process, on one stage (fastest of 3
runs per (l, c)) and fitted (`fit_cost_model`); `predicted_s` = Σtᵢ + (K−1)·max tᵢ from it
(1f1b: one slice, p·t(SEQ, 0)). Two measurements per row:

- `measured_s`: wall-clock step time (barrier to barrier), median of STEPS steps, the three
  variants in alternating rounds. With p ranks on 2 shared cores the stages compete for
  the CPU, so at p = 4 this measures the machine more than the pipeline.
- `emulated_s`: one step with cost emulation (every op sleeps up to SCALE × its modelled
  cost; picolib.timeline), against `predicted_emulated_s` = SCALE × predicted_s: whether
  the executor achieves the schedule the formula assumes.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picolib.launch import run  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, random_tokens  # noqa: E402
from picolib.pipeline_parallel import run_schedule, split_stages  # noqa: E402
from picolib.pipeline_schedules import make_schedule  # noqa: E402
from picolib.terapipe import (FORWARD_SHARE, TeraPipePlan, measure_costs, run_terapipe,  # noqa: E402
                              terapipe_stage)
from picolib.terapipe_slicer import dp_slices, fit_cost_model, pipeline_latency, uniform_slices  # noqa: E402
from picolib.timeline import Timeline, makespan, merge  # noqa: E402
from _report import write  # noqa: E402

CFG = LlamaConfig(vocab_size=256, hidden=128, n_layers=4, n_heads=4, n_kv_heads=2,
                  ffn_hidden=256, max_seq=2048, attn_impl="sdpa")
SEQS, RANKS = (512, 1024, 2048), (2, 4)
STEPS, SCALE = 5, 8.0


def _cost_model(p: int, seq: int):
    torch.set_num_threads(1)
    grid = sorted({seq // 32 * k for k in (1, 2, 4, 8, 16, 32)})
    rows = measure_costs(TinyLlama(CFG), grid, [0, seq // 4, seq // 2, 3 * seq // 4],
                         layers=CFG.n_layers // p, repeats=3)
    torch.set_num_threads(2)
    return fit_cost_model(rows)


def _worker(p, seq, plans, cost):
    me = dist.get_rank()
    tokens, targets = random_tokens(1, seq, CFG.vocab_size, seed=0)
    model = TinyLlama(CFG)
    sched = make_schedule("1f1b", p, 1)
    pp_stage = split_stages(model, p)[me]
    tp = {}
    for name, slices in plans.items():
        plan = TeraPipePlan(slices, p, CFG.n_layers, seq=seq)
        tp[name] = (plan, terapipe_stage(TinyLlama(CFG), plan, me))

    def step(name, timeline=None):
        if name == "1f1b":
            t = cost(seq, 0)
            if timeline is not None:
                timeline.emulate = {"F": FORWARD_SHARE * t, "BW": (1 - FORWARD_SHARE) * t}
            run_schedule(sched, {me: pp_stage}, [tokens], [targets], timeline=timeline)
            pp_stage.zero_grad(set_to_none=True)
        else:
            plan, stage = tp[name]
            run_terapipe(plan, stage, tokens, targets, timeline=timeline,
                         cost=None if timeline is None else cost)
            stage.zero_grad(set_to_none=True)

    names = ["1f1b", *plans]
    wall = {n: [] for n in names}
    for i in range(STEPS + 1):
        for n in names:
            dist.barrier()
            t0 = time.perf_counter()
            step(n)
            dist.barrier()
            if i:                                   # the first round warms up
                wall[n].append(time.perf_counter() - t0)
    emulated = {}
    for n in names:
        tl = Timeline(emulate={})
        dist.barrier()
        step(n, tl)
        emulated[n] = tl.events
    return {n: statistics.median(v) for n, v in wall.items()}, emulated


def main():
    rows = []
    for p in RANKS:
        for seq in SEQS:
            fit = _cost_model(p, seq)
            unit = seq // 32
            dp, T_dp = dp_slices(seq, p, fit, unit=unit)
            uniform = {M: pipeline_latency(uniform_slices(seq, M), fit, p) for M in (2, 4, 8, 16, 32)}
            best_m = min(uniform, key=uniform.get)
            plans = {"tp_uniform": uniform_slices(seq, best_m), "tp_dp": dp}
            scaled = lambda l, c, fit=fit: SCALE * fit(l, c)
            t0 = time.perf_counter()
            results = run(_worker, p, p, seq, plans, scaled, timeout=1200)
            wall = results[0][0]
            events = {n: merge([r[1][n] for r in results]) for n in wall}
            predicted = {"1f1b": p * fit(seq, 0), "tp_uniform": uniform[best_m], "tp_dp": T_dp}
            slices = {"1f1b": [seq], **{k: list(v) for k, v in plans.items()}}
            for n in wall:
                rows.append({"name": f"{n}_{p}ranks_seq{seq}", "world_size": p, "seq": seq,
                             "batch": 1, "slices": slices[n],
                             "measured_s": round(wall[n], 5), "predicted_s": round(predicted[n], 5),
                             "emulated_s": round(makespan(events[n]), 5),
                             "predicted_emulated_s": round(SCALE * predicted[n], 5),
                             "speedup_vs_1f1b_measured": round(wall["1f1b"] / wall[n], 3),
                             "speedup_vs_1f1b_predicted": round(predicted["1f1b"] / predicted[n], 3),
                             "cost_model": {k: getattr(fit, k) for k in "abde"},
                             "timed_steps": STEPS, "emulation_scale": SCALE,
                             "torch": torch.__version__})
                r = rows[-1]
                print(f"{r['name']:28s} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
                      f"{r['predicted_s'] * 1e3:8.1f} ms  emulated {r['emulated_s']:.3f} s / "
                      f"{r['predicted_emulated_s']:.3f} s  slices {len(r['slices'])}", flush=True)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    ratios = []
    for p in RANKS:
        for seq in SEQS:
            r = {n: next(x for x in rows if x["name"] == f"{n}_{p}ranks_seq{seq}")
                 for n in ("1f1b", "tp_uniform", "tp_dp")}
            ratios.append({"world_size": p, "seq": seq, "variant": "tp_dp",
                           **{f"speedup_vs_{b}_{what}": round(r[b][key] / r["tp_dp"][key], 3)
                              for b in ("1f1b", "tp_uniform")
                              for what, key in (("emulated", "emulated_s"), ("measured", "measured_s"),
                                                ("predicted", "predicted_s"))}})
    write("terapipe", {"note": "one run on a shared, noisy 2-core machine: wall-clock rows measure "
                               "the machine; the emulated rows (ops sleep to their modelled cost) "
                               "measure the schedule",
                       "baseline": "1f1b: lesson 07's executor, one micro-batch (batch 1), the same "
                                   "stages; tp_uniform: the best uniform slicing by the cost model",
                       "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
