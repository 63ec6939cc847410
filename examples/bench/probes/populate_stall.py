"""How long another thread's memory mapping waits while the prefault thread populates host buffers (prefault.py).

The kernel holds the process's mmap lock for the whole of a MADV_POPULATE_WRITE call. A thread that maps or unmaps
memory meanwhile waits for the call to end; the first forward's compile maps and unmaps all the time (Python's
arenas, the allocators, the CUDA driver). Each case populates --buffers fresh private mappings of --buffer-mib MiB
(a block's fp32 moment, e.g.) on a thread, one call a buffer ("whole", as prefault.py did before it advised in
chunks) or prefault.CHUNK_BYTES a call ("chunked"), while the main thread maps 1 MiB, writes a byte and unmaps it,
over and over. Each case also runs the same loop with nothing beside ("alone"), for the loop's own latency. Cases
alternate, --rounds times. Prints one JSON line (appended to --json): per case, the populate's seconds and GB/s, and
the main thread's calls: count, median, p99 and largest latency, and the seconds they spent over 1 ms. Linux 5.14 on;
no GPU needed.

    python3 -m examples.bench.probes.populate_stall --json results/engine/populate_stall.jsonl
"""
from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from examples.provenance import emit_record  # noqa: E402
from stronghold.streaming import prefault  # noqa: E402

MIB = 2 ** 20
SLOW_S = 1e-3
"""A mapping call past this counts as stalled (an unstalled one takes microseconds)."""


def _fresh(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


def _map_loop(until: threading.Event, min_s: float = 0.0) -> list[float]:
    latencies, begin = [], time.perf_counter()
    while not until.is_set() or time.perf_counter() - begin < min_s:
        start = time.perf_counter()
        mapping = mmap.mmap(-1, MIB)
        mapping[0] = 1
        mapping.close()
        latencies.append(time.perf_counter() - start)
    return latencies


def _summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"calls": len(ordered), "median_ms": round(statistics.median(ordered) * 1e3, 4),
            "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 3), "max_ms": round(ordered[-1] * 1e3, 3),
            "stalled_s": round(sum(t for t in ordered if t > SLOW_S), 4)}


def _case(buffers: int, nbytes: int, chunk_bytes: int) -> dict:
    held = [_fresh(nbytes) for _ in range(buffers)]
    done, seconds = threading.Event(), []

    def populate_all() -> None:
        start = time.perf_counter()
        for _, tensor in held:
            if not prefault.populate(tensor.data_ptr(), nbytes, chunk_bytes=chunk_bytes):
                raise SystemExit("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 on)")
        seconds.append(time.perf_counter() - start)
        done.set()

    thread = threading.Thread(target=populate_all, daemon=True)
    thread.start()
    latencies = _map_loop(done)
    thread.join()
    held.clear()
    return {"populate_s": round(seconds[0], 3), "populate_GBps": round(buffers * nbytes / seconds[0] / 1e9, 2),
            "map_calls": _summary(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers", type=int, default=8)
    parser.add_argument("--buffer-mib", type=int, default=320, help="MiB a buffer (one advice call when whole)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="append the JSON line here")
    args = parser.parse_args()
    nbytes, rounds = args.buffer_mib * MIB, []
    for _ in range(args.rounds):
        row = {}
        for name, chunk in [("whole", 0), ("chunked", prefault.CHUNK_BYTES)]:
            row[name] = _case(args.buffers, nbytes, chunk)
            alone = threading.Event()
            alone.set()
            row[f"alone_after_{name}"] = {"map_calls": _summary(_map_loop(alone, min_s=row[name]["populate_s"]))}
        rounds.append(row)
    emit_record({"probe": "populate_stall", "kernel": platform.release(), "cores": os.cpu_count(),
                 "buffers": args.buffers, "buffer_mib": args.buffer_mib, "chunk_bytes": prefault.CHUNK_BYTES,
                 "slow_s": SLOW_S, "rounds": rounds}, args.json)


if __name__ == "__main__":
    main()
