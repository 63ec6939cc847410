"""This process and its device: making it the OOM killer's victim, DeepSpeed's single-process set-up, what it
runs on (device, cores, versions), the GPU cap it measures under, and its GPU memory and allocator readings.

Shared by the children that measure points (run_one.py, hf_peers.py, data_parallel_rank.py).
"""
from __future__ import annotations

import os
import platform
import socket
from typing import Any

from .point import Point

GiB = float(2**30)


def _prefer_oom_victim() -> None:
    """Make the kernel's OOM killer pick this child, not the parent sweep, when the host runs out."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def setup_environment(set_threads: bool = True) -> bool:
    """Single-process DeepSpeed without its launcher; CPU accelerator where there is no GPU. `set_threads`: torch's
    intra-op threads on every core (False: as the launch set them, as in a user's script).

    Must run before deepspeed is imported. Returns whether CUDA is available."""
    import torch

    from stronghold.engine.launch import single_process_env

    has_cuda = torch.cuda.is_available()
    single_process_env()
    if set_threads:
        torch.set_num_threads(os.cpu_count() or 1)
    return has_cuda


def environment_info(has_cuda: bool) -> dict[str, Any]:
    import torch
    import transformers

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except Exception as e:  # a missing DeepSpeed is itself worth recording
        ds_version = f"unavailable: {e}"
    cores = os.cpu_count() or 0
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if has_cuda:
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.total_memory / GiB:.0f} GiB)"
        gpu_total = props.total_memory / GiB
    else:
        gpu, gpu_total = f"cpu ({platform.processor() or platform.machine()})", None
    return {
        "device": f"{gpu}, {cores} CPU cores, {host_bytes / GiB:.0f} GiB host",
        "gpu_total_GB": gpu_total,
        "host_total_GB": host_bytes / GiB,
        "cpu_cores": cores,
        "hostname": socket.gethostname(),
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "deepspeed": ds_version,
        },
    }


def apply_gpu_cap(point: Point, has_cuda: bool) -> bool:
    """Cap this process's GPU allocations at point.gpu_cap_GB GiB (stronghold.engine.launch's limit); True if
    a cap was applied. Unlike the library, a cap above the device is an error: the point would not be
    measured under the cap it names."""
    import torch

    from stronghold.engine.launch import apply_gpu_memory_limit

    if point.gpu_cap_GB is None or not has_cuda:
        return False
    total = torch.cuda.get_device_properties(0).total_memory
    if point.gpu_cap_GB * GiB / total > 1:
        raise ValueError(f"gpu cap {point.gpu_cap_GB} GiB exceeds the device's {total / GiB:.1f} GiB: lower it or pass 'none'")
    apply_gpu_memory_limit(point.gpu_cap_GB, torch.device("cuda", 0))
    return True


def gpu_memory() -> dict[str, float]:
    """Peak GPU memory of this process so far, GiB: allocated by tensors, and reserved by the caching allocator."""
    import torch

    return {"peak_gpu_GB": torch.cuda.max_memory_allocated() / GiB,
            "peak_gpu_reserved_GB": torch.cuda.max_memory_reserved() / GiB}


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")
"""Caching-allocator events (torch.cuda.memory_stats): a retry frees the cache and synchronizes the device, and
cudaMalloc/cudaFree synchronize too, so a point run near its cap can lose time to them that plain training uncapped
does not."""


def allocator_counts() -> dict[str, int]:
    import torch

    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTS}


def pinned_allocator() -> dict[str, float]:
    """torch's page-locked host allocator so far: its cudaHostAlloc calls and their seconds, and the bytes it holds
    (what `pin_memory=True` costs; stronghold's exact-size buffers, pinned.py, do not go through it)."""
    import torch

    stats = torch.cuda.host_memory_stats()
    return {"allocations": int(stats.get("num_host_alloc", 0)),
            "alloc_s": stats.get("host_alloc_time.total", 0) / 1e6,
            "held_GB": stats.get("allocated_bytes.current", 0) / 1e9}


def allocator_per_step(at_warmup: dict[str, int], steps: int) -> dict[str, float]:
    """`allocator_counts` since `at_warmup` (read after the warm-up steps), per timed step."""
    return {key: (value - at_warmup[key]) / steps for key, value in allocator_counts().items()}
