"""Does one memory-streaming thread slow the launching thread more on some cores than on others (a hyperthread
sibling of its core, visible to the guest or not)?

    python3 -m examples.probe_cpu_siblings [--json OUT.json]

The launching thread (and autograd's, which it starts) is pinned to core 0. Launch-bound work (20000 tiny launches,
and autograd over 200 tiny ops) is timed alone, then beside one thread running stronghold's native accumulate on one
thread pinned to core j, for each other core j, then beside the accumulate on every core but 0. Session 28 found the
host accumulation slowing the Llama backward by 0.15-0.2 s on some machines, more when it ran longer on fewer threads
(results/placement/NOTES.md); a core whose neighbour slows core 0 far more than the others would say the cores share
execution units, and the kernel's threads could keep off the launching thread's neighbours.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from stronghold.optim.cpu_adam import load_kernel

from .probe_host_costs import autograd_ops, beside, block_buffers, per_call, save, tiny_launches


def topology() -> dict:
    out = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        out[cpu] = {name: (path / name).read_text().strip() for name in ("thread_siblings_list", "core_id",
                                                                        "physical_package_id") if (path / name).exists()}
    return out


def beside_on(cores: set, threads: int, work, calls: int) -> float:
    """Seconds per call of `work` while a thread pinned to `cores` runs the accumulate on `threads` threads (its
    kernel threads inherit the pin)."""
    kernel, (acc, g), pinned = load_kernel(threads), block_buffers(), []

    def background():
        if not pinned:  # on the background thread, once
            os.sched_setaffinity(0, cores)
            pinned.append(True)
        kernel.accumulate(acc, g, False)

    return beside(work, calls, background)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})  # this thread, and autograd's thread, started by the first backward below
    works = {"launches_us": (tiny_launches(), 3, 20000), "autograd_ms": (autograd_ops(), 40, 1)}
    out: dict = {"topology": topology(), "pinned_to": cores[0]}
    for name, (work, calls, per) in works.items():
        scale = 1e6 / per if name.endswith("_us") else 1e3
        rows = {"alone": scale * per_call(work, calls, torch.cuda.synchronize)}
        for core in cores[1:]:
            rows[f"beside_core_{core}"] = scale * beside_on({core}, 1, work, calls)
        rows["beside_all_others"] = scale * beside_on(set(cores[1:]), len(cores) - 1, work, calls)
        rows["alone_again"] = scale * per_call(work, calls, torch.cuda.synchronize)
        out[name] = {k: round(v, 3) for k, v in rows.items()}
        print(name, out[name], flush=True)
    print(out["topology"])
    save(out, args.json)


if __name__ == "__main__":
    main()
