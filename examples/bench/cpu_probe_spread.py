"""The spread of the CPU AdamW probe the placement takes at construction (placement.measured.cpu_adam_probe), alone
and beside each kind of work that may run in the same process: what moves it, and which clock sees it.

Each round runs `telemetry.cpu_adam_probe` as the placement does (16 Mi parameters, bf16 gradients, three repeats)
and keeps both of its clocks: the kernel's own and the calling thread's wall. Rounds run alone, then beside a thread
that spins in Python (it holds the GIL between bytecodes), beside one that hashes a buffer (busy on a core, the GIL
released), and beside one that copies 1 GiB buffers (the host's memory bandwidth), then alone again.

    python3 -m examples.bench.cpu_probe_spread --out results/engine/cpu_probe_spread.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

if __package__ in (None, ""):  # run as a file, not with -m: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROBE_NUMEL = 16 * 2 ** 20
"""As placement's measure_rates calls it."""


def _rounds(kernel, rounds: int, gap_s: float) -> dict:
    from stronghold.engine.telemetry import cpu_adam_probe
    rows = []
    for _ in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        probe = cpu_adam_probe(kernel, numel=PROBE_NUMEL, dtype=torch.bfloat16)
        busy = (time.process_time() - cpu) / max(1e-9, time.perf_counter() - wall)
        rows.append({"kernel_G": [r / 1e9 for r in probe.kernel or ()], "wall_G": [r / 1e9 for r in probe.wall],
                     "process_cpus_busy": busy})
        time.sleep(gap_s)

    def spread(key: str) -> Optional[dict]:
        medians = [statistics.median(row[key]) for row in rows if row[key]]
        if not medians:
            return None
        return {"median": statistics.median(medians), "min": min(medians), "max": max(medians)}
    return {"kernel_clock": spread("kernel_G"), "wall_clock": spread("wall_G"), "rounds": rows}


def _beside(work: Callable[[threading.Event], None], kernel, rounds: int, gap_s: float) -> dict:
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    time.sleep(0.3)  # the work under way before the first round
    try:
        return _rounds(kernel, rounds, gap_s)
    finally:
        stop.set()
        thread.join()


def _python_spin(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1


def _hash(stop: threading.Event) -> None:
    buffer = bytes(64 * 2 ** 20)
    while not stop.is_set():
        hashlib.sha256(buffer).digest()


def _memory_copy(stop: threading.Event) -> None:
    source, target = torch.empty(2 ** 28), torch.empty(2 ** 28)
    while not stop.is_set():
        target.copy_(source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--gap-s", type=float, default=0.1, help="pause between rounds")
    parser.add_argument("--out", type=Path, default=None, help="JSONL file the record is appended to")
    args = parser.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    from examples.provenance import git_commit
    from stronghold.optim.cpu_adam import load_kernel
    kernel = load_kernel()
    conditions = {"alone": _rounds(kernel, args.rounds, args.gap_s)}
    for name, work in (("beside_python_spin", _python_spin), ("beside_hash", _hash),
                       ("beside_memory_copy", _memory_copy)):
        conditions[name] = _beside(work, kernel, args.rounds, args.gap_s)
    conditions["alone_after"] = _rounds(kernel, args.rounds, args.gap_s)
    record = {
        "bench": "cpu_probe_spread", "commit": git_commit(short=True) or "", "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "cpu_cores": os.cpu_count(),
        "kernel": type(kernel).__name__, "threads": kernel.threads, "probe_numel": PROBE_NUMEL,
        "switch_interval_s": sys.getswitchinterval(), "conditions": conditions,
    }
    line = json.dumps(record, sort_keys=True)
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(line + "\n")
    for name, result in conditions.items():
        clocks = {k: result[k] for k in ("kernel_clock", "wall_clock")}
        print(name, json.dumps(clocks), file=sys.stderr)


if __name__ == "__main__":
    main()
