"""Step time, MFU, and a search over configurations (lesson 11).

What: `step_time` prices one training step of a `picolib.planner.Parallelism` on a
`picolib.hardware` preset by playing its pipeline schedule (`pipeline_simulator.simulate`)
with each op's cost — every operation of its layers on the roofline of the preset
(`layer_costs.layer_ops`, `layer_costs.op_seconds`: matmuls by shape, the attention kernel, the
memory-bound norms, RoPE, activations, residual adds, softmax and loss, a launch floor a
kernel), the collectives on the critical path (TP, CP, EP, the pipeline's sends) — and takes
the slowest rank, plus the data-parallel traffic its last backward does not hide and the
optimizer's element-wise pass; the MFU
follows (`model_flops_per_token`: 6 × active parameters + causal attention). `search`
enumerates the configurations of a model on N GPUs at a global batch, keeps those that fit
in memory and ranks them by step time; `describe` prints one plan.
Why: the planner's bytes (picolib/planner.py) are exact; turning bytes into seconds needs
inputs, and they are all here, named: every op of a layer (`layer_costs.layer_ops`) priced by
`layer_costs.op_seconds` with the preset's measured fractions (`Hardware.matmul_eff`, `hbm_eff`,
`attention_eff`, `link_eff`, `launch`, `sms`: picolib/hardware.py gives each source), α per
collective call and pipeline send
(`hardware.ALPHA`, assumed), each group at its bandwidth (`Hardware.link`: NVLink inside a node,
k NICs for k GPUs of a node beyond it), the expert all-to-all hidden only inside DualPipe's
F&B pairs (`ep_overlap`). Lesson 11b checks the times against twenty published runs
(`picolib.published_runs`).
"""
from __future__ import annotations

import itertools

from .hardware import ALPHA, hardware
from .model import LlamaConfig, param_count
from .parallel_layout import PRECISIONS
from .planner import MoEShape, Parallelism, Plan, layer_numel, memory, traffic

__all__ = ["active_params", "tp_comm_ratio", "step_time", "search", "trainer_refuses", "describe",
           "matmul_seconds",
           "attention_flops", "model_flops_per_token", "MATMUL_CEILING"]


def active_params(cfg: LlamaConfig, moe: MoEShape | None = None) -> float:
    """Parameters a token passes through (6N FLOPs per token use these): all of a dense
    model; for a MoE the k routed and the shared experts of each layer."""
    n = param_count(cfg)
    if moe is None:
        return n
    dense_mlp = 3 * cfg.hidden * cfg.ffn_hidden
    per_token = 3 * cfg.hidden * moe.expert_ffn * (moe.top_k + moe.shared) + cfg.hidden * moe.n_experts
    return n + cfg.n_layers * (per_token - dense_mlp)


def tp_comm_ratio(cfg: LlamaConfig, tp: int, hw="H100-SXM", *, collectives: float = 8.0,
                  flops: float | None = None, dtype_bytes: int = 2, overlap: float = 0.0) -> dict:
    """Tensor parallelism's collective time per layer against the compute it splits
    (lessons 05, 10, 11): one function, every assumption a named argument.

    `collectives` counts a layer's activation collectives in units of (tp−1)/tp · T·h
    elements sent per rank: 8 for plain TP (four ring all-reduces of 2(tp−1)/tp each), 10
    for TP+SP with the backward re-gather (six all-gathers, four reduce-scatters; lesson 10
    measures 10.03 with the norms' small all-reduces). `flops` is the rate the matmuls run at
    (the dense bf16 peak unless given; lesson 05 uses 450e12, 45 % MFU). The link is the
    per-GPU bandwidth of a group of `tp` consecutive ranks on `hw` (`Hardware.link`: NVLink
    inside a node; over whole nodes, each node's NICs, capped by NVLink). `overlap` is
    the fraction of the collective time hidden behind compute (0: an upper bound).
    The ratio does not depend on the tokens per micro-batch: both sides are linear in them."""
    hw = hardware(hw)
    if tp < 2:
        raise ValueError(f"tp must be at least 2 for a collective to cost anything, not {tp}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], not {overlap}")
    rate = hw.bf16 if flops is None else flops
    tokens = 1
    comm = collectives * (tp - 1) / tp * tokens * cfg.hidden * dtype_bytes / hw.link(tp)
    compute = 6 * layer_numel(cfg) * tokens / tp / rate
    exposed = comm * (1 - overlap)
    return {"link": hw.link(tp), "flops": rate, "comm_per_token": comm,
            "compute_per_token": compute, "ratio": exposed / compute}


# the fraction of the dense peak a large GEMM sustains on an H100: measured (Bekman's MAMF table,
# picolib/hardware.py); every preset carries its own (`Hardware.matmul_eff`)
MATMUL_CEILING = hardware("H100-SXM").matmul_eff


def matmul_seconds(m: int, k: int, n: int, hw="H100-SXM", precision: str = "bf16",
                   ceiling: float | None = None) -> float:
    """Seconds of one (m × k) @ (k × n) matmul on the roofline (lesson 11): the larger of its
    2mkn FLOPs at `ceiling` × the dense peak (default: the preset's measured `matmul_eff`) and
    its bytes — read A and B, write C, in the compute dtype — at the datasheet's HBM bandwidth.
    Arithmetic intensity 2mkn / (e(mk + kn + mn)) FLOPs per byte against the ridge peak/HBM
    (H100 bf16: 989e12 / 3.35e12 ≈ 295): a matmul of a few hundred tokens is memory-bound, one
    of thousands compute-bound. (`step_time` prices matmuls with `layer_costs.op_seconds`, which
    also takes the achieved HBM fraction and a launch floor.)"""
    hw = hardware(hw)
    ceiling = hw.matmul_eff if ceiling is None else ceiling
    e = 1 if precision == "fp8" else 2
    return max(2 * m * k * n / (hw.peak(precision) * ceiling), e * (m * k + k * n + m * n) / hw.hbm_bandwidth)


def attention_flops(cfg: LlamaConfig, seq: int, causal: bool = True) -> float:
    """Forward FLOPs per token of one layer's attention core (QKᵀ and the weighted sum of V,
    2·2·s·h_q with h_q = heads × head_dim): causal attention computes half the square.
    Megatron-LM's count (Narayanan et al. 2021, 72·B·s·l·h²·(1 + s/6h + …)) and PaLM's
    take the whole square (causal=False); picolib counts what a causal kernel executes."""
    return 4 * seq * cfg.n_heads * cfg.head_dim / (2 if causal else 1)


def model_flops_per_token(cfg: LlamaConfig, seq: int, moe: MoEShape | None = None,
                          causal: bool = True) -> float:
    """Model FLOPs per token of one training step, picolib's one MFU convention (the trainer's
    log, the planner and bench/ use it): 6 × the active parameters (forward 2, backward 4;
    a MoE's top-k routed and shared experts and its router), without the input embedding
    table (a lookup, no FLOPs; the output head is a matmul and counts), plus 3 × each
    layer's causal attention core (`attention_flops`). `causal=False` gives Megatron-LM's
    whole-square count."""
    return (6 * (active_params(cfg, moe) - cfg.vocab_size * cfg.hidden)
            + 3 * cfg.n_layers * attention_flops(cfg, seq, causal))


def _stage_seconds_ops(cfg, par, hw, moe, ceiling, dropout, block="llama", mla=None, mtp=0):
    """{piece: (F, B, W, core) seconds per micro-batch} on one tp rank: every op of
    `layer_costs.layer_ops` (`embedding_ops` on the first piece, `head_ops` on the last; `mtp`
    multi-token-prediction modules on the last too: each `mtp_ops`, one more layer and the
    head again) at `layer_costs.op_seconds` on `hw`;
    `core` is the forward of the unfused attention core (what selective recomputation
    repeats; 0 with a fused kernel, whose backward already recomputes it)."""
    from dataclasses import replace as _replace
    from .parallel_layout import pieces as _n_pieces, stage_layers
    from .planner import elem_bytes
    from .layer_costs import embedding_ops, head_ops, layer_ops, mtp_ops, op_seconds
    if ceiling is not None:
        hw = _replace(hw, matmul_eff=ceiling)
    e = 1 if par.precision == "fp8" else elem_bytes(par.precision)
    prec = par.precision if par.precision != "fp32" else "bf16"
    tokens = par.micro_batch_size * par.seq // par.cp

    def price(ops):
        f = b = w = core = 0.0
        for op in ops:
            tf, _ = op_seconds(op, hw, prec)
            f += tf
            if op["kind"] == "matmul":
                dgrad, _ = op_seconds(dict(op, shape=op["shape"][:1] + op["shape"][2:] + op["shape"][1:2]), hw, prec)
                both, _ = op_seconds(op, hw, prec, backward=True)
                b, w = b + dgrad, w + both - dgrad
            else:
                b += op_seconds(op, hw, prec, backward=True)[0]
            if op["name"] in ("QKᵀ", "scale, mask, softmax", "attention dropout", "scores × V"):
                core += tf
        return f, b, w, core

    layer = price(layer_ops(cfg, tokens, par.seq, par.tp, par.sp, e, par.flash, moe, par.ep, dropout,
                            block, mla))
    head = price(head_ops(cfg, tokens, par.tp, par.sp, e))
    emb = price(embedding_ops(cfg, tokens, par.tp, e, block))
    extra = price(mtp_ops(cfg, tokens, par.tp, par.sp, e))
    head = tuple(y + mtp * (x + y + z) for x, y, z in zip(layer, head, extra))
    n = _n_pieces(par)
    return {piece: tuple(k * x + (y if piece == n - 1 else 0) + (z if piece == 0 else 0)
                         for x, y, z in zip(layer, head, emb))
            for piece, k in enumerate(stage_layers(cfg.n_layers, n))}


def _ep_seconds(cfg, par, hw, moe, nbytes, ep_nodes):
    """Seconds of `nbytes` of expert all-to-all (the bytes `traffic` counts: k copies per
    token, (ep−1)/ep of them leaving the rank). Inside a node: NVLink. Across N nodes: the
    copies for other nodes, k(N−1)/N per token, go through this GPU's own NIC (an all-to-all
    cannot be reduced on the way), the rest over NVLink. `ep_nodes` = M (node-limited
    routing, DeepSeek-V3: M = 4): a token goes to at most M nodes, once per node over the
    NIC (the node forwards it to its experts over NVLink): min(M, the nodes k experts
    reach on average) (N−1)/N NIC copies per token instead of k(N−1)/N."""
    if not nbytes:
        return 0.0
    node = hw.levels[0]
    span = par.ep * par.tp * par.cp                          # ep ranks are dp ranks
    nodes = max(1, span // node.gpus)
    if nodes == 1 or len(hw.levels) == 1:
        return nbytes / node.per_gpu
    k, e = moe.top_k, par.ep
    leaving = k * (e - 1) / e                                # copies per token in nbytes
    remote = k * (nodes - 1) / nodes                         # copies whose expert is on another node
    if ep_nodes is None:
        nic, nv = remote, max(0.0, leaving - remote)
    else:
        reach = nodes * (1 - (1 - 1 / nodes) ** k)           # distinct nodes of k uniform experts
        nic, nv = min(ep_nodes, reach) * (nodes - 1) / nodes, leaving   # + forwarding in the node
    return nbytes / leaving * (nic / hw.levels[1].per_gpu + nv / node.per_gpu)


def _optimizer_seconds(cfg, par, hw, moe, pp_rank):
    """The optimizer's element-wise pass after the last backward (Adam): per parameter of the
    rank's optimizer shard it reads and writes the states (master weights with bf16/fp8), reads
    the gradient and writes the parameter (fp32: reads it too), at the achieved HBM bandwidth."""
    from .memory import bytes_per_param
    from .sharded_optim import optimizer_state_factor
    master = par.precision != "fp32"
    k = optimizer_state_factor("adam", master=master)
    numel = memory(cfg, par, pp_rank, moe)["optimizer"] / k
    parts = bytes_per_param("fp32" if not master else "bf16", par.fp32_grad_accum)
    per = 2 * k + parts["grads"] + parts.get("fp32_grads", 0) + parts["params"] * (1 if master else 2)
    return numel * per / (hw.hbm_bandwidth * hw.hbm_eff)


def _dp_seconds(cfg, par, hw, moe, pp_rank):
    """Seconds of the rank's data-parallel traffic: each group of `dp_groups` at the link of
    its ranks (dp·cp replicas spaced tp apart; an expert's copies spaced ep·tp·cp apart)."""
    from .planner import dp_groups
    from .sharded_optim import zero_traffic_bytes
    gdt = 4 if par.precision == "fp32" else 2
    out = 0.0
    for i, (units, n) in enumerate(dp_groups(cfg, par, pp_rank, moe)):
        if n == 1:
            continue
        nbytes = zero_traffic_bytes(par.zero, units if par.zero else [sum(units)], n, gdt)
        stride = par.tp if i == 0 else par.tp * par.cp * par.ep
        out += nbytes / hw.link(n, stride=stride)
    return out


def step_time(cfg: LlamaConfig, par: Parallelism, hw="H100-SXM", moe: MoEShape | None = None,
              alpha: float = ALPHA, *,
              ceiling: float | None = None, ep_overlap: float = 1.0,
              ep_nodes: int | None = None, causal: bool = True, dropout: bool = False,
              block: str = "llama", mla=None, mtp: int = 0, dp_overlap: bool = True) -> dict:
    """Seconds of one step, its parts, tokens/s and MFU, from the slowest pipeline rank.

    Each op of the schedule (F, B, W, BW of a stage and micro-batch) costs its compute —
    every op of its layers (and the head and loss on the last piece) at `layer_costs.op_seconds`
    with the preset's measured fractions (`ceiling` overrides the matmuls' `matmul_eff`;
    `dropout`: GPT's dropouts, as Megatron's runs had them; `block`, `mla`: `layer_ops`'s
    GPT block and DeepSeek's latent attention; `mtp`: DeepSeek's multi-token-prediction
    modules on the last stage; recomputation repeats the forward
    (full) or the unfused attention core (selective; a fused kernel's backward already
    recomputes it)) — plus its collectives on the
    critical path: TP (α per call), CP and EP bytes split half to the forward, half to the
    backward, at their groups' bandwidths (`Hardware.link` × the preset's measured
    `link_eff`; EP: `_ep_seconds`, node-limited with `ep_nodes`), and the pipeline send of its
    output (α + its bytes at the link). The expert
    all-to-all of an op that the schedule pairs with an op of the other direction (DualPipe's
    F&B chunks) hides behind that pair's compute: `ep_overlap` of it, at most the compute
    (default 1: DeepSeek-V3's report says DualPipe hides its all-to-all fully); unpaired
    ops hide none. `picolib.pipeline_simulator.simulate` plays the schedule with these
    costs; each rank's idle time is the schedule's bubble, read off the simulation, not a
    formula per name. Data-parallel traffic overlaps the rank's last micro-batch backward
    (B + W of its stages), the rest is exposed (`dp_overlap=False`: all of it, as Megatron-LM's
    "local" DDP all-reduced after the last backward); then the optimizer's pass over the rank's
    shard (`_optimizer_seconds`). The step ends when the slowest rank ends.

    MFU = `model_flops_per_token` (6 × active parameters + causal attention) × tokens /
    (seconds × GPUs × dense peak). Returns {"seconds", "compute", "bubble", "tp", "cp",
    "ep", "pp", "dp", "dp_exposed", "optimizer"} of the slowest rank, "tokens_per_s", "mfu",
    "slowest" (its pipeline rank) and "ranks" (the same parts for every pipeline rank)."""
    hw = hardware(hw)
    if (ceiling is not None and not 0 < ceiling <= 1) or not 0 <= ep_overlap <= 1:
        raise ValueError(f"ceiling must be in (0, 1] and ep_overlap in [0, 1]; got {ceiling}, {ep_overlap}")
    if ep_nodes is not None and ep_nodes < 1:
        raise ValueError(f"ep_nodes must be ≥ 1, not {ep_nodes}")
    from .planner import cached_schedule, moe_of
    moe = moe_of(cfg, par, moe)            # the layout's experts where no MoEShape is given
    comp, hw = _compute_seconds(cfg, par, hw, moe, ceiling, dropout, block, mla, mtp)
    sched = cached_schedule(par.schedule, par.pp, par.micro_batches, par.v) if par.pp > 1 else None
    parts, cost = _op_costs(cfg, par, hw, moe, sched, comp, alpha, ep_nodes, ep_overlap)
    span = _play(sched, cost, par.micro_batches, par.pp)
    ranks = [_rank_totals(cfg, par, hw, moe, sched, comp, parts[r], span, r, dp_overlap)
             for r in range(par.pp)]
    # the slowest rank: the last to finish; of those (a pipeline ends together), the busiest
    slowest = max(range(par.pp), key=lambda r: (ranks[r]["seconds"], span - ranks[r]["bubble"]))
    out = dict(ranks[slowest])
    tokens = par.dp * par.micro_batches * par.micro_batch_size * par.seq
    out.update(tokens_per_s=tokens / out["seconds"], slowest=slowest, ranks=ranks,
               mfu=model_flops_per_token(cfg, par.seq, moe, causal) * tokens
               / (out["seconds"] * par.n_gpus * hw.peak(par.precision)))
    return out


def _compute_seconds(cfg, par, hw, moe, ceiling, dropout, block, mla, mtp):
    """({piece: (F, B, W, core)} seconds per micro-batch, the hardware the links are priced on):
    every op on the roofline, the links at NCCL's achieved fraction (`link_eff`)."""
    from dataclasses import replace as _replace
    comp = _stage_seconds_ops(cfg, par, hw, moe, ceiling, dropout, block, mla, mtp)
    return comp, _replace(hw, levels=tuple(_replace(lv, per_gpu=lv.per_gpu * hw.link_eff, total=lv.total * hw.link_eff)
                                           for lv in hw.levels))


def _comm_per_op(cfg, par, hw, moe, sched, alpha, ep_nodes):
    """(per pipeline rank {"tp", "cp", "ep"}: seconds of those collectives per F or B op, the
    seconds of one pipeline send of an activation)."""
    from .parallel_layout import pieces as n_pieces_of, stage_layers
    from .planner import stage_piece
    p, m = par.pp, par.micro_batches
    sent = [traffic(cfg, par, r, moe) for r in range(p)]
    e = 4 if par.precision == "fp32" else 2
    act = par.micro_batch_size * (par.seq // par.cp // (par.tp if par.sp else 1)) * cfg.hidden * e
    t_send = alpha + act / hw.link(2, stride=par.tp * par.cp * par.dp) if p > 1 else 0.0
    counts = stage_layers(cfg.n_layers, n_pieces_of(par))
    per_rank = []
    for r in range(p):
        pieces = [stage_piece(par, st) for st in (sched.stages_of(r) if sched else [0])]
        ops = m * len(pieces) // (len(sched.pipes) if sched else 1)   # forwards on this rank
        calls = (10 if par.sp else 4) * m * sum(counts[k] for k in pieces) if par.tp > 1 else 0
        per_rank.append({"tp": (sent[r]["tp"] / hw.link(par.tp) + calls * alpha) / ops / 2,
                         "cp": sent[r]["cp"] / hw.link(par.cp, stride=par.tp) / ops / 2,
                         "ep": _ep_seconds(cfg, par, hw, moe, sent[r]["ep"], ep_nodes) / ops / 2})
    return per_rank, t_send


def _op_costs(cfg, par, hw, moe, sched, comp, alpha, ep_nodes, ep_overlap):
    """(each pipeline rank's seconds by part, filled in as ops are priced; the cost of one
    schedule op): compute (recomputation repeats the forward or the attention core), its
    collectives (an expert all-to-all paired with an op of the other direction hides behind
    it), and the pipeline send of its output."""
    from .planner import stage_piece
    per_rank, t_send = _comm_per_op(cfg, par, hw, moe, sched, alpha, ep_nodes)
    full, selective = par.recompute == "full", par.recompute == "selective"
    paired = set()
    if sched:
        for r, ops in enumerate(sched.ops):
            for i in sched.overlap[r]:
                paired.update({ops[i], ops[i + 1]})
    parts = [dict.fromkeys(("compute", "tp", "cp", "ep", "pp"), 0.0) for _ in range(par.pp)]
    piece = {st: stage_piece(par, st) for st in range(len(sched.stage_ranks))} if sched else {0: 0}
    rank_of = sched.stage_ranks if sched else (0,)
    firsts = {st for st in piece if not sched or sched.is_first(st)}
    lasts = {st for st in piece if not sched or sched.is_last(st)}

    def cost(op):
        r = rank_of[op.stage]
        f, b, w, core = comp[piece[op.stage]]
        again = f if full else core if selective else 0.0           # what recomputation repeats
        c = {"F": f, "B": b + again, "W": w, "BW": b + w + again}[op.kind]
        comm = {k: (per_rank[r][k] if op.kind != "W" else 0.0) for k in ("tp", "cp", "ep")}
        if op in paired:
            comm["ep"] -= min(ep_overlap * comm["ep"], c)
        sends = (op.kind == "F" and op.stage not in lasts) or \
            (op.kind in ("B", "BW") and op.stage not in firsts)
        pp_t = t_send if sends else 0.0
        for k, v in (("compute", c), ("pp", pp_t), *comm.items()):
            parts[r][k] += v
        return c + pp_t + sum(comm.values())

    return parts, cost


def _play(sched, cost, m, p):
    """Seconds until the last rank ends: the schedule simulated with `cost` per op (one rank
    without a pipeline: its m forwards and backwards in a row)."""
    from .pipeline_schedules import Op
    from .pipeline_simulator import simulate
    if sched is None:
        return sum(cost(Op(k, 0, i)) for i in range(m) for k in ("F", "BW"))
    events = simulate(sched, cost=cost, check=False)
    return max(max((ev["end"] for ev in events if ev["rank"] == r), default=0.0) for r in range(p))


def _rank_totals(cfg, par, hw, moe, sched, comp, parts, span, r, dp_overlap):
    """One pipeline rank's parts of the step: its idle time in the schedule (the bubble; none
    without a pipeline), its data-parallel traffic and what of it the last backward (B + W of
    its stages) does not hide, the optimizer's pass."""
    from .planner import stage_piece
    busy = sum(parts.values())
    pieces = [stage_piece(par, s) for s in (sched.stages_of(r) if sched else [0])]
    window = sum(comp[k][1] + comp[k][2] for k in pieces) if dp_overlap else 0.0   # last backward
    t_dp = _dp_seconds(cfg, par, hw, moe, r)
    exposed = max(0.0, t_dp - window)
    opt = _optimizer_seconds(cfg, par, hw, moe, r)
    return {**parts, "bubble": span - busy if sched else 0.0, "dp": t_dp, "dp_exposed": exposed,
            "optimizer": opt, "seconds": span + exposed + opt}


# Ways to save memory, the cheapest first in this cost model: ZeRO-1/2 and selective
# recomputation (with flash attention) cost no time here, ZeRO-3 one more all-gather,
# full recomputation a third more compute. The search keeps the first that fits.
_CHEAPEST_FIRST = [(0, "none"), (1, "none"), (2, "none"), (0, "selective"), (1, "selective"),
                   (2, "selective"), (3, "none"), (3, "selective"), (0, "full"), (1, "full"),
                   (2, "full"), (3, "full")]


def trainer_refuses(plan: Plan) -> str | None:
    """Why picolib's trainer cannot run `plan` as it is (`TrainConfig.from_plan`, then
    `check_config`, a published model's shape as its preset), or None when it can."""
    from .compose import TrainConfig, check_config
    try:
        check_config(TrainConfig.from_plan(plan))
    except ValueError as e:
        return str(e)
    return None


def _divisors(n: int, upto: int) -> list[int]:
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def search(cfg: LlamaConfig, n_gpus: int, global_batch: int, seq: int, hw="H100-SXM",
           moe: MoEShape | None = None, top: int = 5, usable: float = 1.0,
           precision: str = "bf16", max_pp: int = 32, max_cp: int = 1,
           activations: str = "korthikanti", trainer: bool = False) -> list[dict]:
    """The `top` fastest configurations of `cfg` on `n_gpus` GPUs for a step of
    `global_batch` sequences of `seq` tokens whose per-rank memory (every pipeline rank),
    with the runtime overhead on a GPU (`planner.runtime_overhead`: CUDA context, NCCL
    buffers, allocator reserve), fits in `usable` × the GPU's memory. Tries tp ≤ node (with SP), pp | layers (1F1B; interleaved v=2 where it
    applies), cp ≤ `max_cp` (1: context parallelism is for long sequences), micro-batch
    1, 2, 4; for each, the cheapest of ZeRO 0-3 × recomputation
    none / selective / full that fits (`_CHEAPEST_FIRST`). `activations`: the planner's
    activation count; with "picolib" (the Llama block picolib runs, measured) recompute
    "none" would keep the eager s×s scores that a flash kernel never saves, so the ladder
    starts at "selective" (the scores recomputed in backward, as flash attention does).
    `trainer=True` keeps only layouts picolib's trainer runs as they are (`trainer_refuses`):
    where it refuses the cheapest that fits (ZeRO-3 with recomputation), the search goes
    on down the ladder. Each result: {"par", "plan" (`planner.Plan`: the model, `par` and `moe`, which
    `Plan.to_json` writes and the trainer runs: `python -m picolib.train --plan FILE`),
    "memory" (the worst rank), "time" (step_time)}."""
    hw = hardware(hw)
    if n_gpus < 1 or global_batch < 1 or seq < 1:
        raise ValueError(f"n_gpus, global_batch and seq must be positive; got {n_gpus}, "
                         f"{global_batch}, {seq}")
    budget, found = usable * hw.memory, []
    ladder = [(z, r) for z, r in _CHEAPEST_FIRST if activations != "picolib" or r != "none"]
    tps = [t for t in _divisors(n_gpus, hw.node) if t in (1, 2, 4, 8, 16, 32, 64)]
    pps = sorted(set(_divisors(cfg.n_layers, max_pp)) | {2 ** i for i in range(6) if 2 ** i <= max_pp})
    for tp, cp, pp, mbs in itertools.product(tps, _divisors(n_gpus, max_cp), pps, (1, 2, 4)):
        if n_gpus % (tp * cp * pp) or global_batch % (n_gpus // (tp * cp * pp) * mbs):
            continue
        dp = n_gpus // (tp * cp * pp)
        m = global_batch // (dp * mbs)
        scheds = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and m % pp == 0
                                  and cfg.n_layers >= 2 * pp else [])
        for name, v in scheds:
            base = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, ep=1 if moe is None else min(dp, 8),
                               sp=tp > 1, schedule=name, chunks=v, micro_batches=m,
                               micro_batch_size=mbs, seq=seq, precision=precision,
                               activations=activations)
            for zero, rec in ladder:
                if zero == 3 and pp > 1:
                    continue
                par = base.replace(zero=zero, recompute=rec)
                try:
                    mem = memory(cfg, par, moe=moe, overhead=hw.name != "CPU")
                except ValueError:
                    break
                if mem["total"] <= budget:
                    if trainer and trainer_refuses(Plan(cfg, par, moe)):
                        continue
                    found.append({"par": par, "plan": Plan(cfg, par, moe), "memory": mem,
                                  "time": step_time(cfg, par, hw, moe)})
                    break
    found.sort(key=lambda r: r["time"]["seconds"])
    return found[:top]


def describe(cfg: LlamaConfig, par: Parallelism, hw="H100-SXM", moe: MoEShape | None = None) -> str:
    """A plan in a few lines: degrees, memory of the worst rank, step time and MFU."""
    hw = hardware(hw)
    mem, t = memory(cfg, par, moe=moe, overhead=hw.name != "CPU"), step_time(cfg, par, hw, moe)
    gb = {k: v / 1e9 for k, v in mem.items()}
    extra = f" + runtime {gb['overhead']:.1f}" if "overhead" in gb else ""
    sched = f"{par.schedule}{f' v={par.v}' if par.v > 1 else ''}, " if par.pp > 1 else ""
    return (f"{par.n_gpus} × {hw.name}: TP{par.tp}{'+SP' if par.sp else ''} PP{par.pp} CP{par.cp} "
            f"DP{par.dp} (ZeRO-{par.zero}), {sched}m={par.micro_batches} × {par.micro_batch_size} "
            f"× {par.seq} tokens, recompute={par.recompute}\n"
            f"  memory per GPU (worst rank): params {gb['params']:.1f} + grads {gb['grads']:.1f} + "
            f"optimizer {gb['optimizer']:.1f} + activations {gb['activations']:.1f}{extra} = "
            f"{gb['total']:.1f} GB of {hw.memory / 1e9:.0f}\n"
            f"  step {t['seconds']:.2f} s (compute {t['compute']:.2f}, bubble {t['bubble']:.2f}, "
            f"TP {t['tp']:.2f}, exposed DP {t['dp_exposed']:.2f}, PP {t['pp']:.3f}); "
            f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} (every op on the roofline)")


# --------------------------------------------------------------------------- command line

def build_parser():
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m picolib.plan_search",
        description="Search the layouts of a model on N GPUs that fit and that picolib's trainer "
                    "runs as they are; print the fastest and write the best as a plan for "
                    "`python -m picolib.train --plan FILE` (or --dry-run --plan FILE).")
    p.add_argument("--preset", default="tiny", help="model shape: a trainer preset "
                   "(picolib.compose.MODEL_PRESETS)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) of the run")
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences per step")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--gpu", default="H100-SXM", help="the GPU and its network (picolib.hardware.GPUS)")
    p.add_argument("--experts", type=int, default=0, help="a mixture of this many experts per MLP "
                   "(the preset's MLP each, as the trainer builds them); 0: dense")
    p.add_argument("--top-k", type=int, default=1, help="experts per token")
    p.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    p.add_argument("--activations", default="korthikanti", choices=["korthikanti", "picolib"],
                   help="the planner's count of saved activations")
    p.add_argument("--max-pp", type=int, default=32, help="the most pipeline stages tried")
    p.add_argument("--top", type=int, default=3, help="plans to print")
    p.add_argument("--json", default=None, metavar="FILE", help="write the best plan here (Plan.to_json)")
    return p


def main(argv=None) -> list[dict]:
    from .compose import MODEL_PRESETS as presets
    from .model import LlamaConfig
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.preset not in presets:
        parser.error(f"unknown preset {a.preset!r}; choose one of {', '.join(presets)}")
    cfg = LlamaConfig(**presets[a.preset])
    moe = MoEShape(a.experts, a.top_k, cfg.ffn_hidden) if a.experts else None
    try:
        found = search(cfg, a.gpus, a.batch, a.seq, a.gpu, moe, top=a.top, precision=a.precision,
                       max_pp=a.max_pp, activations=a.activations, trainer=True)
    except ValueError as e:
        parser.error(str(e))
    if not found:
        parser.error(f"no layout of {a.preset} on {a.gpus} × {a.gpu} fits and runs in picolib's trainer")
    for r in found:
        print(describe(cfg, r["par"], a.gpu, moe), "\n")
    if a.json:
        found[0]["plan"].to_json(a.json)
        print(f"the best plan written to {a.json}: python -m picolib.train --plan {a.json} "
              "(--dry-run: what each rank would hold and send, without training)")
    return found


if __name__ == "__main__":
    main()
