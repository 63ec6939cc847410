"""One rank of examples/bench/data_parallel.py (its `--child` mode), and the host-memory readings both sides use.

A rank builds the point's model and engine as every benchmark does (examples/bench: `systems.build`, the seeded
init of `model.py`, the GPU cap as `run_one` sets it, on the rank's own device from LOCAL_RANK), trains on batches
seeded by rank, times its optimizer steps with `run_one.optimizer_steps` and prints `run_one`'s start and result
lines; the parent (data_parallel.py) adds what only it sees (the node's memory, kills, timeouts).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from examples.bench.point import Point, point_from_args
from examples.bench.run_one import GiB, emit

BASELINE_ENV = "BENCH_DP_NODE_BASELINE_BYTES"
"""The node's used bytes before the launch, from the parent: rank 0 subtracts it from its steady reading."""
GC_ENV = "BENCH_GC"
"""An A/B of Python's full garbage collections, whose pauses come at different steps on each rank (the per-step
probes' `gc2_s` shows them): "python" (the default: the bench does nothing, and the collections
run on the engine's schedule, its "garbage_collection" setting) or "freeze" (after the warm-up steps, one full
collection, then `gc.freeze()`, so the later ones skip everything built until then). Each rank's record says which."""
GC_MODES = ("python", "freeze")
PROFILE_ENV = "BENCH_DP_PROFILE"
"""Set to 1: after the timed steps, every rank profiles one more step (profile_step.profile_one_step: per-stream busy
time, the compute stream's idle gaps, the top kernels, the engine's host ranges) into its record's `profile`."""


def gc_mode() -> str:
    mode = os.environ.get(GC_ENV, "python")
    if mode not in GC_MODES:
        raise ValueError(f"{GC_ENV}={mode!r}: use one of {', '.join(GC_MODES)}")
    return mode


# ---------------------------------------------------------------- memory readings (Linux /proc)

def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        out[name] = int(rest.split()[0]) * 1024
    return out


def node_memory_bytes() -> tuple[int, int, int]:
    """The node's used memory (MemTotal - MemAvailable: its processes', shared memory included), and of it Shmem (the
    node-shared copy; pinned buffers where the driver maps them shared) and AnonPages (private anonymous memory): the
    kinds a rank's transient can be. One read of /proc/meminfo."""
    info = _meminfo()
    return info["MemTotal"] - info["MemAvailable"], info.get("Shmem", 0), info.get("AnonPages", 0)


def node_used_bytes() -> int:
    """Memory the node's processes hold, shared memory included (MemTotal - MemAvailable)."""
    return node_memory_bytes()[0]


def proc_rss(pid: int | str = "self") -> tuple[int, int]:
    """(RSS, its shared-memory part RssShmem) of a process, bytes; (0, 0) once it is gone."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssShmem"):
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("VmRSS", 0), fields.get("RssShmem", 0)


def descendants_pss() -> tuple[int, int]:
    """(processes, their summed PSS in bytes) of this process's descendants: Inductor's compile workers (a pool of up
    to 32 a process, sized by the cores the process saw when torch._inductor.config was imported), a launcher's
    helpers. PSS splits the pages a forked worker shares with its parent among them, so the sum adds up."""
    import psutil

    count = total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_full_info().pss
            count += 1
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    return count, total


class RssTimeline:
    """This rank's RSS and its shared-memory part (pinned buffers and the node-shared copy count there) every
    `period_s` from construction, and its descendants' count and PSS every `children_period_s` (a scan of /proc:
    slower), with named marks (set-up done, first step done, warm-up steps done...), so a node peak can be placed in a
    rank's phase and kind of memory: the node sampler (data_parallel.py) sees only the sum."""

    def __init__(self, period_s: float = 0.05, points: int = 400, children_period_s: float = 1.0):
        self.start = time.monotonic()
        self.period_s, self.points = period_s, points
        self.children_every = max(1, round(children_period_s / period_s))
        self.samples: list[tuple[float, int, int]] = []
        self.children: list[tuple[float, int, int]] = []
        """(seconds, descendants, their PSS bytes)."""
        self.marks: dict[str, float] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="rss-timeline", daemon=True).start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self.period_s):
            now = time.monotonic() - self.start
            self.samples.append((now, *proc_rss()))
            if tick % self.children_every == 0:
                self.children.append((now, *descendants_pss()))
            tick += 1

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.monotonic() - self.start, 3)

    def record(self) -> dict[str, Any]:
        """The timeline ([seconds, RSS GiB, shared GiB], at most `points` samples, each the RSS peak of the samples it
        stands for), the marks and the RSS peak with its time."""
        self._stop.set()
        samples = list(self.samples)
        if not samples:
            return {"rss_marks_s": self.marks}
        stride = -(-len(samples) // self.points)
        kept = [max(samples[i:i + stride], key=lambda s: s[1]) for i in range(0, len(samples), stride)]
        at, peak, _ = max(samples, key=lambda s: s[1])
        children = list(self.children) or [(0.0, 0, 0)]
        c_at, c_count, c_peak = max(children, key=lambda s: s[2])
        return {"rss_timeline_GB": [[round(t, 2), round(b / GiB, 3), round(shared / GiB, 3)] for t, b, shared in kept],
                "rss_marks_s": self.marks,
                "rss_peak_GB": peak / GiB, "rss_peak_at_s": round(at, 3),
                "children_timeline": [[round(t, 1), n, round(b / GiB, 3)] for t, n, b in children[::max(
                    1, -(-len(children) // self.points))]],
                "children_pss_peak_GB": c_peak / GiB, "children_at_peak": c_count,
                "children_peak_at_s": round(c_at, 3)}


def dev_shm_bytes() -> int:
    """Size of /dev/shm, where stronghold maps the node-shared working copy (a container's default is small)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return stat.f_blocks * stat.f_frsize


def settle_node_memory(timeout_s: float = 15.0, tolerance: int = 256 << 20) -> int:
    """The node's used bytes once the previous configuration's memory is given back (pinned buffers are
    released after the process is reaped): two readings 0.5 s apart within `tolerance`."""
    deadline, last = time.monotonic() + timeout_s, node_used_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = node_used_bytes()
        if abs(now - last) < tolerance:
            return now
        last = now
    return last


# ---------------------------------------------------------------- one rank

def _bind_cores(local_rank: int, local_world: int) -> list[int]:
    """An equal contiguous share of the cores this process may use (a rank per share)."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // local_world)
    mine = cores[local_rank * share:(local_rank + 1) * share] or cores[-1:]
    os.sched_setaffinity(0, mine)
    return mine


def rank_batches(point: Point, count: int, device, rank: int) -> list[dict]:
    """model.random_batches with the seed offset by the rank: each rank its own data, rank 0 the other benches'."""
    import torch

    from examples.bench.model import SEED

    generator = torch.Generator().manual_seed(SEED + 1 + rank)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, point.vocab, (point.batch, point.seq), generator=generator).to(device)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def apply_rank_gpu_cap(point: Point, device) -> bool:
    """environment.apply_gpu_cap on this rank's device (that one assumes device 0)."""
    import torch

    from stronghold.engine.launch import apply_gpu_memory_limit

    if point.gpu_cap_GB is None or device.type != "cuda":
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    if point.gpu_cap_GB * GiB / total > 1:
        raise ValueError(f"gpu cap {point.gpu_cap_GB} GiB exceeds the device's {total / GiB:.1f} GiB: lower it or pass 'none'")
    apply_gpu_memory_limit(point.gpu_cap_GB, device)
    return True


def measure_rank(point: Point, rank: int, device, floor: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from examples.bench.model import SEED
    from examples.bench.environment import allocator_counts, allocator_per_step, gpu_memory
    from examples.bench.run_one import optimizer_steps, stronghold_telemetry
    from examples.bench.systems import build

    has_cuda = device.type == "cuda"
    timeline = RssTimeline()
    collector = gc_mode()
    record: dict[str, Any] = {"gpu_cap_applied": apply_rank_gpu_cap(point, device), "gc_mode": collector,
                              "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}

    built = build(point, device)
    timeline.mark("built")
    record.update(build_s=built.build_s, engine_init_s=built.engine_init_s)
    engine = built.engine
    batches = rank_batches(point, max(2, point.accumulation), device, rank)

    counts_at_warmup: dict[str, int] = {}

    def after_warmup() -> None:
        timeline.mark("warmed_up")
        if has_cuda:
            counts_at_warmup.update(allocator_counts())
        if point.system == "stronghold":
            engine.stronghold_report(reset=True)  # the report covers the timed steps only
        if collector == "freeze":
            gc.collect()
            gc.freeze()

    torch.manual_seed(SEED + rank)  # dropout masks: rank 0's are the other benches'
    sync = torch.cuda.synchronize if has_cuda else (lambda: None)
    per_step: list[dict] = []
    warmup_s: list[float] = []
    step_s, losses = optimizer_steps(engine, point, batches, sync, after_warmup,
                                     after_first=lambda: timeline.mark("first_step_done"), per_step=per_step,
                                     warmup_s=warmup_s)
    timeline.mark("timed_steps_done")
    record["gc_frozen"] = gc.get_freeze_count()
    record.update(per_step=per_step, warmup_step_s=warmup_s, step_s_all=step_s, step_s=statistics.median(step_s), loss_first=losses[0], loss_last=losses[-1],
                  optimizer_steps=getattr(engine, "global_steps", None))
    if has_cuda:
        record.update(gpu_memory())
        # A retry frees the allocator's cache and synchronizes the device: near the cap it costs step time.
        record["allocator_per_step"] = allocator_per_step(counts_at_warmup, len(step_s))
        if os.environ.get(PROFILE_ENV) == "1":
            from examples.bench.profile_step import profile_one_step

            one = point.with_(warmup_steps=0, timed_steps=1)
            record["profile"] = profile_one_step(
                lambda marker=None: optimizer_steps(engine, one, batches, sync, lambda: None, marker=marker)[0][0])
    if dist.is_initialized():
        dist.barrier()  # every rank in its steady state before rank 0 reads the node's memory
    rss, shmem = proc_rss()
    record.update(rss_steady_GB=rss / GiB, rss_shmem_steady_GB=shmem / GiB, **timeline.record())
    # The size of Inductor's compile pool, decided when its config module was first imported, from the cores the
    # process could use then (read, not imported here: importing it would decide it).
    inductor_config = sys.modules.get("torch._inductor.config")
    record["inductor_compile_threads"] = getattr(inductor_config, "compile_threads", None)
    if rank == 0:
        record["node_steady_used_GB"] = (node_used_bytes() - int(os.environ.get(BASELINE_ENV, "0"))) / GiB
    if point.system == "stronghold":  # the floor probes run on rank 0 only, with no collective
        record.update(stronghold_telemetry(engine, batches[0], point, floor and rank == 0))
    return record


def child_main(args: argparse.Namespace) -> int:
    import resource

    from examples.bench.environment import _prefer_oom_victim, environment_info, gpu_memory, setup_environment
    from examples.bench.run_one import caught

    point = point_from_args(args)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    _prefer_oom_victim()
    bound = args.bind_cores and local_world > 1
    cores = _bind_cores(local, local_world) if bound else sorted(os.sched_getaffinity(0))
    has_cuda = setup_environment(set_threads=False)  # CPU accelerator where there is no GPU; launch variables kept
    import torch

    if bound:  # else torch's threads stay as the launch set them (torchrun: OMP_NUM_THREADS=1), as in a user's script
        torch.set_num_threads(len(cores))
    device = torch.device("cuda", local) if has_cuda else torch.device("cpu")
    if has_cuda:
        torch.cuda.set_device(device)  # model.py draws its init on the current device
    # In the start event, so that a rank that times out still says what its launch set (ZeRO-Offload's CPU Adam runs
    # on OpenMP threads; torchrun sets OMP_NUM_THREADS=1 for several local ranks).
    emit({"event": "start", "rank": rank, "cores": len(cores), "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
          **environment_info(has_cuda)})
    result: dict[str, Any] = {"event": "result", "rank": rank}
    try:
        if args.simulate_crash:
            raise RuntimeError(f"simulated crash on rank {rank}")
        result.update(measure_rank(point, rank, device, args.floor))
        result["error"] = None
        result["torch_threads"] = torch.get_num_threads()  # after the engine's core share
    except BaseException as exc:  # noqa: B036 - every failure becomes a recorded outcome
        result.update(caught(exc))
    if has_cuda and "peak_gpu_GB" not in result:
        result.update(gpu_memory())
    result["peak_host_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    emit(result)
    if result["error"] is None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # left to the exit, gloo's threads can abort the rank (SIGABRT)
    return 0 if result["error"] is None else 1
