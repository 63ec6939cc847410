"""What a fresh host page costs, in the conditions the engine's set-up and first step meet it (prefault.py).

Cases, each on a fresh mapping of --gb GiB, in this order:
  - page-locking (cudaHostRegister, as pinned.py does) a shared mapping as it is, then another after populating it
    from 16 threads (MADV_POPULATE_WRITE); the same for a private mapping advised MADV_HUGEPAGE;
  - eight buffers of --gb/8 locked from eight threads at once, as is and populated first (the set-up's threads);
  - torch's own pinned allocator (cudaHostAlloc) at --gb;
then, with all of those still locked (and one more populated and locked), the first and the second write of a private
mapping from 30 threads, huge pages advised (the fp32 moments' mapping) and not: how fast the first optimizer step
could write its moments. Needs a GPU and about 10 x --gb GiB of host memory. Prints one JSON line (and appends it to
--json) with each case's seconds, the kernel release and the host's THP settings.

    python3 -m examples.bench.probes.host_pages --gb 16 --json probe.jsonl
"""
from __future__ import annotations

import argparse
import mmap
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from examples.provenance import emit_record  # noqa: E402
from stronghold.streaming.pinned import host_register  # noqa: E402
from stronghold.streaming.prefault import populate  # noqa: E402

GIB = 2 ** 30


class Buffers:
    def __init__(self):
        self.keep: list = []

    def fresh(self, nbytes: int, shared: bool, huge: bool) -> torch.Tensor:
        flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        if huge:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, as pinned.pageable_empty does
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        self.keep.append((mapping, tensor))
        return tensor


def populate_from(tensor: torch.Tensor, threads: int) -> None:
    n, ptr = tensor.numel(), tensor.data_ptr()
    chunk = -(-n // threads // (2 << 20)) * (2 << 20)
    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(lambda a: populate(ptr + a, min(chunk, n - a)), range(0, n, chunk)))
    if not all(done):
        raise SystemExit("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 on)")


def lock(tensor: torch.Tensor) -> None:
    status = host_register(tensor.data_ptr(), tensor.numel())
    if status != 0:
        raise SystemExit(f"cudaHostRegister failed with CUDA error {status}")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return round(time.perf_counter() - start, 3)


def write_twice(buffers: Buffers, nbytes: int, huge: bool) -> tuple[float, float]:
    """The first and the second fill of a fresh private mapping (freed after)."""
    moments = buffers.fresh(nbytes, False, huge).view(torch.float32)
    first, second = timed(lambda: moments.fill_(1.0)), timed(lambda: moments.fill_(2.0))
    buffers.keep.pop()
    return first, second


def thp() -> dict:
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=int, default=16, help="GiB a case")
    parser.add_argument("--json", help="append the JSON line here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU: the cases page-lock for CUDA")
    torch.zeros(1, device="cuda")
    size, buffers, cases = args.gb * GIB, Buffers(), {}
    for name, shared, huge in [("shared", True, False), ("private_huge", False, True)]:
        plain, early = buffers.fresh(size, shared, huge), buffers.fresh(size, shared, huge)
        cases[f"lock_{name}_s"] = timed(lambda: lock(plain))
        cases[f"populate16_{name}_s"] = timed(lambda: populate_from(early, 16))
        cases[f"lock_{name}_populated_s"] = timed(lambda: lock(early))
    eight = [buffers.fresh(size // 8, True, False) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        cases["lock_shared_8_threads_s"] = timed(lambda: list(pool.map(lock, eight)))
        eight = [buffers.fresh(size // 8, True, False) for _ in range(8)]
        cases["populate_and_lock_shared_8_threads_s"] = timed(
            lambda: list(pool.map(lambda t: (populate_from(t, 2), lock(t)), eight)))
    cases["torch_pin_memory_s"] = timed(lambda: buffers.keep.append(torch.empty(size, dtype=torch.uint8,
                                                                                pin_memory=True)))
    extra = buffers.fresh(size, True, False)
    populate_from(extra, 16)
    lock(extra)
    torch.set_num_threads(30)
    for name, huge in [("huge", True), ("4k", False)]:
        cases[f"first_write_{name}_s"], cases[f"second_write_{name}_s"] = write_twice(buffers, 2 * size, huge)
    emit_record({"probe": "host_pages", "device": torch.cuda.get_device_name(0), "kernel": platform.release(),
                 "cores": os.cpu_count(), "thp": thp(), "gib_per_case": args.gb, "moments_gib": 2 * args.gb,
                 "cases_s": cases}, args.json)


if __name__ == "__main__":
    main()
