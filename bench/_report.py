"""One report path for every benchmark: write bench/results/NAME.json and print its tables.

    from _report import write          # in bench/NAME.py (bench/ is on sys.path when run)
    write("pipeline", data)            # bench/results/pipeline.json + the Markdown tables

`render(name, data)` turns a result file into the Markdown block that the README shows
between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; `tools/bench_tables.py` rewrites
those blocks from bench/results/*.json and tests/repo/test_bench_tables.py fails when a block
and its JSON disagree. So a number in the README's benchmark tables is never typed by hand:
change a renderer here, never the README's table.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2 ** 20


def write(name: str, data) -> Path:
    """Write bench/results/NAME.json and print the Markdown that the README shows for it."""
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwrote {path}\n")
    if name in RENDERERS:
        print(render(name, data))
    return path


def load(name: str):
    return json.loads((RESULTS / f"{name}.json").read_text())


def render(name: str, data=None) -> str:
    """The README block of result NAME (read from its JSON when `data` is None)."""
    return RENDERERS[name](load(name) if data is None else data).strip() + "\n"


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- one per result

def _launch(data):
    rows = [r for r in data if r["name"].startswith("allreduce_")]
    stall = next(r for r in data if r["name"] == "sequential_4ranks")
    t = _table(["ranks", "warm (s)", "first call (s)", "spawn (s)", "warm / spawn", "first / spawn"],
               [[r["world_size"], f"{r['picolib_s']:.3f}", f"{r['picolib_first_call_s']:.2f}",
                 f"{r['peer_s']:.2f}", f"{r['ratio']:.3f}", f"{r['first_ratio']:.2f}"] for r in rows])
    return (t + f"\n\n{stall['runs']} sequential 4-rank runs: median {stall['median_s']:.3f} s, "
                f"slowest {stall['max_s']:.3f} s, {stall['over_1s']} over 1 s.")


def _dp_zero(data):
    peers = {"DDP": "`DistributedDataParallel`", "ZeRO-1": "`ZeroRedundancyOptimizer`",
             "ZeRO-3": "FSDP2 `fully_shard`"}
    return _table(["picolib vs peer", "picolib (s)", "peer (s)", "ratio", "picolib peak bytes",
                   "peer peak bytes"],
                  [[f"{r['name']} vs {peers.get(r['name'], r.get('peer', 'peer'))}",
                    f"{r['picolib_s']:.3f}", f"{r['peer_s']:.3f}", f"{r['ratio']:.2f}",
                    f"{r['picolib_bytes']:,}", f"{r['peer_bytes']:,}"] for r in data])


def _tp_sp(data):
    return _table(["row", "picolib (s)", "DTensor (s)", "ratio", "picolib saved B/rank",
                   "DTensor saved B/rank"],
                  [[r["name"].replace("tp=", "tp = "), f"{r['picolib_s']:.3f}", f"{r['peer_s']:.3f}",
                    f"{r['ratio']:.2f}", f"{r['picolib_act_bytes']:,}", f"{r['peer_act_bytes']:,}"]
                   for r in data["rows"]])


_PIPE_NAMES = {"1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zero_bubble":
               "interleaved zero bubble", "dualpipev": "DualPipeV", "afab": "AFAB",
               "zb_h1": "ZB-H1", "dualpipe": "DualPipe"}


def _pipeline(data):
    side = {(r["name"].rsplit("_", 1)[0], r["world_size"]): r for r in data["side_by_side"]}
    names = list(dict.fromkeys(n for n, _ in side))
    worlds = sorted({w for _, w in side})
    head = ["schedule"] + [x for w in worlds for x in (f"{w} ranks: picolib / torch (s)", "ratio")]
    t1 = _table(head, [[_PIPE_NAMES[n]] + [x for w in worlds for x in (
        f"{side[n, w]['picolib_s']:.3f} / {side[n, w]['peer_s']:.3f}", f"{side[n, w]['ratio']:.2f}")]
        for n in names])
    repeated = [r for r in data["side_by_side"] if "pair_ratio_median" in r]
    if repeated:
        t1 += ("\n\nEvery row above was timed in alternating single steps (picolib, torch, picolib, ...); "
               "the ratio of each pair:\n\n" + _table(
                   ["schedule", "ranks", "pairs", "pair ratio: median", "smallest", "largest",
                    "load average (1 min), before → after"],
                   [[_PIPE_NAMES[r["name"].rsplit("_", 1)[0]], r["world_size"], r["timed_steps"],
                     f"{r['pair_ratio_median']:.2f}", f"{r['pair_ratio_min']:.2f}",
                     f"{r['pair_ratio_max']:.2f}",
                     f"{r['load_avg_1min'][0]:.1f} → {r['load_avg_1min'][1]:.1f}"] for r in repeated]))
    b = data["bubble"]
    t2 = _table([f"schedule (p = {b['p']}, m = {b['m']})", "measured bubble", "simulated (as executed)",
                 "difference", "replayed (the run's op times and hop)", "difference",
                 "simulated, F&B as one chunk", "closed form"],
                [[_PIPE_NAMES[r["schedule"]], f"{r['measured']:.4f}", f"{r['simulated']:.4f}",
                  f"{r['rel_diff']:+.1%}", f"{r['replayed']:.4f}", f"**{r['rel_diff_replayed']:+.1%}**",
                  f"{r['simulated_fb_chunk']:.4f}",
                  "—" if r["formula"] is None else f"{r['formula']:.4f}"] for r in b["rows"]])
    return (t1 + f"\n\nBubble of real runs with cost emulation ({b['cost_s']:g} s per op of a "
                 f"one-stage-per-rank cut) against the simulator, p = {b['p']}, m = {b['m']}; the "
                 f"run fails when a schedule's measured bubble and its replay differ by more than "
                 f"{b['tolerance']:.0%}:\n\n" + t2)


def _context_parallel(data):
    rows = data["rows"]
    keys = [("ring", "contiguous"), ("ring", "zigzag"), ("allgather", "zigzag"), ("ulysses", "zigzag")]
    cases = list(dict.fromkeys((r["seq"], r["cp"]) for r in rows))
    by = {(r["seq"], r["cp"], r["algorithm"], r["layout"]): r for r in rows}
    out = []
    for seq, cp in cases:
        rs = [by[seq, cp, a, l] for a, l in keys]
        out.append([f"{seq:,}", cp, f"{rs[0]['reference_s']:.3f}"]
                   + [f"{r['seconds']:.3f} ({r['vs_one_process']:.2f}×)" for r in rs]
                   + [" / ".join(f"{r['saved_bytes_per_rank'] / MiB:.1f}" for r in rs[1:]),
                      f"{rs[0]['reference_saved_bytes'] / MiB:.1f}"])
    t1 = _table(["seq", "cp", "one process (s)", "ring contiguous", "ring zig-zag", "all-gather",
                 "Ulysses", "saved MiB/rank (ring / all-gather / Ulysses)", "one process MiB"], out)
    t2 = _table(["seq", "cp", "ring / all-gather: step time", "saved bytes", "bytes sent",
                 "bytes sent per rank, ring / all-gather (ledger)"],
                [[f"{r['seq']:,}", r["cp"], f"{r['time_ratio']:.2f}", f"{r['saved_bytes_ratio']:.3f}",
                  f"{r['sent_bytes_ratio']:.3f}",
                  f"{by[r['seq'], r['cp'], 'ring', 'zigzag']['sent_bytes_per_rank']:,} / "
                  f"{by[r['seq'], r['cp'], 'allgather', 'zigzag']['sent_bytes_per_rank']:,}"]
                 for r in data["ratios"]])
    return t1 + "\n\nRing (zig-zag) against the all-gather K/V baseline at equal shapes:\n\n" + t2


def _terapipe(data):
    rows = {r["name"]: r for r in data["rows"]}
    out = []
    for q in data["ratios"]:
        p, seq = q["world_size"], q["seq"]
        one, uni, dp = (rows[f"{n}_{p}ranks_seq{seq}"] for n in ("1f1b", "tp_uniform", "tp_dp"))
        out.append([p, f"{seq:,}", f"{len(uni['slices'])} / {len(dp['slices'])}",
                    f"{one['emulated_s']:.2f} / {uni['emulated_s']:.2f} / {dp['emulated_s']:.2f}",
                    f"{dp['emulated_s'] / dp['predicted_emulated_s']:.2f}",
                    f"**{q['speedup_vs_1f1b_emulated']:.2f}**", f"**{q['speedup_vs_tp_uniform_emulated']:.2f}**",
                    f"{1e3 * one['measured_s']:.0f} / {1e3 * uni['measured_s']:.0f} / {1e3 * dp['measured_s']:.0f}",
                    f"{q['speedup_vs_1f1b_measured']:.2f}", f"{q['speedup_vs_tp_uniform_measured']:.2f}"])
    return _table(["p", "seq", "slices uniform / DP", "emulated s: 1F1B / uniform / DP",
                   "DP emulated / predicted", "DP vs 1F1B (emulated)", "DP vs uniform (emulated)",
                   "wall ms: 1F1B / uniform / DP", "DP vs 1F1B (wall)", "DP vs uniform (wall)"], out)


def _moe(data):
    rows = {(r["ep"], r["top_k"], r["dispatcher"]): r for r in data["rows"]}
    t1 = _table(["row", "s/step", "one process s/step", "ratio", "bytes sent/rank/step (ring formula)"],
                [[r["name"].replace("alltoall", "all-to-all").replace("allgather", "all-gather"),
                  f"{r['step_s']:.3f}", f"{r['one_process_s']:.3f}", f"{r['vs_one_process']:.2f}",
                  f"{r['sent_bytes_per_rank_mean']:,}"] for r in data["rows"]])
    t2 = _table(["ep", "top-k", "all-to-all / all-gather: step time", "bytes sent"],
                [[r["ep"], r["top_k"], f"{r['time_ratio']:.2f}", f"{r['bytes_ratio']:.3f}"]
                 for r in data["ratios"]])
    return t1 + "\n\nAll-to-all dispatch against the all-gather baseline at equal shapes:\n\n" + t2


def _train_5d(data):
    t1 = _table(["configuration", "step ms", "tokens/s", "state MiB/rank", "sent MiB/rank"],
                [[r["name"], f"{1e3 * r['step_s']:.0f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['state_bytes'] / MiB:.1f}", f"{r['sent_bytes'] / MiB:.1f}"]
                 for r in data["configs"]])
    s = data["side_by_side"]
    t2 = _table(["4 ranks, ZeRO-3 dp 2 × TP tp 2", "s/step", "tokens/s"],
                [["picolib trainer", f"{s['picolib_s']:.2f}", f"{s['picolib_tokens_per_s']:,.0f}"],
                 ["FSDP2 `fully_shard` + DTensor TP", f"{s['native_s']:.2f}",
                  f"{s['native_tokens_per_s']:,.0f}"],
                 ["**ratio** picolib / PyTorch", f"**{s['ratio']:.2f}**", ""]])
    return (t1 + "\n\n" + t2 + f"\n\nLosses of the two sides equal within {s['max_loss_gap']:.1e} "
                 f"(asserted ≤ {s['loss_tolerance']:g}).")


def _model(data):
    c, z = data["sizes"]["cfg"], data["sizes"]
    rows = [[label, f"{1e3 * r['step_s']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.3f}",
             f"{r['peak_bytes'] / MiB:,.1f}"]
            for label, r in (("picolib `TinyLlama`", data["picolib"]),
                             ("transformers `LlamaForCausalLM`", data["transformers"]))]
    rows.append(["**ratio** picolib / transformers", f"**{data['ratio']:.2f}**", "", "",
                 f"{data['memory_ratio']:.2f}"])
    where = (f"{data['device']} (torch {data['torch']}, transformers {data['transformers_version']})"
             if data["cuda"] else "CPU, one thread")
    head = (f"{where}: h = {c['hidden']}, {c['n_layers']} layers, {c['n_heads']} heads / "
            f"{c['n_kv_heads']} KV heads, FFN {c['ffn_hidden']}, vocabulary {c['vocab_size']:,}, "
            f"batch {z['batch']} × {z['seq']}, {z['dtype'].replace('torch.', '')}, SDPA, AdamW, "
            f"{z['params']:,} parameters.")
    return (head + "\n\n" + _table(["one training step", "median ms", "tokens/s", "MFU", "peak MiB"], rows)
            + f"\n\nLogits equal within {data['logits_max_gap_fp32']:.1e} and losses within "
              f"{data['loss_gap_fp32']:.1e} in fp32 (asserted before timing); MFU against the "
              f"{data['peak_source']} peak ({data['peak_flops'] / 1e12:,.2f} TFLOP/s).")


def _train_gpu(data):
    c, z = data["sizes"]["cfg"], data["sizes"]
    rows = [[f"{r['name']}{', compiled' if r['compiled'] else ''}", r["batch"],
             f"{1e3 * r['step_s']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.3f}",
             f"{r['peak_bytes'] / MiB:,.1f}", f"{r['ratio']:.2f}"] for r in data["rows"]]
    where = (f"{data['device']} (torch {data['torch']})" if data["cuda"] else "CPU, one thread")
    head = (f"{where}: the {data['preset']} preset (h = {c['hidden']}, {c['n_layers']} layers, "
            f"{c['n_heads']} heads / {c['n_kv_heads']} KV heads, FFN {c['ffn_hidden']}, vocabulary "
            f"{c['vocab_size']:,}), sequence {z['seq']}, {z['dtype']}, median of {z['timed']} steps "
            f"after {z['warmup']}" + ("" if data["transformers_version"] else
                                     "; transformers not installed: no transformers rows") + ".")
    return (head + "\n\n" + _table(["one training step", "batch", "median ms", "tokens/s", "MFU",
                                    "peak MiB", "step / model alone"], rows)
            + f"\n\nMFU by `model_flops_per_token` against a peak of "
              f"{data['peak_flops'] / 1e12:,.2f} TFLOP/s ({data['peak_source']}).")


def _bf16_recipe(data):
    c = data["cfg"]
    rows = [[f"{name}", f"{1e3 * s:.1f}"] for name, s in data["step_s"].items()]
    rows.append(["**ratio** compute copies / autocast", f"**{data['ratio']:.2f}**"])
    head = (f"{data['device']} (torch {data['torch']}): h = {c['hidden']}, {c['n_layers']} layers, "
            f"FFN {c['ffn_hidden']}, vocabulary {c['vocab_size']}, batch {data['batch']} × "
            f"{data['seq']}, {data['params']:,} parameters; DDP on one rank, AdamW; median of "
            f"{data['steps']} alternating steps after {data['warmup']}.")
    return head + "\n\n" + _table(["one bf16 training step", "median ms"], rows)


RENDERERS = {"train_gpu": _train_gpu, "train_cpu": _train_gpu, "model": _model, "model_gpu": _model, "launch": _launch, "dp_zero": _dp_zero, "tp_sp": _tp_sp, "pipeline": _pipeline,
             "context_parallel": _context_parallel, "terapipe": _terapipe, "moe": _moe,
             "train_5d": _train_5d, "bf16_recipe": _bf16_recipe}
