"""How long another thread's memory mapping waits while the prefault thread faults host buffers in (prefault.py).

The kernel holds the process's mmap lock for the whole of a MADV_POPULATE_WRITE call. A thread that maps or unmaps
memory meanwhile waits for the call to end; the first step maps and unmaps all the time (Python's arenas, the
allocators, the CUDA driver). Each case faults --buffers fresh buffers of --buffer-mib MiB, mapped as the fp32 moments
are (pinned.pageable_empty), in on a thread: by madvise, one call a buffer ("whole", as prefault.py did first) or
prefault.CHUNK_BYTES a call ("chunked"), or by the CPU AdamW kernel's `fault_in` (a locked add of zero a page, no
mmap lock: "fault_in", as prefault.py does now), while the main thread maps 1 MiB, writes a byte and unmaps it, over
and over. Each case also runs the same loop with nothing beside ("alone_after_..."), for the loop's own latency.
Cases alternate, --rounds times. Prints one JSON line (appended to --json): per case, the faulting's seconds and
GB/s, and the main thread's calls: count, median, p99 and largest latency, and the seconds they spent over 1 ms.
Linux 5.14 on and a C compiler; no GPU needed.
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
from typing import Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from examples.provenance import emit_record  # noqa: E402
from stronghold.optim.cpu_adam import NativeAdamW, load_kernel  # noqa: E402
from stronghold.streaming import prefault  # noqa: E402
from stronghold.streaming.pinned import pageable_empty  # noqa: E402

MIB = 2 ** 20
SLOW_S = 1e-3
"""A mapping call past this counts as stalled (an unstalled one takes microseconds)."""


def _fresh(nbytes: int) -> torch.Tensor:
    """A fresh buffer as the moments get theirs (huge pages advised where the host allows)."""
    return pageable_empty(nbytes // 4, torch.float32)


def _map_loop(until: threading.Event, min_s: float = 0.0) -> list[float]:
    """Map, write and unmap 1 MiB until `until` is set and `min_s` have passed, at least once: a populate that ends
    before this thread starts still leaves a call to summarize."""
    latencies, begin = [], time.perf_counter()
    while True:
        start = time.perf_counter()
        mapping = mmap.mmap(-1, MIB)
        mapping[0] = 1
        mapping.close()
        latencies.append(time.perf_counter() - start)
        if until.is_set() and time.perf_counter() - begin >= min_s:
            return latencies


def _summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"calls": len(ordered), "median_ms": round(statistics.median(ordered) * 1e3, 4),
            "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 3), "max_ms": round(ordered[-1] * 1e3, 3),
            "stalled_s": round(sum(t for t in ordered if t > SLOW_S), 4)}


def _case(buffers: int, nbytes: int, fault: Callable[[torch.Tensor], bool]) -> dict:
    held = [_fresh(nbytes) for _ in range(buffers)]
    done, seconds = threading.Event(), []

    def populate_all() -> None:
        start = time.perf_counter()
        for tensor in held:
            if not fault(tensor):
                raise SystemExit("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 on)")
        seconds.append(time.perf_counter() - start)
        done.set()

    thread = threading.Thread(target=populate_all, daemon=True)
    thread.start()
    latencies = _map_loop(done)
    thread.join()
    held.clear()
    return {"populate_s": round(seconds[0], 6), "populate_GBps": round(buffers * nbytes / seconds[0] / 1e9, 2),
            "map_calls": _summary(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers", type=int, default=8)
    parser.add_argument("--buffer-mib", type=int, default=320, help="MiB a buffer (one advice call when whole)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="append the JSON line here")
    args = parser.parse_args()
    nbytes, rounds = args.buffer_mib * MIB, []
    kernel = load_kernel(1)
    if not isinstance(kernel, NativeAdamW):
        raise SystemExit("needs the native CPU AdamW kernel (a C compiler) for the fault_in case")
    cases = [("whole", lambda t: prefault.populate(t.data_ptr(), nbytes, chunk_bytes=0)),
             ("chunked", lambda t: prefault.populate(t.data_ptr(), nbytes)), ("fault_in", kernel.fault_in)]
    for _ in range(args.rounds):
        row = {}
        for name, fault in cases:
            row[name] = _case(args.buffers, nbytes, fault)
            alone = threading.Event()
            alone.set()
            row[f"alone_after_{name}"] = {"map_calls": _summary(_map_loop(alone, min_s=row[name]["populate_s"]))}
        rounds.append(row)
    emit_record({"probe": "populate_stall", "kernel": platform.release(), "cores": os.cpu_count(),
                 "buffers": args.buffers, "buffer_mib": args.buffer_mib, "chunk_bytes": prefault.CHUNK_BYTES,
                 "page": mmap.PAGESIZE, "slow_s": SLOW_S, "rounds": rounds}, args.json)


if __name__ == "__main__":
    main()
