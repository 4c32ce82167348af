"""Accelerators, their networks, and what a collective costs on them (lesson 11).

What: presets of real systems (peak FLOP/s, memory, the bandwidth of each network level)
and the cost models lesson 00 taught — the ring and the tree under the α–β model, in-network
reduction (SHARP), the hierarchical all-reduce of a switched fat tree — plus the
compute/communication rooflines that follow: how many tokens per GPU each kind of
parallelism needs before its communication hides behind its matmuls.
Why: a plan for thousands of GPUs is arithmetic on these numbers; keeping them in one
place, with their sources, lets lesson 11 check every figure it states.

Sources. Peaks are *dense* (no 2:4 sparsity), from NVIDIA's datasheets: H100 SXM 989 TFLOP/s
BF16 and 1,979 FP8 (3,958 is FP8 with sparsity), 80 GB HBM3 at 3.35 TB/s; H200 the same
peaks with 141 GB at 4.8 TB/s; GB200 NVL72 180 PFLOP/s BF16 and 360 FP8 dense per 72 GPUs
(2.5 and 5 PFLOP/s each), 186 GB HBM3e per GPU at 8 TB/s. Networks: the H100 SuperPod as
the GPU chapter of *How to Scale Your Model* (the JAX scaling book) describes it — 18
NVLink-4 links × 25 GB/s = 450 GB/s per GPU inside an 8-GPU node; one 400 Gb/s InfiniBand
link (50 GB/s) per GPU to 8 leaf switches per 32-node scalable unit; 16 spine switches over
4 units; a switch carries 64 × 25 GB/s = 1.6 TB/s. NVLink 5 (Blackwell): 900 GB/s per GPU,
72 GPUs in one NVLink domain on NVL72. Bandwidths are per direction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .comm import ring_sent_bytes

__all__ = ["Level", "Hardware", "GPUS", "PRESETS", "hardware", "calibrated", "ring_time", "tree_all_reduce_time",
           "sharp_all_reduce_time", "all_reduce_bandwidth", "hierarchical_all_reduce_time",
           "critical_tokens_dp", "critical_tokens_moe", "tp_ffn_threshold", "max_tp_degree",
           "pp_min_stage_params", "ALPHA", "superpod_levels", "ring_all_reduce_levels"]

ALPHA = 5e-6   # seconds per ring step: an assumption (lesson 00's), not a measurement


@dataclass(frozen=True)
class Level:
    """One level of a switched network: `gpus` under one unit, each GPU's bandwidth to the
    unit's switches, and the unit's total switch bandwidth (all bytes/s, one direction)."""
    name: str
    gpus: int
    per_gpu: float
    total: float


@dataclass(frozen=True)
class Hardware:
    """A GPU and its network. `levels[0]` is the node (NVLink domain)."""
    name: str
    bf16: float            # dense peak FLOP/s
    fp8: float             # dense peak FLOP/s
    memory: float          # HBM bytes
    hbm_bandwidth: float   # bytes/s
    levels: tuple
    # Achieved fractions, each measured (sources at the presets; 1 and 0: the datasheet's roofline)
    matmul_eff: float = 1.0   # the largest matmul's FLOP/s over the dense peak
    hbm_eff: float = 1.0      # a large copy's bytes/s over the HBM bandwidth
    attention_eff: float = 1.0  # a fused attention kernel's FLOP/s (forward and backward) over the peak
    link_eff: float = 1.0     # a collective's bus bandwidth over the link's line rate (large messages)
    launch: float = 0.0       # seconds: the least time one kernel (one operation) takes
    sms: int = 0              # streaming multiprocessors: a matmul runs in whole waves of tiles (0: no tiles)

    @property
    def node(self) -> int:
        return self.levels[0].gpus

    def peak(self, precision: str) -> float:
        """Dense peak for the matmul precision: "bf16" (also fp32 mixed with bf16 compute) or "fp8"."""
        from .parallel_layout import PLANNED_PRECISIONS
        if precision not in PLANNED_PRECISIONS:
            raise ValueError(f"precision must be one of {PLANNED_PRECISIONS}, not {precision!r}")
        return self.fp8 if precision == "fp8" else self.bf16

    def link(self, n_gpus: int, stride: int = 1) -> float:
        """Per-GPU bandwidth (bytes/s, in the ring formulas' bytes) of a group of `n_gpus`
        GPUs spaced `stride` apart, numbered node by node. Inside one node: NVLink. A group
        that leaves the node moves its data level by level (reduce inside the node, exchange
        the shards across nodes, gather back; NCCL's several rings or its tree do the same):
        at each level it reaches, the k members of the group below that level share the
        traffic, each on its own link of the level, so the group gets k × that level's
        per-GPU bandwidth there, and NVLink (once k > 1) caps the node's part. The slowest
        level sets the pace. H100 SuperPod: tp = 16 over two whole nodes 8 × 50 = 400 GB/s;
        one GPU per node (a dp group across the tp groups) 50 GB/s, one NIC; 1,024 whole
        nodes' GPUs 400 GB/s (the spine's 256 × 25 GB/s is not the bottleneck), the
        all-reduce bandwidth of the scaling book's table."""
        if n_gpus < 1 or stride < 1:
            raise ValueError(f"need n_gpus ≥ 1 and stride ≥ 1, got {n_gpus}, {stride}")
        span = n_gpus * stride
        node = self.levels[0]
        if span <= node.gpus:
            return node.per_gpu
        k = min(n_gpus, max(1, node.gpus // stride))       # the group's members in one node
        bw = node.per_gpu if k > 1 else math.inf
        below = node.gpus
        for lv in self.levels[1:]:
            if span > below:
                bw = min(bw, k * lv.per_gpu)
            k, below = min(n_gpus, max(1, lv.gpus // stride)), lv.gpus
        return bw

    def _below(self, level: Level) -> int:
        i = self.levels.index(level)
        return 1 if i == 0 else self.levels[i - 1].gpus


_NVLINK4, _NVLINK5, _IB = 18 * 25e9, 18 * 50e9, 400e9 / 8
# cuBLAS's most efficient thread-block tiles, 256 × 128 and 128 × 256 output elements (NVIDIA, *Matrix
# Multiplication Background User's Guide*, §2.3 "Typical Tile Dimensions in cuBLAS"): a matmul's output
# is cut into such tiles, one tile an SM at a time, so it runs in ⌈tiles / SMs⌉ waves (§3.1-3.2, tile
# and wave quantization); `layer_costs.op_seconds` prices a matmul by them when a preset gives `sms`.
# SMs: A100 108 (the guide, §2.1), H100 SXM 132 (H100 whitepaper); H800 and H200 are the same die.
MATMUL_TILES = ((256, 128), (128, 256))
_SWITCH = 64 * 25e9
# Achieved fractions of the datasheet (docs/sources.md names each source), for Hopper GPUs:
# - matmul_eff: MAMF, the best matmul FLOP/s found by a search over shapes (Bekman, *Machine
#   Learning Engineering*, "Maximum Achievable Matmul FLOPS comparison table"): H100 SXM 792.1 of
#   989 TFLOP/s bf16 (80.1 %); A100 SXM 267.9 of 312 (85.9 %).
# - hbm_eff: a 4 GiB device-to-device copy on an H100 (NVL) moved 3.568 of its 3.938 TB/s (90.6 %;
#   an H100 ceiling probe, one operation timed alone: the "H100 ceiling probe" in docs/sources.md).
# - attention_eff: FlashAttention-2 reaches 50-73 % of the A100's peak (Dao 2023), its backward
#   (2.5× the forward's FLOPs) the low end; FlashAttention-3's backward on an H100 runs about as
#   far below its peak (Shah et al. 2024): 0.5, the low end.
# - link_eff: NCCL's protocol overhead, about 20 %: 370 GB/s of NVLink-4's 450 ("NCCL can get an
#   effective NVLink bandwidth of 370GB/s", NCCL's maintainer in nccl-tests issue 212).
# - launch: one operation issued from Python on an H100 took 4.2 µs (the same ceiling probe).
_HOPPER = dict(matmul_eff=792.1 / 989, hbm_eff=3.568 / 3.938, attention_eff=0.5,
               link_eff=370 / 450, launch=4.2e-6, sms=132)
GPUS = {   # each GPU with its network, by name (`hardware(name)`, the dry run's --gpu NAME)
    "H100-SXM": Hardware("H100-SXM", 989e12, 1979e12, 80e9, 3.35e12, (
        Level("node", 8, _NVLINK4, min(8 * _NVLINK4, 4 * _SWITCH)),
        Level("leaf", 256, _IB, min(256 * _IB, 8 * _SWITCH)),
        Level("spine", 1024, _IB / 2, min(32 * 16 * 2 * _IB, 16 * _SWITCH))), **_HOPPER),
}
GPUS["H200-SXM"] = Hardware("H200-SXM", 989e12, 1979e12, 141e9, 4.8e12, GPUS["H100-SXM"].levels,
                            **_HOPPER)
# NVL72 racks joined by one 400 Gb/s NIC per GPU in a non-blocking fat tree (assumed)
GPUS["GB200-NVL72"] = Hardware("GB200-NVL72", 2.5e15, 5e15, 186e9, 8e12, (
    Level("node", 72, _NVLINK5, 72 * _NVLINK5), Level("scale-out", 2**17, _IB, 2**17 * _IB)))
# H800 (SXM), as DeepSeek-V3 trained on it. The DeepSeek-V3 technical report (DeepSeek-AI,
# 2024, §3.1): 2,048 H800s, 8 per node over NVLink and NVSwitch, InfiniBand across nodes;
# "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)" — an
# effective rate, used here as the per-GPU NVLink bandwidth. Dense peaks as H100 SXM's (989
# BF16, 1,979 FP8 TFLOP/s; the H800 differs in its NVLink), 80 GB. The fabric above the
# node: one 50 GB/s NIC per GPU in a non-blocking fat tree (assumed).
GPUS["H800"] = Hardware("H800", 989e12, 1979e12, 80e9, 3.35e12, (
    Level("node", 8, 160e9, 8 * 160e9), Level("scale-out", 2048, _IB, 2048 * _IB)),
    **{**_HOPPER, "link_eff": 1.0})   # 160 GB/s is already the report's effective rate

# Systems beyond the four GPUs above (`hardware(name)` knows them too; GPUS stays the lesson-11 set).
# A100 SXM4 80 GB as Narayanan et al. and Korthikanti et al. ran it (NVIDIA Selene): A100
# datasheet 312 TFLOP/s dense bf16/fp16 (no fp8: the same figure), 2.039 TB/s; NVLink 3, 12 links
# × 25 GB/s = 300 GB/s per GPU in a node of 8; eight 200 Gb/s HDR InfiniBand NICs a node, one
# 25 GB/s NIC per GPU (Narayanan et al., §5). Its achieved fractions are its own (docs/sources.md):
# - matmul_eff: MAMF 267.9 of 312 TFLOP/s (Bekman's table, as above); 108 SMs (matmul guide, §2.1).
# - hbm_eff: a streaming read kernel on an A100 80GB SXM held 1.80 of its 2.04 TB/s, 88 %, which
#   Nsight Compute confirmed (the "A100 bandwidth probe" in docs/sources.md).
# - attention_eff: FlashAttention-2's A100 range, 50-73 % of the peak, its backward the low end: 0.5
#   (Megatron's runs of the table used no fused attention: `flash=False` prices their core).
# - link_eff: nccl-tests' all-reduce on 8 A100-SXM4-80GB over NVSwitch reached a bus bandwidth of
#   about 200 GB/s of NVLink 3's 300 (nccl-tests issue 149).
# - launch: as the H100's, 4.2 µs (no A100 measurement is cited; a kernel of these runs' shapes
#   lasts far longer, so it sets none of the table's times).
_NVLINK3, _HDR = 12 * 25e9, 200e9 / 8
PRESETS = dict(GPUS)
PRESETS["A100-SXM"] = Hardware("A100-SXM", 312e12, 312e12, 80e9, 2.039e12, (
    Level("node", 8, _NVLINK3, 8 * _NVLINK3), Level("scale-out", 2**14, _HDR, 2**14 * _HDR)),
    matmul_eff=267.9 / 312, hbm_eff=1.80 / 2.04, attention_eff=0.5, link_eff=200 / 300, launch=4.2e-6,
    sms=108)
# This machine's CPU, as lesson 12 measures it: bench/cpu_roofline.py wrote these figures
# (2026-11-28, torch 2.13.0+cpu, one thread): peak = an fp32 512³ matmul's FLOP/s, so
# matmul_eff = 1 by definition; memory = a 64 MiB copy's bytes/s (hbm_eff = 1 likewise); launch =
# one tiny operation's time; the link: a 2-process gloo all-reduce of 64 MiB, bus bandwidth.
# (bench/results/cpu_roofline.json; a 64×512 @ 512×512 matmul reached 0.39 of the peak).
CPU_MEASURED = {"peak": 85.7e9, "bandwidth": 23.4e9, "launch": 1.01e-6, "gloo_busbw": 1.45e9}
PRESETS["CPU"] = Hardware("CPU", CPU_MEASURED["peak"], CPU_MEASURED["peak"], 24e9, CPU_MEASURED["bandwidth"],
                          (Level("node", 2, CPU_MEASURED["gloo_busbw"], 2 * CPU_MEASURED["gloo_busbw"]),),
                          launch=CPU_MEASURED["launch"])


def calibrated(base: "str | Hardware", results) -> Hardware:
    """The preset `base` with the fractions `bench/gpu_calibrate.py` measured (`results`: its
    JSON file's path or its dict) in place of the cited ones; the datasheet figures stay."""
    import json
    from dataclasses import replace
    if not isinstance(results, dict):
        with open(results, encoding="utf-8") as f:
            results = json.load(f)
    hw = hardware(base)
    terms = results["terms"]
    unknown = set(terms) - {"matmul_eff", "hbm_eff", "attention_eff", "link_eff", "launch"}
    if unknown:
        raise ValueError(f"calibration terms {sorted(unknown)} are not fractions of a Hardware")
    return replace(hw, name=f"{hw.name} (calibrated on {results.get('device', '?')})", **terms)


def hardware(name: "str | Hardware") -> Hardware:
    """A preset by name (or a Hardware as it is); a clear error for an unknown name."""
    if isinstance(name, Hardware):
        return name
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; known (picolib.hardware.PRESETS): {sorted(PRESETS)}")
    return PRESETS[name]


# --------------------------------------------------------------------------- collectives

def _check(nbytes, n, bandwidth, alpha):
    if nbytes < 0 or n < 1 or bandwidth <= 0 or alpha < 0:
        raise ValueError(f"need nbytes ≥ 0, n ≥ 1, bandwidth > 0, alpha ≥ 0; got "
                         f"nbytes={nbytes}, n={n}, bandwidth={bandwidth}, alpha={alpha}")


def ring_time(op: str, nbytes: float, n: int, bandwidth: float, alpha: float = ALPHA) -> float:
    """α–β time of a ring collective (lesson 00): steps·α + bytes one rank sends / W.
    Reduce-scatter and all-gather take N−1 steps, all-reduce 2(N−1)."""
    _check(nbytes, n, bandwidth, alpha)
    steps = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}
    if op not in steps:
        raise ValueError(f"op must be one of {sorted(steps)}, not {op!r}")
    return steps[op] * (n - 1) * alpha + ring_sent_bytes(op, int(nbytes), n) / bandwidth


def tree_all_reduce_time(nbytes: float, n: int, bandwidth: float, alpha: float = ALPHA) -> float:
    """α–β time of a (double binary) tree all-reduce, as NCCL runs across nodes: a reduce up
    and a broadcast down, 2⌈log₂N⌉ steps of latency, and each rank sends about 2B (B up its
    tree, B down; two trees with swapped roles keep every link busy)."""
    _check(nbytes, n, bandwidth, alpha)
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bandwidth


def sharp_all_reduce_time(nbytes: float, n: int, bandwidth: float, alpha: float = ALPHA) -> float:
    """In-network reduction (NVLink SHARP): every GPU sends B to the switch once and receives
    the reduced B: B/W plus two steps of latency (lesson 00: 2(N−1)/N faster than a ring)."""
    _check(nbytes, n, bandwidth, alpha)
    return 0.0 if n == 1 else 2 * alpha + nbytes / bandwidth


def all_reduce_bandwidth(hw: "str | Hardware", n_gpus: int, inner: int = 1) -> float:
    """Effective all-reduce bandwidth (bytes/s per GPU, B/T) of a group of `n_gpus` GPUs
    spaced `inner` apart (the model-parallel ranks between them) over a switched tree with
    in-network reduction, as the scaling book models it: level i (S_i GPUs under a unit of
    total bandwidth W_i) takes B·S_i / (max(inner, S_{i−1})·W_i), the slowest level the group
    reaches sets the time. H100, inner 1: node 450 GB/s, leaf 400 GB/s, spine 6.4 TB/s."""
    hw = hardware(hw)
    if n_gpus < 1 or inner < 1:
        raise ValueError(f"need n_gpus ≥ 1 and inner ≥ 1, got {n_gpus}, {inner}")
    span, below, worst = n_gpus * inner, 1, math.inf
    for lv in hw.levels:
        if span > below:
            worst = min(worst, max(inner, below) * lv.total / lv.gpus)
        below = lv.gpus
    if span > hw.levels[-1].gpus:   # beyond the top level: as the top level
        worst = min(worst, max(inner, hw.levels[-1].gpus) * hw.levels[-1].total / hw.levels[-1].gpus)
    return worst


def hierarchical_all_reduce_time(nbytes: float, hw: "str | Hardware", n_gpus: int,
                                 inner: int = 1) -> float:
    """B / `all_reduce_bandwidth`: reduce inside the node, then the leaf, then the spine,
    the levels overlapped, the slowest one setting the pace (latency ignored)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be ≥ 0, not {nbytes}")
    return 0.0 if n_gpus == 1 else nbytes / all_reduce_bandwidth(hw, n_gpus, inner)


def superpod_levels(ib_switch: float = 64 * 400e9 / 8, nvswitch: float = 64 * 25e9) -> tuple:
    """The H100 SuperPod's node, leaf and spine levels computed from its links and switches
    (lesson 00): node = min(8 GPUs × 18 NVLink-4 links × 25 GB/s, 4 NVSwitches), leaf =
    min(256 GPUs' 400 Gb/s NICs, 8 leaf switches), spine = min(32 leaves × 16 spines ×
    2 × 400 Gb/s uplinks, 16 spine switches); per-GPU bandwidth = total / GPUs (per direction).
    `ib_switch`: one InfiniBand leaf or spine switch — 64 ports × 400 Gb/s = 3.2 TB/s.
    The scaling book prices those switches at NVSwitch's 64 × 25 GB/s = 1.6 TB/s, and the
    H100-SXM preset follows it: `superpod_levels(ib_switch=64 * 25e9)` returns its levels."""
    node = min(8 * _NVLINK4, 4 * nvswitch)
    leaf = min(256 * _IB, 8 * ib_switch)
    spine = min(32 * 16 * 2 * _IB, 16 * ib_switch)
    return (Level("node", 8, node / 8, node), Level("leaf", 256, leaf / 256, leaf),
            Level("spine", 1024, spine / 1024, spine))


def ring_all_reduce_levels(nbytes: float, hw: "str | Hardware", n_gpus: int,
                           alpha: float = 0.0) -> dict:
    """A hierarchical all-reduce built from rings (lesson 00's model at every level):
    reduce-scatter up the levels, a ring all-reduce at the top level the group reaches,
    all-gather back down. Level i runs rings of S_i/S_(i−1) members (one ring per position
    below it), each GPU on its own link of that level, over the B/S_(i−1) bytes the levels
    below left it; its reduce-scatter and all-gather together send what one ring all-reduce
    of those bytes sends. Returns {level: {"members", "sent_bytes" (per GPU), "seconds"}}.
    The levels one after the other take the sum of the seconds; perfectly overlapped, the
    maximum. Compare `hierarchical_all_reduce_time`, one pass of B per level (in-network
    reduction)."""
    hw = hardware(hw)
    if nbytes < 0 or n_gpus < 1:
        raise ValueError(f"need nbytes ≥ 0 and n_gpus ≥ 1, got {nbytes}, {n_gpus}")
    out, below = {}, 1
    for i, lv in enumerate(hw.levels):
        if n_gpus <= below:
            break
        span = n_gpus if i == len(hw.levels) - 1 else min(n_gpus, lv.gpus)
        if span % below:
            raise ValueError(f"{n_gpus} GPUs do not fill whole units of {below} at level {lv.name!r}")
        members, shard = span // below, nbytes / below
        out[lv.name] = {"members": members,
                        "sent_bytes": ring_sent_bytes("all_reduce", int(nbytes) // below, members),
                        "seconds": 2 * (members - 1) * (alpha + shard / members / lv.per_gpu)}
        below = span
    return out


# --------------------------------------------------------------------------- rooflines

def critical_tokens_dp(hw: "str | Hardware", n_gpus: int, inner: int = 1, fsdp: bool = False,
                       precision: str = "bf16") -> float:
    """Tokens per GPU above which data parallelism is compute-bound (backward of a layer with
    D·F weights): T_math = 2·2·2·B·D·F/(X·C) against T_comm = 2·2·D·F/W (bf16 gradients,
    all-reduce with in-network reduction) → B/X > C/(2W). FSDP (ZeRO-3) moves twice the
    bytes (all-gather + reduce-scatter of weights and gradients): twice the tokens."""
    c = hardware(hw).peak(precision)
    return (2 if fsdp else 1) * c / (2 * all_reduce_bandwidth(hw, n_gpus, inner))


def critical_tokens_moe(hw: "str | Hardware", n_gpus: int, n_experts: int, top_k: int,
                        ep: int = 1, fsdp: bool = False, precision: str = "bf16") -> float:
    """Tokens per GPU for a mixture of experts under DP × EP: each token uses k of E experts
    but the all-reduce carries all E (per EP group 1/ep of them, spaced ep apart):
    B/X > E·C/(2·k·W) with W the all-reduce bandwidth for inner = ep."""
    if min(n_experts, top_k, ep) < 1 or top_k > n_experts:
        raise ValueError(f"need 1 ≤ top_k ≤ n_experts and ep ≥ 1; got {top_k}, {n_experts}, {ep}")
    base = critical_tokens_dp(hw, n_gpus, inner=ep, fsdp=fsdp, precision=precision)
    return base * n_experts / top_k


def tp_ffn_threshold(hw: "str | Hardware", tp: int, precision: str = "bf16") -> float:
    """TP of degree Y inside a node is compute-bound while F > C·(Y−1)/W, i.e. Y < F / T with
    T = C·(Y−1)/(Y·W) (all-gather + reduce-scatter of the activation per matmul pair against
    its F/Y share of the FLOPs). H100 at Y = 8: T = 989e12·7/(8·450e9) ≈ 1,923."""
    hw = hardware(hw)
    if tp < 2:
        raise ValueError(f"tp must be ≥ 2 to communicate, not {tp}")
    return hw.peak(precision) * (tp - 1) / (tp * hw.link(tp))


def max_tp_degree(hw: "str | Hardware", ffn_hidden: int, precision: str = "bf16") -> int:
    """The largest Y ≤ the node size for which Y < F / tp_ffn_threshold(Y) (1 if none)."""
    hw = hardware(hw)
    ok = [y for y in range(2, hw.node + 1) if y < ffn_hidden / tp_ffn_threshold(hw, y, precision)]
    return max(ok, default=1)


def pp_min_stage_params(hw: "str | Hardware", hidden: int, precision: str = "bf16",
                        across_nodes: bool = True) -> float:
    """Pipeline parallelism sends one (tokens, h) activation forward and its gradient back per
    stage boundary (2·2h bytes per token in bf16) against 6·N_stage FLOPs per token: the
    tokens cancel, and the stage is compute-bound while N_stage > 4h·C/(6W)."""
    hw = hardware(hw)
    w = hw.levels[1].per_gpu if across_nodes and len(hw.levels) > 1 else hw.levels[0].per_gpu
    return 4 * hidden * hw.peak(precision) / (6 * w)
