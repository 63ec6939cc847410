"""A background host-DRAM load like the CPU optimizer's gradient accumulation (`acc += g`: read fp32 and bf16,
write fp32, on many threads), for the contention experiment of issue 9: does plain DeepSpeed's step slow down when
the host's memory bus is as busy as stronghold keeps it during the micro-steps? Run it beside a benchmark point:

    python3 -m examples.bench.dram_load --threads 14 --seconds 120 --json load.jsonl &

It reports the bandwidth it sustained (bytes the kernel must move / wall time), so the load is a measured number.
"""
from __future__ import annotations

import argparse
import signal
import time

import torch

from examples.provenance import emit_record
from stronghold.optim.cpu_adam import load_kernel
from stronghold.planning.plan_types import ACCUMULATE_HOST_BYTES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=14)
    parser.add_argument("--seconds", type=float, default=120.0, help="stop after this long (or at SIGTERM)")
    parser.add_argument("--elements", type=int, default=256 * 1024 * 1024,
                        help="elements per buffer (default 256 Mi: 1 GiB fp32, far beyond any cache)")
    parser.add_argument("--native", action="store_true",
                        help="sum with stronghold's native kernel (cpu_adam.py), at its rate, not torch's add_")
    parser.add_argument("--json", help="append one JSON line with the sustained bandwidth here")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0 or args.elements < 1:
        raise ValueError("--threads, --seconds and --elements must be positive")
    torch.set_num_threads(args.threads)
    acc = torch.zeros(args.elements, dtype=torch.float32)
    grad = torch.ones(args.elements, dtype=torch.bfloat16)
    if args.native:  # torch's add_ moves ~21 GB/s on 16 cores, a sixth of what the native kernel moves
        kernel = load_kernel(args.threads)

        def add():
            kernel.accumulate(acc, grad, False)
    else:
        def add():
            acc.add_(grad)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    print("[dram_load] running", flush=True)  # a caller that will stop it waits for this line
    start, passes = time.perf_counter(), 0
    while not stop["now"] and time.perf_counter() - start < args.seconds:
        add()
        passes += 1
    wall = time.perf_counter() - start
    record = {"threads": args.threads, "native": args.native, "elements": args.elements, "passes": passes,
              "wall_s": round(wall, 3),
              "gb_per_s": round(passes * args.elements * ACCUMULATE_HOST_BYTES / wall / 1e9, 2)}
    emit_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
