"""Probe: do transparent huge pages speed up the CPU optimizer's kernels on this host?

The kernels stream through fp32 buffers of ~80 M elements a block at ~100-120 GB/s (the boundary's sums and previews
set the Llama GA 8 step's first forward, results/placement/NOTES.md, session 29). With 4 KiB pages the hardware
prefetchers stop at every page boundary and each page costs a TLB entry; 2 MiB pages remove both. torch's CPU
allocator asks the kernel for huge pages (2 MiB-aligned, madvise) when THP_MEM_ALLOC_ENABLE=1 is set before its
first large allocation, so this script runs itself twice, with and without it, and times the same calls, interleaved
within each process. It prints one JSON line per process: the host's THP mode, the AnonHugePages the buffers got,
and the median seconds and GB/s of accumulate (acc += g, bf16 g), preview (p, m, v, g -> bf16 weights) and step.

    python examples/probe_thp.py [--numel 79000000] [--repeats 9]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(numel: int, repeats: int) -> dict:
    import torch

    from stronghold.optim.cpu_adam import AdamWCoeffs, load_kernel
    from stronghold.streaming.pinned import anon_huge_pages_bytes

    kernel = load_kernel()
    before = anon_huge_pages_bytes() or 0
    p, m, v, acc = (torch.rand(numel) for _ in range(4))
    g = torch.rand(numel).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    coeffs = AdamWCoeffs(1e-4, 0.9, 0.95, 1e-8, 0.1, 10)
    calls = {"accumulate": (lambda: kernel.accumulate(acc, g, False), 10),
             "preview": (lambda: kernel.preview(p, m, v, acc, out, coeffs, 1.0), 18),
             "step": (lambda: kernel.step(p, m, v, acc, out, coeffs, 1.0), 30)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats + 1):
        for name, (fn, _bytes) in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    result = {"thp_env": os.environ.get("THP_MEM_ALLOC_ENABLE", ""), "threads": kernel.threads, "numel": numel,
              "anon_huge_MiB": round(((anon_huge_pages_bytes() or 0) - before) / 2 ** 20, 1)}
    for name, (_, nbytes) in calls.items():
        median = statistics.median(times[name][1:])
        result[name] = {"s": round(median, 5), "GB_per_s": round(nbytes * numel / median / 1e9, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=79_000_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.numel, args.repeats)))
        return
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(json.dumps({"thp_mode": mode.read_text().strip() if mode.exists() else "unknown"}))
    for env in ("", "1", "", "1"):
        environ = dict(os.environ)
        environ.pop("THP_MEM_ALLOC_ENABLE", None)
        if env:
            environ["THP_MEM_ALLOC_ENABLE"] = env
        subprocess.run([sys.executable, __file__, "--child", "--numel", str(args.numel), "--repeats",
                        str(args.repeats)], env=environ, check=True)


if __name__ == "__main__":
    main()
