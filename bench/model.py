"""picolib's model against transformers' Llama: one training step, side by side (issue 26).

    pip install -e ".[bench]"                    # transformers: this benchmark only
    .venv/bin/python bench/model.py              # writes bench/results/model.json (model_gpu.json on CUDA)

Both sides are the same network at the same shapes with the same weights: picolib's
`TinyLlama` and transformers' `LlamaForCausalLM` (SDPA attention, untied head), the
second loaded from the first. picolib turns RoPE pairs (x[2i], x[2i+1]) and Hugging Face
pairs (x[i], x[i + d/2]), so each head's rows of wq and wk are reordered on the way over
(the usual Meta → Hugging Face conversion); the logits and the loss of the two are
asserted equal in fp32 before anything is timed. A step is forward, the mean
cross-entropy of the logits (in fp32, the same line on both sides), backward and an AdamW
step. Both sides run in one process, in alternating rounds of ROUND steps, so a busy
neighbour on a shared machine slows both; each side reports the median step of its timed
steps. tokens/s = batch × sequence / median step. MFU = model FLOPs / step / peak, the
FLOPs by picolib's one convention (`picolib.plan_search.model_flops_per_token` × tokens: 6 ×
the parameters without the input embedding, plus causal attention), the peak being the GPU's dense bf16 datasheet peak (H100/H200: 989 TFLOP/s) or, on a CPU, the
measured fp32 matmul peak of one thread (`picolib.roofline.measure_peak`). Peak memory:
the side's weights and optimizer state plus the most one step allocates above what was
allocated before it (CUDA allocator; both models share the GPU); on a CPU, torch's
MemTracker over the step (every tensor storage alive at its peak, the allocator's caching
not included).

Shapes: on CUDA the issue's (h = 1024, 8 layers, 16 heads / 4 KV heads, FFN 2816,
vocabulary 32,000, batch 8 × 1024, bf16 weights, fused AdamW); on a CPU small ones
(below, fp32, one thread). Required: ratio picolib / transformers ≤ 1.0 (step time).
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from picolib.hardware import hardware  # noqa: E402
from picolib.plan_search import model_flops_per_token  # noqa: E402
from picolib.model import LlamaConfig, TinyLlama, param_count, random_tokens  # noqa: E402
from picolib.roofline import measure_peak  # noqa: E402

try:
    import transformers
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
except ImportError:
    sys.exit("bench/model.py needs transformers: pip install -e \".[bench]\"")

CUDA = torch.cuda.is_available()
if CUDA:
    CFG = LlamaConfig(vocab_size=32000, hidden=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                      ffn_hidden=2816, max_seq=1024, attn_impl="sdpa")
    BATCH, SEQ, DTYPE = 8, 1024, torch.bfloat16
    WARMUP, ROUND, ROUNDS = 3, 5, 4               # 3 + 20 timed steps per side
else:
    CFG = LlamaConfig(vocab_size=1024, hidden=256, n_layers=4, n_heads=8, n_kv_heads=2,
                      ffn_hidden=688, max_seq=256, attn_impl="sdpa")
    BATCH, SEQ, DTYPE = 4, 256, torch.float32
    WARMUP, ROUND, ROUNDS = 2, 3, 6               # 2 + 18 timed steps per side
DEVICE = torch.device("cuda" if CUDA else "cpu")
LR = 1e-4


# ----------------------------------------------------------------------- the two models

def hf_llama(model: TinyLlama) -> "LlamaForCausalLM":
    """transformers' Llama with `model`'s shapes and weights (q and k rows reordered)."""
    c = model.cfg
    hf = LlamaForCausalLM(HFConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden, intermediate_size=c.ffn_hidden,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.max_seq,
        rms_norm_eps=c.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
        use_cache=False, attn_implementation="sdpa"))

    def halves(w, heads):   # rows (2i, 2i+1) of each head → rows (i, i + d/2)
        d = c.head_dim
        return w.view(heads, d // 2, 2, -1).transpose(1, 2).reshape(heads * d, -1)

    ours = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
            "lm_head.weight": model.lm_head.weight}
    for i, blk in enumerate(model.blocks):
        at, mlp, pre = blk.attn, blk.mlp, f"model.layers.{i}."
        ours.update({pre + "self_attn.q_proj.weight": halves(at.wq.weight, c.n_heads),
                     pre + "self_attn.k_proj.weight": halves(at.wk.weight, c.n_kv_heads),
                     pre + "self_attn.v_proj.weight": at.wv.weight,
                     pre + "self_attn.o_proj.weight": at.wo.weight,
                     pre + "mlp.gate_proj.weight": mlp.w_gate.weight,
                     pre + "mlp.up_proj.weight": mlp.w_up.weight,
                     pre + "mlp.down_proj.weight": mlp.w_down.weight,
                     pre + "input_layernorm.weight": blk.attn_norm.weight,
                     pre + "post_attention_layernorm.weight": blk.mlp_norm.weight})
    state = hf.state_dict()
    assert sorted(k for k in state if "rotary" not in k) == sorted(ours), "parameter names differ"
    hf.load_state_dict({k: v.detach().clone() for k, v in ours.items()}, strict=False)
    return hf


def loss_of(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def check_equal(ours: TinyLlama, hf, x, y):
    """Logits and loss of the two models equal (fp32), before anything is timed."""
    with torch.no_grad():
        a, b = ours(x), hf(input_ids=x).logits
        gap = (a - b).abs().max().item()
        scale = a.abs().max().item()
        assert gap <= 1e-4 * max(1.0, scale), f"logits differ by {gap:.2e} (largest {scale:.2f})"
        lgap = (ours.loss(x, y) - loss_of(b, y)).abs().item()
        assert lgap <= 1e-5, f"losses differ by {lgap:.2e}"
    return gap, lgap


# ----------------------------------------------------------------------- timing

def sync():
    if CUDA:
        torch.cuda.synchronize()


def make_step(model, logits_of):
    fused = {"fused": True} if CUDA else {}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **fused)

    def step(x, y):
        loss_of(logits_of(model, x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, opt


def peak_bytes(step, x, y, held) -> int:
    """This side's weights and optimizer state + the most the step allocates above them (on
    CUDA both models share the GPU, so the other side's bytes are not counted)."""
    if CUDA:
        model, opt = held
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        own = sum(t.numel() * t.element_size() for t in (*model.parameters(), *state))
        sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(x, y)
        sync()
        return own + torch.cuda.max_memory_allocated() - before
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*held)
    with tracker:
        step(x, y)
    return int(tracker.get_tracker_snapshot("peak")[DEVICE]["Total"])


def main():
    warnings.filterwarnings("ignore")
    if not CUDA:
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = (t.to(DEVICE) for t in random_tokens(BATCH, SEQ, CFG.vocab_size, seed=0))
    ours = TinyLlama(CFG).to(DEVICE)
    hf = hf_llama(ours).to(DEVICE)
    gap, lgap = check_equal(ours, hf, x, y)
    print(f"logits equal within {gap:.1e}, losses within {lgap:.1e} (fp32)", flush=True)
    ours, hf = ours.to(DTYPE), hf.to(DTYPE)
    sides = {"picolib": make_step(ours, lambda m, t: m(t)),
             "transformers": make_step(hf, lambda m, t: m(input_ids=t).logits)}
    models = {"picolib": ours, "transformers": hf}
    times = {name: [] for name in sides}
    for name, (step, _) in sides.items():
        for _ in range(WARMUP):
            step(x, y)
    for _ in range(ROUNDS):
        for name, (step, _) in sides.items():
            for _ in range(ROUND):
                sync()
                t0 = time.perf_counter()
                step(x, y)
                sync()
                times[name].append(time.perf_counter() - t0)
    n = param_count(CFG)
    tokens = BATCH * SEQ
    if CUDA:
        gpu = torch.cuda.get_device_name()
        peak, peak_src = (hardware("H100-SXM").peak("bf16"), "H100/H200 SXM dense bf16 datasheet") \
            if ("H100" in gpu or "H200" in gpu) else (measure_peak(DTYPE, n=8192, device="cuda"),
                                                       "measured bf16 matmul")
    else:
        gpu, peak, peak_src = None, measure_peak(torch.float32, n=512), "measured fp32 matmul, 1 thread"
    rows = {}
    for name, (step, opt) in sides.items():
        med = statistics.median(times[name])
        held = [models[name], opt]
        rows[name] = {"step_s": round(med, 5), "tokens_per_s": round(tokens / med, 1),
                      "mfu": round(model_flops_per_token(CFG, SEQ) * tokens / med / peak, 4),
                      "peak_bytes": peak_bytes(step, x, y, held),
                      "steps": [round(t, 5) for t in times[name]]}
        print(name, {k: v for k, v in rows[name].items() if k != "steps"}, flush=True)
    ratio = rows["picolib"]["step_s"] / rows["transformers"]["step_s"]
    data = {"device": gpu or "cpu", "cuda": CUDA, "torch": torch.__version__,
            "transformers_version": transformers.__version__,
            "sizes": {"cfg": CFG.__dict__, "batch": BATCH, "seq": SEQ, "dtype": str(DTYPE),
                      "params": n},
            "peak_flops": peak, "peak_source": peak_src,
            "logits_max_gap_fp32": gap, "loss_gap_fp32": lgap,
            "picolib": rows["picolib"], "transformers": rows["transformers"],
            "ratio": round(ratio, 3),
            "memory_ratio": round(rows["picolib"]["peak_bytes"] / rows["transformers"]["peak_bytes"], 3)}
    name = "model_gpu" if CUDA else "model"     # each has its README table
    try:
        from _report import write
    except ImportError:   # before bench/_report.py exists
        import json
        out = ROOT / "results" / f"{name}.json"
        out.write_text(json.dumps(data, indent=1) + "\n")
    else:
        write(name, data)
    print(f"ratio picolib / transformers: {ratio:.3f} (required ≤ 1.0)")
    return 0 if ratio <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
