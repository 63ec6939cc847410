"""How many host bytes a pinned buffer really takes: torch's pinned allocator vs an exact cudaHostRegister.

Issue 9's largest-model limit is host memory, so the bytes per streamed parameter must be what the
planner counts. torch's CachingHostAllocator may round a request up (to a power of two in the versions
that bucket by size); this probe allocates GPT-2 h2048 block-sized buffers both ways and records the
process RSS growth and torch's host allocator stats. Needs CUDA.

    python3 examples/probe_pinned_host.py --out $OUT/pinned.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.provenance import git_commit  # noqa: E402
from stronghold.streaming.pinned import host_register, host_unregister  # noqa: E402

GPT2_H2048_BLOCK = 12 * 2048 * 2048 + 13 * 2048  # parameters of one GPT-2 block at hidden 2048


def rss() -> int:
    return psutil.Process().memory_info().rss


def touch(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(1)  # RSS counts touched pages only


def torch_pinned(numel: int, count: int) -> dict:
    before = rss()
    bufs = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=True) for _ in range(count)]
    for b in bufs:
        touch(b)
    grown = rss() - before
    stats = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k and "current" in k}
    del bufs
    return {"method": "torch.empty(pin_memory=True)", "rss_growth_bytes": grown, "host_stats": stats}


def registered(numel: int, count: int) -> dict:
    before = rss()
    bufs = [torch.empty(numel, dtype=torch.bfloat16) for _ in range(count)]
    for b in bufs:
        touch(b)
        status = host_register(b.data_ptr(), b.numel() * b.element_size())
        if status != 0:
            raise RuntimeError(f"cudaHostRegister failed: {status}")
    grown = rss() - before
    dev = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dev.copy_(bufs[0], non_blocking=True)
    start.record()
    for b in bufs:
        dev.copy_(b, non_blocking=True)
    end.record()
    end.synchronize()
    h2d = count * numel * 2 / (start.elapsed_time(end) / 1e3)
    for b in bufs:
        host_unregister(b.data_ptr())
    return {"method": "torch.empty + cudaHostRegister", "rss_growth_bytes": grown, "h2d_bytes_per_s": h2d}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=GPT2_H2048_BLOCK)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.cuda.init()
    requested = args.numel * 2 * args.count
    rows = [registered(args.numel, args.count), torch_pinned(args.numel, args.count)]
    for row in rows:
        row.update(requested_bytes=requested, overhead=row["rss_growth_bytes"] / requested - 1, numel=args.numel,
                   count=args.count, torch=torch.__version__, device=torch.cuda.get_device_name(),
                   commit=git_commit())
        print(json.dumps(row), flush=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
