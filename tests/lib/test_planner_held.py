"""Memory as a run held it (planner.HeldAs): a small MLA + MoE block written out in torch, its
saved tensors measured (picolib.memory.SavedActivations) in bf16, with FP8-cached Linear inputs
and with its norms and up-projections recomputed, against `mla_saved_bytes`; the optimizer's
options against an Adam built as the DeepSeek-V3 report describes; DeepSeek-V3's layout in 80 GB."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from picolib.layer_costs import MLAShape
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig
from picolib.planner import (FP8_TILE, HeldAs, MoEShape, Parallelism, comm_buffer_bytes, memory,
                             mla_saved_bytes)

BF = torch.bfloat16
CFG = LlamaConfig(vocab_size=64, hidden=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128)
MLA = MLAShape(q_lora=128, kv_lora=128, qk_nope=16, qk_rope=8, v_head=24)   # v = q, k head dims (CPU flash)
MOE = MoEShape(n_experts=4, top_k=2, expert_ffn=128, shared=1)
B, S = 2, 32


def _quantized(x):
    """x as FP8 (e4m3) with one fp32 scale per 1×128 tile (DeepSeek-V3 §3.3.1), and back."""
    tiles = x.float().reshape(*x.shape[:-1], -1, FP8_TILE)
    scale = tiles.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (tiles / scale).to(torch.float8_e4m3fn), scale


def _restored(q, scale, shape):
    return (q.float() * scale).reshape(shape).to(BF)


class CachedLinear(torch.autograd.Function):
    """x @ w.T keeping x for backward as it is, or in FP8 with its tile scales."""

    @staticmethod
    def forward(ctx, x, w, fp8):
        ctx.fp8, ctx.shape = fp8, x.shape
        ctx.save_for_backward(*(_quantized(x) if fp8 else (x,)), w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        *xs, w = ctx.saved_tensors
        x = _restored(*xs, ctx.shape) if ctx.fp8 else xs[0]
        return g @ w, (g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])).to(w.dtype), None


class RMSNorm(torch.autograd.Function):
    """A fused RMSNorm: keeps its input and the fp32 rstd of each row."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        ctx.save_for_backward(x, rstd, w)
        return (x.float() * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g):
        x, rstd, w = ctx.saved_tensors
        xhat, gw = x.float() * rstd, g.float() * w.float()
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), (g.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)


class SwiGLUDown(torch.autograd.Function):
    """down(weight · silu(gate) · up) for one expert's rows: keeps the gate and up outputs (bf16,
    or FP8 with scales and the product recomputed in backward, DeepSeek-V3 §3.3.3) and the
    routing weights; bf16 keeps the down projection's input too."""

    @staticmethod
    def forward(ctx, gu, weight, w_down, fp8):
        gate, up = gu.chunk(2, -1)
        act = (F.silu(gate.float()) * up.float() * (1 if weight is None else weight[:, None])).to(BF)
        ctx.fp8, ctx.shape = fp8, gu.shape
        kept = _quantized(gu) if fp8 else (gu, act)
        ctx.save_for_backward(*kept, weight, w_down)
        return act @ w_down.T

    @staticmethod
    def backward(ctx, g):
        *kept, weight, w_down = ctx.saved_tensors
        gu = _restored(*kept, ctx.shape) if ctx.fp8 else kept[0]
        gate, up = gu.float().chunk(2, -1)
        s = torch.sigmoid(gate)
        silu, w = gate * s, (1 if weight is None else weight[:, None])
        act = (silu * up * w).to(BF)
        g_act = (g @ w_down).float()
        g_gate = g_act * w * up * (s + gate * s * (1 - s))
        g_up = g_act * w * silu
        g_weight = None if weight is None else (g_act * silu * up).sum(-1)
        return torch.cat([g_gate, g_up], -1).to(BF), g_weight, (g.T @ act).to(BF), None


def _weights():
    h, n, m, f = CFG.hidden, CFG.n_heads, MLA, MOE.expert_ffn
    shapes = {"n1": (h,), "down": (m.q_lora + m.kv_lora + m.qk_rope, h), "nq": (m.q_lora,), "nkv": (m.kv_lora,),
              "q_up": (n * (m.qk_nope + m.qk_rope), m.q_lora), "kv_up": (n * (m.qk_nope + m.v_head), m.kv_lora),
              "out": (h, n * m.v_head), "n2": (h,), "router": (MOE.n_experts, h),
              "gu": (MOE.n_experts + MOE.shared, 2 * f, h), "dn": (MOE.n_experts + MOE.shared, h, f)}
    torch.manual_seed(0)
    return {k: (torch.randn(v) / (v[-1] ** 0.5 if len(v) > 1 else 1)).to(BF).requires_grad_() for k, v in shapes.items()}


def _front(x, W, fp8):
    """The attention norm and the fused q/kv down projection: the latents and the rope key."""
    return CachedLinear.apply(RMSNorm.apply(x, W["n1"]), W["down"], fp8)


def _attention(lat, W, fp8):
    """The latents' norms, the up-projections, the fused causal kernel (torch's flash on CPU)."""
    m, n = MLA, CFG.n_heads
    cq, ckv, k_rope = lat.split([m.q_lora, m.kv_lora, m.qk_rope], -1)
    q = CachedLinear.apply(RMSNorm.apply(cq, W["nq"]), W["q_up"], fp8).view(B, S, n, -1)
    kv = CachedLinear.apply(RMSNorm.apply(ckv, W["nkv"]), W["kv_up"], fp8).view(B, S, n, -1)
    k = torch.cat([kv[..., :m.qk_nope], k_rope[:, :, None].expand(B, S, n, m.qk_rope)], -1)
    v = kv[..., m.qk_nope:].contiguous()
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return o.transpose(1, 2).reshape(B, S, -1)


def _mlp_front(t, W, fp8):
    """The MLP norm, the router (its input in bf16: the report keeps gating in its precision) and
    the shared expert's gate and up projection (FP8: its own copy of the norm output)."""
    mn = RMSNorm.apply(t, W["n2"])
    return mn @ W["router"].T, CachedLinear.apply(mn, W["gu"][-1], fp8)


def _block(x, W, fp8=False, recompute=False):
    """One MLA + MoE block (ep = 1); `recompute`: the norms and the up-projections run again in
    backward (torch's checkpoint; it recomputes the attention kernel too)."""
    run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if recompute else (lambda f, *a: f(*a))
    o = run(_attention, run(_front, x, W, fp8), W, fp8)
    x1 = x + o @ W["out"].T                         # the out projection keeps o: 16 bits either way
    t = x1.reshape(-1, CFG.hidden)
    logits, shared_gu = run(_mlp_front, t, W, fp8)
    scores = torch.sigmoid(logits.float())
    flat = scores.detach().topk(MOE.top_k, -1).indices.flatten()
    order = flat.argsort(stable=True)
    ids = torch.arange(t.shape[0]).repeat_interleave(MOE.top_k)[order]      # each row's token
    weights = scores.flatten()[ids * MOE.n_experts + flat[order]]
    rows = _Rows.apply(t, ids)
    y = SwiGLUDown.apply(shared_gu, None, W["dn"][-1], fp8)
    counts = torch.bincount(flat, minlength=MOE.n_experts).tolist()
    for e, (x_e, w_e, ids_e) in enumerate(zip(rows.split(counts), weights.split(counts), ids.split(counts))):
        gu = CachedLinear.apply(x_e, W["gu"][e], fp8)
        y = _Combine.apply(y, ids_e, SwiGLUDown.apply(gu, w_e, W["dn"][e], fp8))
    return x1 + y.reshape(x1.shape)


class _Combine(torch.autograd.Function):
    """The combine: each row's (weighted) expert output added to its token, keeping the ids."""

    @staticmethod
    def forward(ctx, y, ids, rows):
        ctx.save_for_backward(ids)
        return y.index_add(0, ids, rows)

    @staticmethod
    def backward(ctx, g):
        ids, = ctx.saved_tensors
        return g, None, g[ids]


class _Rows(torch.autograd.Function):
    """The dispatch: each expert's rows of the tokens, keeping only the token ids."""

    @staticmethod
    def forward(ctx, t, ids):
        ctx.save_for_backward(ids)
        ctx.n = t.shape[0]
        return t[ids]

    @staticmethod
    def backward(ctx, g):
        ids, = ctx.saved_tensors
        return torch.zeros(ctx.n, g.shape[-1], dtype=g.dtype).index_add(0, ids, g), None


def _measured(fp8, recompute):
    W = _weights()
    x0 = torch.randn(B, S, CFG.hidden).to(BF).requires_grad_()
    with SavedActivations() as act:
        out = _block(x0 * 1.0, W, fp8, recompute)    # the block's input: an activation, not a leaf
    held = act.bytes
    out.float().square().mean().backward()
    assert act.live == 0                              # backward freed all of it
    return held, x0.grad


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_blocks_saved_tensors_are_the_inventorys(fp8, recompute):
    held, grad = _measured(fp8, recompute)
    count = mla_saved_bytes(CFG, MLA, MOE, B * S, fp8_cache=fp8, recompute_norm_up=recompute)
    # torch's checkpoint recomputes the attention kernel too: its fp32 statistics go as well
    dropped = count["attention statistics (fp32)"] if recompute else 0
    assert held == sum(count.values()) - dropped
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_each_option_saves_what_its_entries_say_and_recomputing_changes_no_gradient():
    (plain, g0), (fp8, _), (rec, g1) = (_measured(*o) for o in ((False, False), (True, False), (False, True)))
    one = lambda **o: mla_saved_bytes(CFG, MLA, MOE, B * S, **o)      # noqa: E731
    base = one()
    assert plain - fp8 == sum(base.values()) - sum(one(fp8_cache=True).values()) > 0
    assert plain - rec - B * S * CFG.n_heads * 4 == sum(base.values()) - sum(one(recompute_norm_up=True).values()) > 0
    assert torch.equal(g0, g1)
    # planted: FP8 caching that forgets the tile scales, recomputation that keeps q, k, v
    h = CFG.hidden
    scales = 4 * B * S * (h + MLA.q_lora + MLA.kv_lora + h + MOE.top_k * h + 2 * MOE.expert_ffn * (MOE.top_k + MOE.shared)) // FP8_TILE
    assert plain - fp8 != sum(base.values()) - sum(one(fp8_cache=True).values()) + scales
    assert plain - rec != sum(base.values()) - sum(one(recompute_norm_up=True).values()) - \
        B * S * CFG.n_heads * (3 * (MLA.qk_nope + MLA.qk_rope)) * 2


def test_optimizer_options_count_an_adam_with_bf16_moments_and_fp32_gradients():
    par, moe = Parallelism(pp=1), None
    cfg = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=64)
    from picolib.model import TinyLlama
    model = TinyLlama(cfg)
    n = sum(p.numel() for p in model.parameters())
    # DeepSeek-V3 §3.3.3: fp32 master, bf16 moments, fp32 gradients — the tensors themselves
    master = [p.detach().float() for p in model.parameters()]
    moments = [torch.zeros_like(p, dtype=BF) for p in master for _ in range(2)]
    grads = [torch.zeros_like(p) for p in master]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)        # noqa: E731
    held = HeldAs(bf16_moments=True, fp32_grads=True)
    got, plain = memory(cfg, par, moe=moe, held=held), memory(cfg, par, moe=moe)
    assert got["optimizer"] == nbytes(master) + nbytes(moments) and got["grads"] == nbytes(grads)
    assert plain["optimizer"] - got["optimizer"] == 4 * n and got["grads"] - plain["grads"] == 2 * n
    with pytest.raises(ValueError, match="mixed precision"):
        memory(cfg, Parallelism(precision="fp32"), held=held)


def test_comm_buffers_are_two_chunks_of_dispatch_and_combine_and_the_pipes_sends():
    par = Parallelism(dp=4, ep=4, pp=2, micro_batches=2, seq=256)
    moe, h, t = MoEShape(8, 2, 64), CFG.hidden, 256
    dispatch = torch.empty(moe.top_k * t, h, dtype=torch.float8_e4m3fn)
    scales = torch.empty(moe.top_k * t, h // FP8_TILE, dtype=torch.float32)
    combine = torch.empty(moe.top_k * t, h, dtype=BF)
    sends = [torch.empty(t, h, dtype=BF) for _ in range(4)]
    nbytes = lambda ts: sum(x.numel() * x.element_size() for x in ts)        # noqa: E731
    assert comm_buffer_bytes(CFG, par, moe) == 2 * nbytes([dispatch, scales, combine]) + nbytes(sends)
    held = memory(CFG, par, moe=moe, held=HeldAs(comm_buffers=True))
    assert held["buffers"] == comm_buffer_bytes(CFG, par, moe)
    assert held["total"] - memory(CFG, par, moe=moe)["total"] == held["buffers"]


def test_deepseek_v3s_layout_fits_in_80_gb_as_it_held_it():
    from picolib.hardware import GPUS
    from picolib.published_runs import RUNS, run_memory
    ds = next(r for r in RUNS if r.moe is not None)
    held, plain = run_memory(ds), run_memory(ds, held=None)
    assert GPUS[ds.hw].memory == 80e9
    assert held["total"] <= 80e9 < plain["total"]          # the planner's plain count does not fit
    for option in ("fp8_cache", "recompute_norm_up", "bf16_moments", "fp32_grads", "comm_buffers"):
        off = run_memory(ds, held=replace(ds.held, **{option: False}))
        # each saving lowers it; the FP32 gradients and the buffers the run held raise it
        assert (off["total"] > held["total"]) == (option not in ("fp32_grads", "comm_buffers")), option
    with pytest.raises(ValueError, match="tp = 1"):
        memory(ds.cfg, ds.par.replace(tp=2, dp=64), moe=ds.moe, held=ds.held)
    with pytest.raises(ValueError, match="give held.mla"):       # a dense block has no inventory here
        memory(ds.cfg, ds.par, moe=ds.moe, held=HeldAs(fp8_cache=True))
