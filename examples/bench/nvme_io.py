"""The NVMe tier's two I/O backends on one drive: stronghold's thread pool of O_DIRECT preadv/pwritev
(streaming/nvme_io.DirectFiles) and DeepSpeed's async_io op (libaio, where it builds), each writing then reading back
one file of block-sized transfers, at a few degrees of parallelism. One JSON line per configuration, then a summary
line with the best of each backend.

    python3 -m examples.bench.nvme_io --dir /path/on/nvme [--gib 4] [--block-mib 600] [--json OUT.jsonl]

`--block-mib` is one transfer (the tier moves a block's whole state at once: 600 MB for a GPT-2 h2048 block in bf16).
Where DeepSpeed's op does not build the summary says why; the tier then has only the thread pool.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from stronghold.streaming import nvme_io

MiB = 2 ** 20


def _direct(directory: Path, nbytes: int, block: int, threads: int) -> dict:
    files = nvme_io.DirectFiles(directory, threads)
    buffer = nvme_io.aligned_buffer(block)
    buffer.view(torch.float32).uniform_()
    fd = files.open("probe", nbytes)
    try:
        start = time.perf_counter()
        writes = [files.write(fd, buffer, block, offset=offset) for offset in range(0, nbytes, block)]
        for transfer in writes:
            transfer.wait()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        reads = [files.read(fd, buffer, block, offset=offset) for offset in range(0, nbytes, block)]
        for transfer in reads:
            transfer.wait()
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)  # DirectFiles.open removed the name: closing frees the space
        files.close()
    return {"backend": "direct_threads", "threads": threads, "direct": files.direct,
            "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9}


def _aio(directory: Path, nbytes: int, block: int, parallel: int, queue_depth: int) -> dict:
    from deepspeed.ops.op_builder import AsyncIOBuilder
    handle = AsyncIOBuilder().load().aio_handle(1 << 20, queue_depth, False, True, parallel)
    buffer = handle.new_cpu_locked_tensor(block, torch.empty(0, dtype=torch.uint8))
    buffer.view(torch.float32).uniform_()
    path = str(directory / "probe")
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            handle.async_pwrite(buffer, path, offset)
        handle.wait()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            handle.async_pread(buffer, path, offset)
        handle.wait()
        read_s = time.perf_counter() - start
    finally:
        handle.free_cpu_locked_tensor(buffer)
        Path(path).unlink(missing_ok=True)
    return {"backend": "deepspeed_aio", "intra_op_parallelism": parallel, "queue_depth": queue_depth,
            "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="a directory on the drive")
    parser.add_argument("--gib", type=float, default=4.0, help="bytes written then read per configuration")
    parser.add_argument("--block-mib", type=int, default=600, help="one transfer")
    parser.add_argument("--threads", default="1,4,8,16", help="thread pool sizes to try")
    parser.add_argument("--json", default=None, help="append the lines here too")
    args = parser.parse_args(argv)
    block = nvme_io.aligned(args.block_mib * MiB)
    nbytes = max(1, int(args.gib * 2 ** 30) // block) * block
    lines = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        directory = Path(scratch)
        for threads in (int(t) for t in args.threads.split(",")):
            lines.append(_direct(directory, nbytes, block, threads))
        aio = nvme_io.aio_available()
        if aio:
            for parallel, depth in ((1, 8), (4, 32), (8, 128)):
                lines.append(_aio(directory, nbytes, block, parallel, depth))
    best = {}
    for line in lines:
        mine = best.setdefault(line["backend"], line)
        if line["read_GBps"] + line["write_GBps"] > mine["read_GBps"] + mine["write_GBps"]:
            best[line["backend"]] = line
    summary = {"summary": True, "bytes": nbytes, "block_bytes": block, "best": best,
               "deepspeed_aio": "built" if aio else "unavailable: DeepSpeed's async_io op needs libaio (libaio-dev)"}
    out = open(args.json, "a") if args.json else None
    for line in [*lines, summary]:
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
