"""The host's CPU AdamW rate in the conditions the engine runs it in: alone, on huge pages, and beside PCIe copies.

The streamed blocks' update boundary is bound by host memory bandwidth, and the planner's host-memory floor term
uses the kernel's own rate, so this is the check for a new host. Times stronghold's native kernel (`step` with the
bf16 copy-out, 28 bytes a parameter of DRAM traffic) over a model-sized set of blocks, block by block as the engine
calls it, in three host conditions, interleaved round by round so that drift hits each alike:
  - `torch`: fp32 state from torch's CPU allocator (4 KiB pages unless the host's THP mode is "always");
  - `hugepage`: the same state in anonymous mappings advised MADV_HUGEPAGE, as the engine allocates its fp32 master
    and moments (stronghold/streaming/pinned.py `pageable_empty`);
  - `torch+dma`: `torch` while a CUDA side thread keeps H2D and D2H copies of pinned buffers going, as the
    streamed blocks' weights and gradients do (skipped without a GPU).
Prints one JSON line (and appends it to --json) with the rates, the DMA bandwidth sustained, and the host's THP mode.

    python3 -m examples.bench.probes.host_adamw --blocks 16 --block-numel 50000000 --json probe.jsonl
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file, not with -m: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from examples.provenance import emit_record  # noqa: E402
from stronghold.optim.adamw_kernel import AdamWCoeffs  # noqa: E402
from stronghold.optim.cpu_adam import load_kernel  # noqa: E402
from stronghold.planning.plan_types import ADAM_HOST_BYTES  # noqa: E402
from stronghold.streaming.pinned import anon_huge_pages_bytes, pageable_empty  # noqa: E402


def _thp_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def _blocks(count: int, numel: int, huge: bool) -> list[tuple]:
    out = []
    for i in range(count):
        make = (lambda: pageable_empty(numel, torch.float32)) if huge else (lambda: torch.zeros(numel))
        p, m, v = make(), make(), make()
        m.zero_()  # fault every page in now, as the engine's state is before the first step
        v.zero_()
        p.normal_(generator=torch.Generator().manual_seed(i))
        g = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + i)).bfloat16()
        out.append((p, m, v, g, torch.empty(numel, dtype=torch.bfloat16)))
    return out


class _DmaLoad:
    """H2D and D2H copies of pinned host buffers on a side stream, in a thread, until stopped."""

    def __init__(self, numel: int):
        self.host_up = torch.empty(numel, dtype=torch.bfloat16).pin_memory()
        self.host_down = torch.empty(numel, dtype=torch.bfloat16).pin_memory()
        self.dev = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
        self.dev2 = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
        self.stream = torch.cuda.Stream()
        self.bytes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                self.dev.copy_(self.host_up, non_blocking=True)
                self.host_down.copy_(self.dev2, non_blocking=True)
                self.stream.synchronize()
                self.bytes += 2 * self.host_up.numel() * 2
        self.seconds = time.perf_counter() - start

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--block-numel", type=int, default=50_000_000, help="parameters a block (GPT-2 h2048: 50 M)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: the engine's)")
    parser.add_argument("--dma-numel", type=int, default=256 * 1024 * 1024, help="elements a DMA buffer (bf16)")
    parser.add_argument("--json", help="append the JSON line here")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.block_numel < 1 or args.rounds < 1:
        raise ValueError("--blocks, --block-numel and --rounds must be positive")
    kernel = load_kernel(args.threads)
    coeffs = AdamWCoeffs(1e-4, 0.9, 0.95, 1e-8, 0.1, 1)
    sets = {"torch": _blocks(args.blocks, args.block_numel, False),
            "hugepage": _blocks(args.blocks, args.block_numel, True)}

    def sweep(blocks) -> float:
        start = time.perf_counter()
        for p, m, v, g, out in blocks:
            kernel.step(p, m, v, g, out, coeffs, 1.0)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"torch": [], "hugepage": []}
    dma = {}
    gpu = torch.cuda.is_available()
    if gpu:
        times["torch+dma"] = []
    for name in sets:
        sweep(sets[name])  # warm-up: first touch of the outputs
    for _ in range(args.rounds):
        for name in ("torch", "hugepage"):
            times[name].append(sweep(sets[name]))
        if gpu:
            with _DmaLoad(args.dma_numel) as load:
                time.sleep(0.2)
                times["torch+dma"].append(sweep(sets["torch"]))
            dma = {"dma_gb_per_s": round(load.bytes / max(load.seconds, 1e-9) / 1e9, 2)}
    params = args.blocks * args.block_numel
    record = {"probe": "host_adamw", "blocks": args.blocks, "block_numel": args.block_numel, "threads": kernel.threads,
              "thp": _thp_mode(), "anon_huge_pages_GB": round((anon_huge_pages_bytes() or 0) / 2**30, 2),
              "cpu_cores": torch.get_num_threads(), "device": torch.cuda.get_device_name(0) if gpu else "cpu", **dma}
    for name, samples in times.items():
        median = statistics.median(samples)
        record[name] = {"g_params_per_s": round(params / median / 1e9, 3),
                        "gb_per_s": round(params * ADAM_HOST_BYTES / median / 1e9, 1),
                        "seconds": [round(s, 3) for s in samples]}
    emit_record(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
