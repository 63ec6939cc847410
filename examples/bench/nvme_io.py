"""The NVMe tier's two I/O backends on one drive: stronghold's thread pool of O_DIRECT preadv/pwritev
(streaming/nvme_io.DirectFiles) and DeepSpeed's async_io op (libaio, where it builds), each writing then reading back
one file of block-sized transfers, at a few degrees of parallelism. One JSON line per configuration, then a summary
line with the best of each backend.

    python3 -m examples.bench.nvme_io --dir /path/on/nvme [--gib 4] [--block-mib 600] [--json OUT.jsonl]
    python3 -m examples.bench.nvme_io --dir /path/on/nvme --mixed [--reps 5]

`--block-mib` is one transfer (the tier moves a block's whole state at once: 600 MB for a GPT-2 h2048 block in bf16).
Where DeepSpeed's op does not build the summary says why; the tier then has only the thread pool.

`--mixed`: the tier's steady pattern, one block's file written back while another's is read ahead, against the same
transfers one direction at a time (the planner's `nvme` term models the latter: read time plus write time), `--reps`
times each, alternating, on regions of the file written before (no first allocation in the timing). Whether the drive
moves more bytes with both directions in flight says whether the tier should ever let them overlap.
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
    back = handle.new_cpu_locked_tensor(block, torch.empty(0, dtype=torch.uint8))
    buffer.view(torch.float32).uniform_()
    back.zero_()
    path = str(directory / "probe")
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            handle.async_pwrite(buffer, path, offset)
        handle.wait()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            handle.async_pread(back, path, offset)
        handle.wait()
        read_s = time.perf_counter() - start
        verified = torch.equal(buffer, back)  # every block wrote the same bytes: the last one read holds them
    finally:
        handle.free_cpu_locked_tensor(buffer)
        handle.free_cpu_locked_tensor(back)
        Path(path).unlink(missing_ok=True)
    return {"backend": "deepspeed_aio", "intra_op_parallelism": parallel, "queue_depth": queue_depth,
            "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9, "verified": verified,
            "libaio": nvme_io.loaded_libaio()}


def _mixed(directory: Path, nbytes: int, block: int, threads: int, reps: int) -> dict:
    files = nvme_io.DirectFiles(directory, threads)
    written, read_into = nvme_io.aligned_buffer(block), nvme_io.aligned_buffer(block)
    written.view(torch.float32).uniform_()
    fd = files.open("probe", 2 * nbytes)

    def transfers(call, base: int) -> list:
        return [call(fd, written if call == files.write else read_into, block, offset=base + offset)
                for offset in range(0, nbytes, block)]
    try:
        for transfer in transfers(files.write, 0) + transfers(files.write, nbytes):
            transfer.wait()
        rates = {"together": [], "one_way": []}
        for rep in range(reps):
            target, source = (0, nbytes) if rep % 2 == 0 else (nbytes, 0)
            for how in ("together", "one_way"):
                start = time.perf_counter()
                if how == "together":
                    pending = transfers(files.write, target) + transfers(files.read, source)
                else:
                    pending = transfers(files.write, target)
                    for transfer in pending:
                        transfer.wait()
                    pending = transfers(files.read, source)
                for transfer in pending:
                    transfer.wait()
                rates[how].append(2 * nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        os.close(fd)
        files.close()
    median = {how: sorted(values)[len(values) // 2] for how, values in rates.items()}
    return {"mixed": True, "threads": threads, "direct": files.direct, "bytes_each_way": nbytes, "block_bytes": block,
            "GBps_total": rates, "median_GBps_total": median,
            "together_over_one_way": median["together"] / median["one_way"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="a directory on the drive")
    parser.add_argument("--gib", type=float, default=4.0, help="bytes written then read per configuration")
    parser.add_argument("--block-mib", type=int, default=600, help="one transfer")
    parser.add_argument("--threads", default="1,4,8,16", help="thread pool sizes to try")
    parser.add_argument("--json", default=None, help="append the lines here too")
    parser.add_argument("--mixed", action="store_true", help="only the mixed-direction check (see above)")
    parser.add_argument("--reps", type=int, default=5, help="--mixed: repetitions of each pattern")
    args = parser.parse_args(argv)
    block = nvme_io.aligned(args.block_mib * MiB)
    nbytes = max(1, int(args.gib * 2 ** 30) // block) * block
    lines = []
    if args.mixed:
        with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
            line = _mixed(Path(scratch), nbytes, block, nvme_io.DEFAULT_THREADS, args.reps)
        _emit([line], args.json)
        return 0
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
               "deepspeed_aio": "built" if aio else ("unavailable: DeepSpeed's async_io op needs libaio (libaio-dev, or "
                                                         "examples/bench/libaio_shim)")}
    _emit([*lines, summary], args.json)
    return 0


def _emit(lines: list[dict], path: str | None) -> None:
    out = open(path, "a") if path else None
    for line in lines:
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
    if out is not None:
        out.close()


if __name__ == "__main__":
    raise SystemExit(main())
