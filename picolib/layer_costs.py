"""Every op of one transformer block with its FLOPs and bytes, priced on a hardware preset's
roofline (lessons 11 and 11b): what the planner's step time adds up.

The ops fall into the groups lesson 12 measures on a real step (`roofline.GROUPS`): matmuls
by shape, norms, RoPE, the MLP's element-wise work, softmax and mask, residual adds, the loss
and the embedding. `op_seconds` puts one op on the roofline, `max(F / peak, B / bandwidth)`,
with the preset's measured fractions of its datasheet figures and a launch floor per kernel.
tests/lib/test_published_runs.py checks the counts against torch's own modules.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MLAShape", "layer_ops", "embedding_ops", "mtp_ops", "head_ops", "op_seconds",
           "matmul_compute_seconds"]


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
    near = tokens // tp if sp else tokens            # tokens the norms and residuals see
    ops = _Ops(e)
    # x + f(x) (dropout on f(x), 1 byte a mask element; GPT: + the bias of f's last matmul)
    residual = (3 * e + (1 if dropout else 0)) * near * cfg.hidden + (e * cfg.hidden if gpt else 0)
    norm = 2 * e * near * cfg.hidden + (2 * 4 * near if gpt else 0)     # LayerNorm: + fp32 mean, 1/std
    ops.mem("attention norm", "norms", norm)
    _attention_ops(ops, cfg, tokens, seq, tp, flash, dropout, gpt, mla)
    ops.mem("residual add (attention)", "residual adds", residual)
    ops.mem("MLP norm", "norms", norm)
    _mlp_ops(ops, cfg, tokens, near, tp, moe, ep, gpt)
    ops.mem("residual add (MLP)", "residual adds", residual)
    return list(ops)


class _Ops(list):
    """The op list `layer_ops` builds: a matmul's FLOPs and bytes follow from its shape, a
    memory-bound op's from its bytes (at `e` bytes a value)."""

    def __init__(self, e: int):
        super().__init__()
        self.e = e

    def mm(self, name, m, k, n, count=1, group="matmuls"):
        self.append(dict(name=name, group=group, kind="matmul", shape=(m, k, n), count=count,
                         flops=2 * m * k * n * count, bytes=self.e * (m * k + k * n + m * n) * count))

    def mem(self, name, group, nbytes, count=1):
        self.append(dict(name=name, group=group, kind="memory", shape=None, count=count,
                         flops=0, bytes=nbytes * count))


def _attention_ops(ops, cfg, tokens, seq, tp, flash, dropout, gpt, mla):
    """The projections (GQA's q, k, v or MLA's latent ones), the core (fused, or Megatron's
    unfused QKᵀ, softmax and weighted sum) and the output projection, into `ops`."""
    e, h, a = ops.e, cfg.hidden, cfg.n_heads // tp
    kv = max(1, cfg.n_kv_heads // tp)
    if mla is None:
        dq = dk = dv = cfg.head_dim
        ops.mm("q, k, v", tokens, h, (a + 2 * kv) * dq)
        if gpt:
            n = (a + 2 * kv) * dq
            ops.mem("q, k, v bias", "residual adds", e * (2 * tokens * n + n))
        else:
            ops.mem("RoPE on q and k", "RoPE and reshapes", 2 * e * tokens * (a + kv) * dq)
    else:
        dq = dk = mla.qk_nope + mla.qk_rope
        dv, kv = mla.v_head, a
        ops.mm("q down", tokens, h, mla.q_lora)
        ops.mem("q latent norm", "norms", 2 * e * tokens * mla.q_lora)
        ops.mm("q up", tokens, mla.q_lora, a * dq)
        ops.mm("kv down", tokens, h, mla.kv_lora + mla.qk_rope)
        ops.mem("kv latent norm", "norms", 2 * e * tokens * mla.kv_lora)
        ops.mm("kv up", tokens, mla.kv_lora, a * (mla.qk_nope + dv))
        ops.mem("RoPE on q and k", "RoPE and reshapes", 2 * e * tokens * (a + 1) * mla.qk_rope)
    if flash:
        ops.append(dict(name="attention (fused kernel)", group="softmax and mask", kind="attention",
                        shape=None, count=1, flops=tokens * seq * a * (dq + dv),
                        bytes=e * tokens * (a * dq + kv * (dk + dv) + a * dv)))
    else:
        b_seqs = max(1, tokens // seq)
        ops.mm("QKᵀ", seq, dq, seq, count=b_seqs * a)
        ops.mem("scale, mask, softmax", "softmax and mask", 2 * e * b_seqs * a * seq * seq)
        if dropout:
            ops.mem("attention dropout", "softmax and mask", (2 * e + 1) * b_seqs * a * seq * seq)
        ops.mm("scores × V", seq, seq, dv, count=b_seqs * a)
    ops.mm("attention out", tokens, a * dv, h)


def _mlp_ops(ops, cfg, tokens, near, tp, moe, ep, gpt):
    """The MLP into `ops`: GPT's GeLU MLP, Llama's SwiGLU, or a MoE layer (router, permutation
    to the experts and back, the local experts, the shared ones)."""
    e, h = ops.e, cfg.hidden
    if moe is None and gpt:
        f = 4 * h // tp
        ops.mm("up", tokens, h, f)
        ops.mem("bias and GeLU", "SwiGLU elementwise", e * (2 * tokens * f + f))
        ops.mm("down", tokens, f, h)
    elif moe is None:
        f = cfg.ffn_hidden // tp
        ops.mm("gate and up", tokens, h, 2 * f)
        ops.mem("SwiGLU", "SwiGLU elementwise", 3 * e * tokens * f)
        ops.mm("down", tokens, f, h)
    else:
        routed = near * moe.top_k
        per_expert = max(1, ep * routed // moe.n_experts)
        local = moe.n_experts // ep
        ops.mm("router", near, h, moe.n_experts)
        ops.mem("permute to experts and back", "RoPE and reshapes", 2 * 2 * e * routed * h)
        ops.mm("expert gate and up", per_expert, h, 2 * moe.expert_ffn, count=local)
        ops.mem("expert SwiGLU", "SwiGLU elementwise", 3 * e * per_expert * moe.expert_ffn, count=local)
        ops.mm("expert down", per_expert, moe.expert_ffn, h, count=local)
        if moe.shared:
            f = moe.shared * moe.expert_ffn // tp
            ops.mm("shared gate and up", tokens, h, 2 * f)
            ops.mem("shared SwiGLU", "SwiGLU elementwise", 3 * e * tokens * f)
            ops.mm("shared down", tokens, f, h)


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


def matmul_compute_seconds(m: int, k: int, n: int, hw, peak: float, count: int = 1) -> float:
    """Seconds of the FLOPs of `count` (m × k) @ (k × n) matmuls in one kernel at `hw.matmul_eff`
    × `peak` (MAMF: the rate of a matmul that fills every SM in every wave). With `hw.sms`, the
    m × n outputs are cut into tiles (`hardware.MATMUL_TILES`: a partial tile at an edge costs
    a whole one) that run `sms` at a time: ⌈count·tiles / sms⌉ waves, each the time of one
    tile's 2·tm·tn·k FLOPs at 1/sms of the rate; the better of the tile shapes."""
    import math
    from .hardware import MATMUL_TILES
    rate = peak * hw.matmul_eff
    if not hw.sms:
        return 2 * m * k * n * count / rate
    return min(math.ceil(count * math.ceil(m / tm) * math.ceil(n / tn) / hw.sms) * hw.sms * 2 * tm * tn * k
               for tm, tn in MATMUL_TILES) / rate


def op_seconds(op: dict, hw, precision: str = "bf16", backward: bool = False) -> tuple:
    """(seconds, kernels) of one op of `layer_ops` on `hw` (a `picolib.hardware.Hardware`),
    forward or backward, on the roofline with the preset's measured fractions: a matmul at
    max(its FLOPs' time (`matmul_compute_seconds`: MAMF, in whole waves of tiles), bytes / (hbm_eff × HBM))
    — its shape sets which wins — the `count` matmuls of a batched op in one kernel,
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
        t = sum(max(matmul_compute_seconds(x, y, z, hw, peak, n), n * e * (x * y + y * z + x * z) / bw,
                    n * hw.launch) for x, y, z in shapes)
        return t, n * len(shapes)
    if op["kind"] == "attention":
        f, b = (2.5 * op["flops"], 2 * op["bytes"]) if backward else (op["flops"], op["bytes"])
        return max(f / (peak * hw.attention_eff), b / bw, hw.launch), 1
    b = op.get("backward_bytes", 2 * op["bytes"]) if backward else op["bytes"]
    return max(b / n / bw, hw.launch) * n, n
