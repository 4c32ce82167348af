"""The trainer's step against the model alone at the same shapes, eager and compiled (issue 49.5).

    .venv/bin/python bench/train_gpu.py      # bench/results/train_gpu.json on CUDA, train_cpu.json on a CPU

Three sides, each in its own one-rank process (`picolib.launch.run`, NCCL on a GPU, gloo on a
CPU), each timed over the same steps after the same warm-up:
- the model alone: `TinyLlama`, forward, loss, backward, an AdamW step (fused on CUDA, with
  bf16 weights there as bench/model.py does; no clipping, no data-parallel wrapper);
- the trainer: `picolib.train.train` on one process, random tokens, one micro-batch, its
  defaults otherwise (DDP wrapper, clipping at 1.0, weight decay; on CUDA `--precision bf16`:
  DDP's bf16 compute copies of fp32 masters); its step is the `seconds` each record logs;
- transformers' `LlamaForCausalLM` at the same shapes (random weights), when installed.
Each side runs eager and with its blocks compiled (`picolib.compose.compile_blocks`, the
trainer's `--compile`; transformers: `Module.compile` of each decoder layer).

tokens/s = batch × sequence / median step. MFU by picolib's one convention
(`picolib.plan_search.model_flops_per_token`: 6 × parameters without the input embedding,
plus causal attention) against the GPU's dense bf16 datasheet peak (H100/H200: 989 TFLOP/s)
or, on a CPU, the measured fp32 matmul peak of one thread (the fastest of the measurements in
the main process and after each side, in its process). Peak memory: on CUDA the
allocator's peak in the side's process; on a CPU parameters, gradients and optimizer state
plus the peak of the activations saved for backward (`picolib.memory.SavedActivations`; the
trainer logs the same two numbers).

Shapes: on CUDA the 150m preset (145 M parameters, SDPA), batch 8 and 16 × 1024; on a CPU the
small preset, batch 8 × 64, fp32, one thread.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from picolib.compose import compile_blocks  # noqa: E402
from picolib.hardware import hardware  # noqa: E402
from picolib.launch import run  # noqa: E402
from picolib.memory import SavedActivations  # noqa: E402
from picolib.model import TinyLlama, random_tokens  # noqa: E402
from picolib.plan_search import model_flops_per_token  # noqa: E402
from picolib.roofline import measure_peak  # noqa: E402
from picolib.train import TrainConfig, train  # noqa: E402

CUDA = torch.cuda.is_available()
PRESET, SEQ, BATCHES = ("150m", 1024, (8, 16)) if CUDA else ("small", 64, (8,))
WARMUP, TIMED = (5, 20) if CUDA else (3, 10)


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _state_bytes(model, opt) -> int:
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *grads, *state))


def _time_loop(model, batch, logits_of=None) -> dict:
    """A plain training loop on this process's device: median step, peak bytes."""
    if not CUDA:
        torch.set_num_threads(1)
    device = torch.device("cuda" if CUDA else "cpu")
    x, y = (t.to(device) for t in random_tokens(batch, SEQ, model_vocab(model), seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if CUDA else {}))

    def step():
        if logits_of is None:
            loss = model.loss(x, y)
        else:
            loss = torch.nn.functional.cross_entropy(logits_of(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = []
    for i in range(WARMUP + TIMED):
        if CUDA and i == WARMUP:
            torch.cuda.reset_peak_memory_stats()
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    if CUDA:
        peak = torch.cuda.max_memory_allocated()
    else:
        with SavedActivations() as act:
            step()
        peak = _state_bytes(model, opt) + act.peak
    return {"step_s": statistics.median(times[WARMUP:]), "peak_bytes": int(peak)}


def model_vocab(model) -> int:
    return model.config.vocab_size if hasattr(model, "config") else model.cfg.vocab_size


def _model_alone(cfg, batch, compiled):
    device = torch.device("cuda" if CUDA else "cpu")
    model = TinyLlama(cfg).to(device, torch.bfloat16 if CUDA else torch.float32)
    if compiled:
        compile_blocks({0: model})
    return _time_loop(model, batch)


def _transformers(cfg, batch, compiled):
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    device = torch.device("cuda" if CUDA else "cpu")
    hf = LlamaForCausalLM(HFConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa")).to(device, torch.bfloat16 if CUDA else torch.float32)
    if compiled:
        for layer in hf.model.layers:
            layer.compile()
    return _time_loop(hf, batch, lambda x: hf(input_ids=x).logits)


def _trainer(cfg: TrainConfig):
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    records = train(cfg)[WARMUP:]
    peak = torch.cuda.max_memory_allocated() if CUDA else max(r["state_bytes"] + r["activation_bytes"]
                                                              for r in records)
    return {"step_s": statistics.median(r["seconds"] for r in records), "peak_bytes": int(peak)}


def _measured(fn, *args):
    """`fn(*args)`'s timings, and on a CPU this process's matmul peak right after them: the
    run's peak is the fastest any side's process measured (a loaded machine lowers it)."""
    out = fn(*args)
    out["peak_flops"] = 0.0 if CUDA else measure_peak(torch.float32, n=512)
    return out


def main():
    warnings.filterwarnings("ignore")
    backend = "nccl" if CUDA else "gloo"
    if CUDA:
        device, peak, peak_src = torch.cuda.get_device_name(), hardware("H100-SXM").peak("bf16"), \
            "H100/H200 SXM dense bf16 datasheet"
    else:
        torch.set_num_threads(1)
        device, peak, peak_src = "cpu", measure_peak(torch.float32, n=512), "fastest measured fp32 matmul (1 thread) of the run"
    try:
        import transformers
        version = transformers.__version__
    except ImportError:
        version = None
    rows = []
    for batch in BATCHES:
        tcfg = TrainConfig(preset=PRESET, batch=batch, seq=SEQ, steps=WARMUP + TIMED, data="random",
                           progress=False, precision="bf16" if CUDA else "fp32",
                           peak_tflops=peak / 1e12)
        mcfg = tcfg.model_config()
        flops = model_flops_per_token(mcfg, SEQ) * batch * SEQ
        for compiled in (False, True):
            sides = {"picolib model alone": (_model_alone, (mcfg, batch, compiled)),
                     "picolib trainer": (_trainer, (TrainConfig(**{**tcfg.__dict__, "compile": compiled}),))}
            if version:
                sides["transformers LlamaForCausalLM"] = (_transformers, (mcfg, batch, compiled))
            for name, (fn, args) in sides.items():
                r = run(_measured, 1, fn, *args, backend=backend, timeout=1200)[0]
                peak = max(peak, r["peak_flops"])
                row = {"name": name, "batch": batch, "compiled": compiled,
                       "step_s": round(r["step_s"], 6),
                       "tokens_per_s": round(batch * SEQ / r["step_s"], 1),
                       "flops": flops, "peak_bytes": r["peak_bytes"]}
                print(row, flush=True)
                rows.append(row)
    for row in rows:        # each side against the model alone at the same batch and mode
        alone = next(r for r in rows if r["name"] == "picolib model alone"
                     and (r["batch"], r["compiled"]) == (row["batch"], row["compiled"]))
        row["ratio"] = round(row["step_s"] / alone["step_s"], 3)
        row["mfu"] = round(row.pop("flops") / row["step_s"] / peak, 4)
    data = {"device": device, "cuda": CUDA, "torch": torch.__version__,
            "transformers_version": version, "preset": PRESET,
            "sizes": {"cfg": mcfg.__dict__, "seq": SEQ, "batches": list(BATCHES),
                      "dtype": "bf16" if CUDA else "fp32", "warmup": WARMUP, "timed": TIMED},
            "peak_flops": peak, "peak_source": peak_src, "rows": rows}
    from _report import write
    write("train_gpu" if CUDA else "train_cpu", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
