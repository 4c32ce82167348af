"""The course's visual language: one colour per concept, one unit convention, one size rule
(every lesson's figures use it; lesson 00 states the conventions once).

Colours never change meaning. They come from Paul Tol's colour-blind-safe palettes, and no
two colours that can meet in one figure are a red/green pair:
- operations of a training step: `OPS` (F forward, B backward — in zero-bubble schedules only
  its input-gradient half —, W the weight-gradient half, BW a backward that does both);
- collectives: `COLLECTIVES`, keyed like `picolib.comm` names them;
- parallelism kinds: `PARALLELISM` (DP, TP, PP, CP, EP), also for bytes sent by kind;
- memory kinds: `MEMORY` (parameters, gradients, optimizer state, activations);
- ranks: `rank_color(r)`, a qualitative colour-blind-safe cycle.

Units: memory in binary units (KiB, MiB, GiB = 2¹⁰, 2²⁰, 2³⁰ bytes), bandwidth and FLOP/s in
decimal (GB/s = 10⁹ bytes/s), `fmt_bytes` and `fmt_rate` write them. Text at least 9 pt:
`use()` sets matplotlib's defaults to that; `picolib.figure_check` checks every figure.
"""
from __future__ import annotations

__all__ = ["OPS", "COLLECTIVES", "PARALLELISM", "MEMORY", "RANKS", "color", "rank_color",
           "fmt_bytes", "fmt_rate", "use", "MIN_POINTS"]

MIN_POINTS = 9

# Paul Tol, "bright" and "muted" qualitative schemes (colour-blind safe).
OPS = {"F": "#4477AA", "B": "#EE7733", "W": "#AA3377", "BW": "#DDAA33",
       "step": "#BBBBBB", "opt": "#BBBBBB", "idle": "#EEEEEE"}
COLLECTIVES = {"all_reduce": "#CC3311", "reduce_scatter": "#EE3377", "all_gather": "#009988",
               "all_to_all": "#33BBEE", "broadcast": "#997700", "send": "#777777",
               "recv": "#AAAAAA", "exchange": "#777777"}
PARALLELISM = {"DP": "#4477AA", "TP": "#228833", "PP": "#CCBB44", "CP": "#66CCEE",
               "EP": "#AA3377", "ZeRO": "#332288"}
MEMORY = {"params": "#2a9d8f", "grads": "#f4a261", "optimizer": "#e76f8a",
          "activations": "#8e6cc0"}
RANKS = ["#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677",
         "#882255", "#AA4499", "#BBBBBB"]


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "").replace(" ", "")


_ALL = {_key(k): v for table in (COLLECTIVES, PARALLELISM, MEMORY) for k, v in table.items()}


def color(name: str) -> str:
    """The colour of a concept by any of its spellings: "F", "all-gather", "AllGather",
    "all_gather", "TP", "params"… Raises KeyError for a name with no fixed colour."""
    if name in OPS:
        return OPS[name]
    key = _key(name)
    if key in _ALL:
        return _ALL[key]
    raise KeyError(f"no fixed colour for {name!r}: add it to picolib.style")


def rank_color(rank: int) -> str:
    """The colour of rank `rank` (cycles after ten ranks)."""
    return RANKS[rank % len(RANKS)]


def fmt_bytes(n: float, digits: int = 1) -> str:
    """Memory in binary units: 1536 → "1.5 KiB"."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_s: float, digits: int = 0) -> str:
    """Bandwidth in decimal units: 4.5e11 → "450 GB/s"."""
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(bytes_per_s) >= size:
            return f"{bytes_per_s / size:.{digits}f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def use() -> None:
    """matplotlib defaults for projected figures: 10-pt text, 9-pt ticks and legends at least,
    the rank colours as the default cycle."""
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10,
                         "xtick.labelsize": 9, "ytick.labelsize": 9, "legend.fontsize": 9,
                         "figure.titlesize": 12, "axes.prop_cycle": cycler(color=RANKS)})
