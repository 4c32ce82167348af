"""The roofline of one accelerator, and where each operation of a training step sits on it
(lesson 12).

An operation that does F floating-point operations and moves B bytes between the processor
and its main memory cannot finish faster than

    t = max(F / peak, B / bandwidth)

(peak FLOP/s of the arithmetic units, bandwidth in bytes/s). Its *arithmetic intensity*
I = F / B decides which term wins: below the ridge point peak / bandwidth an operation is
memory-bound (the processor waits for bytes), above it compute-bound. The best FLOP/s it can
reach is min(peak, I · bandwidth): that line is the roofline. The planner's per-shape compute
efficiency (lesson 11) is this same formula evaluated on a GPU's datasheet figures.

What this file gives:
- `attainable`, `op_time`, `ridge` — the formula;
- `measure_peak`, `measure_bandwidth` — this machine's two numbers, measured (a large matmul,
  a large copy; best of several runs, because a shared machine only ever slows a run down);
- `StepProfile` — one training step recorded operation by operation: FLOPs from
  `torch.utils.flop_counter` (matmuls; other operations count one FLOP per output element, a
  stated convention), bytes from the tensors each operation reads and writes (views move
  nothing), and time from `torch.profiler` (each operation runs inside a labelled
  `record_function`), grouped into the kinds of work a transformer step does;
- `layer_ops`, `head_ops`, `op_seconds` — the same groups predicted instead of measured: the
  operations of one transformer block with their FLOPs and bytes, priced on a hardware
  preset's roofline with its measured fractions (what the planner's step time adds up,
  lesson 11b; tests/lib/test_validation.py checks the matmul FLOPs against a real step);
- `draw_roofline` — the picture;
- `CHIPS`, `tensor_peak` — what is inside NVIDIA's data-centre GPUs, V100 to B200: the
  architecture (SMs, Tensor Core FLOPs per cycle per SM, the clock NVIDIA's peak figures
  assume) kept apart from the datasheet's peak, HBM and NVLink figures, so a lesson can
  compute one from the other instead of restating it.
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

__all__ = ["attainable", "op_time", "ridge", "measure_peak", "measure_bandwidth", "GROUPS",
           "MLAShape", "layer_ops", "embedding_ops", "mtp_ops", "head_ops", "op_seconds",
           "StepProfile", "profile_step", "draw_roofline", "CHIPS", "tensor_peak"]

# the kinds of work one step of the tiny Llama does, in the order the lesson shows them
GROUPS = ("matmuls", "norms", "SwiGLU elementwise", "softmax and mask", "RoPE and reshapes",
          "residual adds", "loss and embedding", "optimizer")
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_mm"}


def attainable(intensity: float, peak: float, bandwidth: float) -> float:
    """The highest FLOP/s an operation of `intensity` FLOPs per byte can reach."""
    return min(peak, intensity * bandwidth)


def op_time(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """The roofline's lower bound on an operation's time, in seconds."""
    return max(flops / peak, nbytes / bandwidth)


def ridge(peak: float, bandwidth: float) -> float:
    """The intensity (FLOPs per byte) where memory-bound turns compute-bound."""
    return peak / bandwidth


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _best(fn, reps: int, device) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peak(dtype=torch.float32, n: int = 512, reps: int = 5, device="cpu") -> float:
    """FLOP/s of an n×n×n matmul (2n³ FLOPs), the best of `reps` runs."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    inner = 1 if torch.device(device).type == "cpu" else 20
    t = _best(lambda: [a @ b for _ in range(inner)], reps, device)
    return 2 * n ** 3 * inner / t


def measure_bandwidth(dtype=torch.float32, nbytes: int = 64 * 2**20, reps: int = 5,
                      device="cpu") -> float:
    """Bytes/s of copying `nbytes` (larger than the caches): a copy reads and writes them."""
    x = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    y = torch.empty_like(x)
    t = _best(lambda: y.copy_(x), reps, device)
    return 2 * x.numel() * x.element_size() / t


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def group_of(op: str, module: str, optimizer: bool) -> str:
    """The kind of work an operation does, from its name and the module that ran it."""
    if op in MATMULS:
        return "matmuls"
    if optimizer:
        return "optimizer"
    if module.endswith("norm"):
        return "norms"
    if module.endswith(".core"):
        return "softmax and mask"
    if module.endswith(".mlp"):
        return "SwiGLU elementwise"
    if module.endswith(".attn"):
        return "RoPE and reshapes"
    if re.search(r"blocks\.\d+$", module):
        return "residual adds"
    return "loss and embedding"


class _Modules(TorchFunctionMode):
    """Forward: remember which module made each autograd node, so that the backward's
    operations (run by that node) are put in the same group."""

    def __init__(self, tracker, nodes):
        super().__init__()
        self.tracker, self.nodes = tracker, nodes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.grad_fn is not None and t.grad_fn not in self.nodes:
                self.nodes[t.grad_fn] = max(self.tracker.parents, key=len, default="")
        return out


class StepProfile(TorchDispatchMode):
    """Records every operation below autograd: its group, FLOPs and bytes; on the CPU each
    runs inside `record_function("[group]")` so torch.profiler times the groups; on a GPU
    each is timed between two synchronisations."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.tracker, self.nodes = ModuleTracker(), {}
        self.flops, self.bytes = defaultdict(float), defaultdict(float)
        self.counts, self.seconds = defaultdict(int), defaultdict(float)
        self.optimizer = False
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.recording:
            return func(*args, **kwargs)
        op = func._overloadpacket.__name__
        node = torch._C._current_autograd_node()
        module = self.nodes.get(node, "") if node is not None else max(self.tracker.parents, key=len, default="")
        group = group_of(op, module, self.optimizer)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            torch.cuda.synchronize()
            self.seconds[group] += time.perf_counter() - t0
        else:
            with torch.profiler.record_function(f"[{group}]"):
                out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out                      # a view moves no bytes and does no arithmetic
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            flops = sum(t.numel() for t in _tensors(out))     # convention: 1 per output element
        self.flops[group] += flops
        self.bytes[group] += _nbytes(args) + _nbytes(list(kwargs.values())) + _nbytes(out)
        self.counts[group] += 1
        return out

    def table(self) -> dict:
        """{group: {"flops", "bytes", "seconds", "ops"}} in GROUPS order (groups that ran)."""
        return {g: {"flops": self.flops[g], "bytes": self.bytes[g], "seconds": self.seconds[g],
                    "ops": self.counts[g]} for g in GROUPS if self.counts[g]}


@contextmanager
def _quiet_stderr():
    """The profiler's C++ side announces every start and stop on file descriptor 2; hide
    those two lines (Python's own errors still reach sys.stderr afterwards)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_step(model, tokens, targets, optimizer, steps: int = 3) -> dict:
    """Run `steps` training steps (forward, backward, optimizer step, zero_grad) of `model`
    under `StepProfile`, and return the last step's table: per group FLOPs, bytes, the
    number of operations, and seconds (torch.profiler on the CPU, synchronised wall time on a
    GPU; the fastest of the steps for each group)."""
    device = next(model.parameters()).device
    best = None
    for _ in range(steps):
        prof = StepProfile(device)
        with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            with prof:
                with prof.tracker, _Modules(prof.tracker, prof.nodes):
                    loss = model.loss(tokens, targets)
                loss.backward()
                prof.optimizer = True
                optimizer.step()
                optimizer.zero_grad()
        if device.type != "cuda":
            for e in p.key_averages():
                if e.key.startswith("[") and e.key[1:-1] in GROUPS:
                    prof.seconds[e.key[1:-1]] = e.cpu_time_total / 1e6
        table = prof.table()
        if best is None:
            best = table
        else:
            for g, row in table.items():
                best[g]["seconds"] = min(best[g]["seconds"], row["seconds"])
    return best


COLORS = {"matmuls": "#1f77b4", "norms": "#2ca02c", "SwiGLU elementwise": "#ff7f0e",
          "softmax and mask": "#9467bd", "RoPE and reshapes": "#8c564b", "residual adds": "#e377c2",
          "loss and embedding": "#7f7f7f", "optimizer": "#d62728"}


def draw_roofline(ax, peak: float, bandwidth: float, points: dict | None = None,
                  label: str = "", color="k", title: str | None = None, marker="o"):
    """Draw the roofline min(peak, I·bandwidth) on log-log axes (GFLOP/s against FLOPs per
    byte) and the `points` {name: (intensity, FLOP/s)} on it. Draws into `ax`, returns it."""
    lo, hi = 1e-2, 1e4
    xs = [lo, ridge(peak, bandwidth), hi]
    ax.plot(xs, [attainable(x, peak, bandwidth) / 1e9 for x in xs], color=color, lw=1.6,
            label=label or None)
    for name, (intensity, rate) in (points or {}).items():
        ax.scatter(intensity, rate / 1e9, s=45, marker=marker, color=COLORS.get(name, color),
                   edgecolor="k", lw=0.5, zorder=3, label=name)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte)",
           ylabel="GFLOP/s")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# ----------------------------------------------------------------- inside one GPU (lesson 12)
# Two sources per chip, kept apart. Architecture (NVIDIA's Volta, Ampere and Hopper
# whitepapers): SMs, dense 16-bit Tensor Core FLOPs per cycle per SM (an FMA counts 2: V100
# 8 Tensor Cores x 64 FMAs, A100 4 x 256, H100 4 x 512), and the clock NVIDIA's peak tensor
# figures assume (V100 SXM2 and A100 SXM4: their boost clocks; H100 SXM5: 1.83 GHz for the
# Tensor Cores, 1.98 GHz for the fp32 lanes). Datasheet (NVIDIA's product pages): dense peak
# in 16 bits (bf16; fp16 for the V100, which has no bf16), HBM bandwidth, NVLink bandwidth as
# NVIDIA quotes it (both directions added). B200: NVIDIA publishes no SM count or clock, so
# its architecture fields are None and its peak is a reported figure only.
CHIPS = {
    "V100": dict(sms=80, tc_flops_per_cycle_sm=1024, tensor_clock=1.53e9, peak16=125e12,
                 hbm=0.9e12, nvlink_both_ways=300e9, note="fp16 (no bf16 on Volta)"),
    "A100": dict(sms=108, tc_flops_per_cycle_sm=2048, tensor_clock=1.41e9, peak16=312e12,
                 hbm=2.039e12, nvlink_both_ways=600e9, note="80 GB SXM4"),
    "H100": dict(sms=132, tc_flops_per_cycle_sm=4096, tensor_clock=1.83e9, peak16=989.4e12,
                 hbm=3.35e12, nvlink_both_ways=900e9, note="SXM5"),
    "H200": dict(sms=132, tc_flops_per_cycle_sm=4096, tensor_clock=1.83e9, peak16=989.4e12,
                 hbm=4.8e12, nvlink_both_ways=900e9, note="the H100's chip, HBM3e"),
    "B200": dict(sms=None, tc_flops_per_cycle_sm=None, tensor_clock=None, peak16=2.25e15,
                 hbm=8e12, nvlink_both_ways=1.8e12, note="reported: dense bf16, HGX B200"),
}


def tensor_peak(chip: str) -> float | None:
    """Dense 16-bit Tensor Core FLOP/s from the architecture: SMs x FLOPs per cycle per SM x
    clock (None where the architecture is not published)."""
    c = CHIPS[chip]
    if c["sms"] is None:
        return None
    return c["sms"] * c["tc_flops_per_cycle_sm"] * c["tensor_clock"]


# ----------------------------------------------------------------- a layer's ops, priced (lesson 11)

@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3): q and the keys/values pass through
    low-rank latents (`q_lora`, `kv_lora`); each head's query and key have `qk_nope` dims
    without position and `qk_rope` with RoPE (the rope part of the key shared by the heads),
    its value `v_head` dims."""
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int


def layer_ops(cfg, tokens: int, seq: int, tp: int = 1, sp: bool = False, e: int = 2,
              flash: bool = True, moe=None, ep: int = 1, dropout: bool = False,
              block: str = "llama", mla: MLAShape | None = None) -> list[dict]:
    """The forward operations of one transformer block on one of `tp` ranks, for `tokens`
    tokens of sequences of `seq` (attention's context), in the `GROUPS` lesson 12 measures:
    [{"name", "group", "kind" ("matmul", "attention" or "memory"), "shape" ((m, k, n) of a
    matmul, repeated "count" times), "flops", "bytes", "count"}]. Bytes are what each op
    reads and writes in HBM at `e` bytes a value; FLOPs of the element-wise ops are not counted
    (they run at the bandwidth). Norms and residual adds run on tokens/tp with SP, on all
    tokens without. `flash`: attention is one fused kernel (FLOPs of the causal half, bytes
    q, k, v and o); otherwise Megatron's unfused core — QKᵀ and the weighted sum as batched
    matmuls over the whole s × s square, and a fused scale-mask-softmax over the scores (with
    `dropout`: a dropout over them too, and dropout fused into each residual add, 1 byte a
    mask element). `moe` (planner.MoEShape): the MLP becomes a router, the permutation of k
    copies of each token to their experts and back, and the E/ep local experts.
    `block="gpt"`: GPT's block (Megatron's runs) — LayerNorm (it also writes each token's
    fp32 mean and 1/std for the backward), a bias on q, k, v added after the matmul, no RoPE,
    a GeLU MLP of inner size 4h (`ffn_hidden` is not read) with its bias fused into the GeLU,
    the other biases fused into the residual adds.
    `mla` (`MLAShape`): the attention of DeepSeek-V3 — the latent projections and their
    norms, RoPE on the rope parts, the core at its real head dims."""
    if block not in ("llama", "gpt"):
        raise ValueError(f"block must be 'llama' or 'gpt', not {block!r}")
    gpt = block == "gpt"
    h, d, a = cfg.hidden, cfg.head_dim, cfg.n_heads // tp
    kv = max(1, cfg.n_kv_heads // tp)
    near = tokens // tp if sp else tokens            # tokens the norms and residuals see
    ops = []

    def mm(name, m, k, n, count=1, group="matmuls"):
        ops.append(dict(name=name, group=group, kind="matmul", shape=(m, k, n), count=count,
                        flops=2 * m * k * n * count, bytes=e * (m * k + k * n + m * n) * count))

    def mem(name, group, nbytes, count=1):
        ops.append(dict(name=name, group=group, kind="memory", shape=None, count=count,
                        flops=0, bytes=nbytes * count))

    # x + f(x) (dropout on f(x), 1 byte a mask element; GPT: + the bias of f's last matmul)
    residual = (3 * e + (1 if dropout else 0)) * near * h + (e * h if gpt else 0)
    norm = 2 * e * near * h + (2 * 4 * near if gpt else 0)     # LayerNorm: + fp32 mean, 1/std
    mem("attention norm", "norms", norm)
    if mla is None:
        dq = dk = dv = d
        mm("q, k, v", tokens, h, (a + 2 * kv) * d)
        if gpt:
            n = (a + 2 * kv) * d
            mem("q, k, v bias", "residual adds", e * (2 * tokens * n + n))
        else:
            mem("RoPE on q and k", "RoPE and reshapes", 2 * e * tokens * (a + kv) * d)
    else:
        dq = dk = mla.qk_nope + mla.qk_rope
        dv, kv = mla.v_head, a
        mm("q down", tokens, h, mla.q_lora)
        mem("q latent norm", "norms", 2 * e * tokens * mla.q_lora)
        mm("q up", tokens, mla.q_lora, a * dq)
        mm("kv down", tokens, h, mla.kv_lora + mla.qk_rope)
        mem("kv latent norm", "norms", 2 * e * tokens * mla.kv_lora)
        mm("kv up", tokens, mla.kv_lora, a * (mla.qk_nope + dv))
        mem("RoPE on q and k", "RoPE and reshapes", 2 * e * tokens * (a + 1) * mla.qk_rope)
    if flash:
        ops.append(dict(name="attention (fused kernel)", group="softmax and mask", kind="attention",
                        shape=None, count=1, flops=tokens * seq * a * (dq + dv),
                        bytes=e * tokens * (a * dq + kv * (dk + dv) + a * dv)))
    else:
        b_seqs = max(1, tokens // seq)
        mm("QKᵀ", seq, dq, seq, count=b_seqs * a)
        mem("scale, mask, softmax", "softmax and mask", 2 * e * b_seqs * a * seq * seq)
        if dropout:
            mem("attention dropout", "softmax and mask", (2 * e + 1) * b_seqs * a * seq * seq)
        mm("scores × V", seq, seq, dv, count=b_seqs * a)
    mm("attention out", tokens, a * dv, h)
    mem("residual add (attention)", "residual adds", residual)
    mem("MLP norm", "norms", norm)
    if moe is None and gpt:
        f = 4 * h // tp
        mm("up", tokens, h, f)
        mem("bias and GeLU", "SwiGLU elementwise", e * (2 * tokens * f + f))
        mm("down", tokens, f, h)
    elif moe is None:
        f = cfg.ffn_hidden // tp
        mm("gate and up", tokens, h, 2 * f)
        mem("SwiGLU", "SwiGLU elementwise", 3 * e * tokens * f)
        mm("down", tokens, f, h)
    else:
        routed = near * moe.top_k
        per_expert = max(1, ep * routed // moe.n_experts)
        local = moe.n_experts // ep
        mm("router", near, h, moe.n_experts)
        mem("permute to experts and back", "RoPE and reshapes", 2 * 2 * e * routed * h)
        mm("expert gate and up", per_expert, h, 2 * moe.expert_ffn, count=local)
        mem("expert SwiGLU", "SwiGLU elementwise", 3 * e * per_expert * moe.expert_ffn, count=local)
        mm("expert down", per_expert, moe.expert_ffn, h, count=local)
        if moe.shared:
            f = moe.shared * moe.expert_ffn // tp
            mm("shared gate and up", tokens, h, 2 * f)
            mem("shared SwiGLU", "SwiGLU elementwise", 3 * e * tokens * f)
            mm("shared down", tokens, f, h)
    mem("residual add (MLP)", "residual adds", residual)
    return ops


def embedding_ops(cfg, tokens: int, tp: int = 1, e: int = 2, block: str = "llama") -> list[dict]:
    """The first stage's extra ops: the lookup (read the tokens' rows, write them; GPT: add
    the position embedding too) and, in the backward, the embedding's gradient — a dense
    (V/tp) × h table written, the tokens' gradient rows read and added into their rows (read
    and write), then added into the accumulated gradient (read both, write one): the
    `backward_bytes` of the op, not twice its forward."""
    v, h = cfg.vocab_size // tp, cfg.hidden
    ops = [dict(name="embedding lookup and its gradient", group="loss and embedding", kind="memory",
                shape=None, count=1, flops=0, bytes=2 * e * tokens * h,
                backward_bytes=e * v * h + 3 * e * tokens * h + 3 * e * v * h)]
    if block == "gpt":
        ops.append(dict(name="position embedding add", group="loss and embedding", kind="memory",
                        shape=None, count=1, flops=0, bytes=3 * e * tokens * h))
    return ops


def mtp_ops(cfg, tokens: int, tp: int = 1, sp: bool = False, e: int = 2) -> list[dict]:
    """What a multi-token-prediction module (DeepSeek-V3 report, §2.2) adds before its own
    transformer block and its pass through the shared head: the norms of the hidden state
    and of the next token's embedding, and their concatenation projected from 2h to h."""
    h = cfg.hidden
    near = tokens // tp if sp else tokens
    return [dict(name="MTP norms", group="norms", kind="memory", shape=None, count=1, flops=0,
                 bytes=2 * 2 * e * near * h),
            dict(name="MTP projection", group="matmuls", kind="matmul", shape=(tokens, 2 * h, h // tp),
                 count=1, flops=2 * tokens * 2 * h * (h // tp),
                 bytes=e * (tokens * 2 * h + 2 * h * (h // tp) + tokens * (h // tp)))]


def head_ops(cfg, tokens: int, tp: int = 1, sp: bool = False, e: int = 2) -> list[dict]:
    """The last stage's extra forward ops: the final norm, the vocab-split head and the loss
    (a softmax over the logits: read them, write fp32 log-probabilities)."""
    v, h = cfg.vocab_size // tp, cfg.hidden
    near = tokens // tp if sp else tokens
    return [dict(name="final norm", group="norms", kind="memory", shape=None, count=1, flops=0,
                 bytes=2 * e * near * h),
            dict(name="head", group="matmuls", kind="matmul", shape=(tokens, h, v), count=1,
                 flops=2 * tokens * h * v, bytes=e * (tokens * h + h * v + tokens * v)),
            dict(name="cross-entropy", group="loss and embedding", kind="memory", shape=None,
                 count=1, flops=0, bytes=(e + 4) * tokens * v)]


def op_seconds(op: dict, hw, precision: str = "bf16", backward: bool = False) -> tuple:
    """(seconds, kernels) of one op of `layer_ops` on `hw` (a `picolib.hardware.Hardware`),
    forward or backward, on the roofline with the preset's measured fractions: a matmul at
    max(FLOPs / (matmul_eff × peak), bytes / (hbm_eff × HBM)) — its shape sets which wins —
    the fused attention at attention_eff × peak, an element-wise op at its bytes over the
    achieved HBM bandwidth; no kernel faster than `hw.launch`. Backward: a matmul is two of
    the same FLOPs (input gradient (m, n, k), weight gradient (k, m, n)); attention's
    backward does 2.5× its forward's FLOPs (five matmuls to two) and moves twice the bytes;
    an element-wise op reads its output's gradient and its saved inputs and writes its
    inputs' gradients: twice its forward bytes (or the op's `backward_bytes`), one kernel."""
    peak = hw.peak(precision if precision != "fp32" else "bf16")
    bw = hw.hbm_bandwidth * hw.hbm_eff
    n = op["count"]
    if op["kind"] == "matmul":
        m, k, nn = op["shape"]
        shapes = [(m, nn, k), (k, m, nn)] if backward else [(m, k, nn)]
        e = op["bytes"] / (n * (m * k + k * nn + m * nn))
        t = sum(max(2 * x * y * z / (peak * hw.matmul_eff), e * (x * y + y * z + x * z) / bw, hw.launch)
                for x, y, z in shapes)
        return n * t, n * len(shapes)
    if op["kind"] == "attention":
        f, b = (2.5 * op["flops"], 2 * op["bytes"]) if backward else (op["flops"], op["bytes"])
        return max(f / (peak * hw.attention_eff), b / bw, hw.launch), 1
    b = op.get("backward_bytes", 2 * op["bytes"]) if backward else op["bytes"]
    return max(b / n / bw, hw.launch) * n, n
