"""Start-up cost of a distributed job: picolib.launch.run vs torch.multiprocessing.spawn.

The job: every rank joins a gloo group and all-reduces a 4-element float32 tensor; the
caller gets the results back. Timed end to end (processes started, group formed, one
all-reduce, processes gone), on 2, 4 and 8 ranks, median of REPEATS runs each.

picolib forks its ranks from a fork server that `import picolib.launch` starts in the
background. "warm" is a call once the server is up (every call but a session's first);
"first" is a fresh Python process that has imported torch (as a notebook has) timing
`import picolib.launch` plus its first `run` — it waits for the server to load.

    .venv/bin/python bench/launch.py            # writes bench/results/launch.json

The peer is the stock PyTorch way: `torch.multiprocessing.spawn` of a module-level
worker that calls `init_process_group("gloo", init_method="tcp://127.0.0.1:<free port>")`.
"""
from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from picolib.launch import run  # noqa: E402
from _report import write  # noqa: E402

WORLD_SIZES = (2, 4, 8)
REPEATS = 7
NUMEL = 4


def job() -> float:
    """What each rank does (both launchers): one all-reduce of a small tensor."""
    t = torch.full((NUMEL,), float(dist.get_rank()))
    dist.all_reduce(t)
    return t[0].item()


def spawn_worker(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    value = job()
    expected = world_size * (world_size - 1) / 2
    if value != expected:
        raise RuntimeError(f"rank {rank}: all-reduce gave {value}, expected {expected}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_picolib(world_size: int) -> float:
    t0 = time.perf_counter()
    values = run(job, world_size, timeout=60)
    dt = time.perf_counter() - t0
    assert values == [world_size * (world_size - 1) / 2] * world_size, values
    return dt


FIRST = """
import sys, time, torch
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import torch.distributed as dist
from picolib.launch import run
def job():
    t = torch.full(({numel},), float(dist.get_rank())); dist.all_reduce(t); return t[0].item()
assert run(job, {n}) == [{n} * ({n} - 1) / 2] * {n}
print(time.perf_counter() - t0)
"""


def time_first(world_size: int) -> float:
    """A fresh caller: `import picolib.launch` and the first run (the server still loading)."""
    code = FIRST.format(root=str(Path(__file__).resolve().parent.parent), numel=NUMEL,
                        n=world_size)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def time_spawn(world_size: int) -> float:
    t0 = time.perf_counter()
    tmp.spawn(spawn_worker, args=(world_size, free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - t0


STALL_RUNS, STALL_S = 300, 1.0


def count_stalls() -> dict:
    """STALL_RUNS sequential 4-rank runs: how many took over STALL_S (a rendezvous waiting on
    DNS took 5 s in 8 of 300 runs with the old TCP store)."""
    times = [time_picolib(4) for _ in range(STALL_RUNS)]
    return {"name": "sequential_4ranks", "runs": STALL_RUNS, "median_s": round(statistics.median(times), 4),
            "max_s": round(max(times), 4), "over_1s": sum(t > STALL_S for t in times)}


def main() -> list[dict]:
    # one phase at a time (warm picolib, first calls, spawn), so that the processes a phase
    # leaves exiting do not load the next one's measurements
    time_picolib(2)
    warm = {n: statistics.median(time_picolib(n) for _ in range(REPEATS)) for n in WORLD_SIZES}
    stalls = count_stalls()
    first = {n: statistics.median(time_first(n) for _ in range(REPEATS)) for n in WORLD_SIZES}
    time.sleep(5)
    peer = {n: statistics.median(time_spawn(n) for _ in range(REPEATS)) for n in WORLD_SIZES}
    rows = []
    for n in WORLD_SIZES:
        p, q, f = warm[n], peer[n], first[n]
        rows.append({"name": f"allreduce_{n}ranks", "picolib_s": round(p, 4),
                     "peer_s": round(q, 4), "ratio": round(p / q, 4),
                     "picolib_first_call_s": round(f, 4), "first_ratio": round(f / q, 4),
                     "world_size": n, "repeats": REPEATS, "numel": NUMEL,
                     "peer": "torch.multiprocessing.spawn + init_method=tcp://",
                     "torch": torch.__version__})
        print(f"{n} ranks: picolib warm {p:.3f} s, first call {f:.2f} s, spawn {q:.3f} s",
              file=sys.stderr, flush=True)
    print(f"{STALL_RUNS} sequential runs: median {stalls['median_s']:.3f} s, max "
          f"{stalls['max_s']:.3f} s, {stalls['over_1s']} over {STALL_S:g} s", file=sys.stderr)
    write("launch", rows + [stalls])
    return rows


if __name__ == "__main__":
    main()
