"""Each local rank's share of the node's cores, set once at start-up (`stronghold.initialize`).

Why: the CPU AdamW takes every core its process may use but one (cpu_adam.default_threads). With several ranks
on one node and no binding (plain `torchrun --nproc_per_node N`, `deepspeed --num_gpus N`, `accelerate launch`),
every rank would start cores - 1 threads: 62 threads on 32 cores for two ranks, which cost a third of the
2-GPU speed-up. So the engine itself gives local rank r of n its share r of the node's cores:

- one local rank: the process keeps every core it may use (nothing changes);
- an affinity the launcher already set is kept: a process whose cores are a strict subset of the cores the node
  gives this job (DeepSpeed's `--bind_cores_to_rank`, numactl, taskset per rank) was bound on purpose;
- otherwise the cores are split by `core_shares`: disjoint shares that cover them, as equal as the count allows
  (sizes differ by at most one core), each a contiguous run of whole physical cores (hyperthread siblings stay
  together) in NUMA-node order, so a share lies on one node wherever the sizes allow it (n ranks on n nodes of
  equal size: one node each).

The affinity is set on every thread the process has (threads started later inherit it), and torch's intra-op
threads are capped at the share unless OMP_NUM_THREADS says otherwise; so is Inductor's pool of compile workers (one
process a core, up to 32), unless TORCHINDUCTOR_COMPILE_THREADS says otherwise (`fit_compile_pool`). The CPU AdamW's default thread count then
follows from the share (cores - 1), and its worker keeps off one core of the share (`worker_cores`): the launching
thread's, so the thread that launches GPU work never queues behind the optimizer. "The node's cores" are the
cgroup's cpuset (a container's cores), else the online CPUs.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping, Optional, Sequence

from stronghold import cgroups

logger = logging.getLogger(__name__)

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
CGROUP = cgroups.ROOT


# Reading the machine (Linux sysfs; empty where absent) -----------------------------------------------------
def parse_cpu_list(text: str) -> frozenset[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.strip().split(","))):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _read_list(path: Path) -> Optional[frozenset[int]]:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return None


def numa_nodes(root: Path = SYS_NODE) -> list[frozenset[int]]:
    """The CPUs of each NUMA node with CPUs, by node number."""
    nodes = sorted((int(p.name[4:]), p) for p in root.glob("node[0-9]*") if p.name[4:].isdigit())
    found = [_read_list(path / "cpulist") for _, path in nodes]
    return [cpus for cpus in found if cpus]


def physical_cores(cpus: Iterable[int], root: Path = SYS_CPU) -> list[frozenset[int]]:
    """`cpus` grouped by physical core (hyperthread siblings together); a CPU whose topology is unknown is its own."""
    cpus, groups, seen = set(cpus), [], set()
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        siblings = (_read_list(root / f"cpu{cpu}" / "topology" / "thread_siblings_list") or frozenset({cpu})) & cpus
        group = frozenset(siblings | {cpu})
        seen |= group
        groups.append(group)
    return groups


def node_cpus() -> frozenset[int]:
    """The cores the node gives this job: the cgroup's effective cpuset (v2, then v1), else the online CPUs."""
    candidates = []
    for chain in cgroups.directories("cpuset", CGROUP):  # the effective cpuset already holds the ancestors'
        candidates += [chain[0] / "cpuset.cpus.effective", chain[0] / "cpuset.effective_cpus"]
    candidates += [CGROUP / "cpuset.cpus.effective", SYS_CPU / "online"]
    for path in candidates:
        cpus = _read_list(path)
        if cpus:
            return cpus
    return frozenset(range(os.cpu_count() or 1))


def local_ranks(env: Mapping[str, str]) -> tuple[int, int]:
    """(local rank, local world size) from what the launcher set: LOCAL_WORLD_SIZE (torchrun, accelerate),
    LOCAL_SIZE (DeepSpeed's launcher), Open MPI's; (0, 1) without a launcher."""
    rank = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    world = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))))
    return rank, world


# The decision (pure) -------------------------------------------------------------------------------------
def core_shares(local_world: int, cpus: Iterable[int], nodes: Sequence[Iterable[int]] = (),
                cores: Sequence[Iterable[int]] = ()) -> list[tuple[int, ...]]:
    """Local rank r's CPUs, for r < local_world: disjoint shares covering `cpus`, each a contiguous run of whole
    physical cores (`cores`: groups of sibling CPUs) in NUMA-node order (`nodes`: each node's CPUs), sizes as equal
    as the count allows. With fewer physical cores than ranks the siblings are split; with fewer CPUs than ranks
    the ranks share CPUs round-robin (then the shares cannot be disjoint)."""
    assert local_world >= 1
    cpus = sorted(set(cpus))
    assert cpus, "no CPU to share"
    node_of = {cpu: index for index, node in enumerate(nodes) for cpu in node}
    groups = [sorted(set(group) & set(cpus)) for group in cores]
    grouped = {cpu for group in groups for cpu in group}
    units = [group for group in groups if group] + [[cpu] for cpu in cpus if cpu not in grouped]
    if len(units) < local_world:
        units = [[cpu] for cpu in cpus]
    if len(units) < local_world:
        return [(cpus[r % len(cpus)],) for r in range(local_world)]
    units.sort(key=lambda unit: (node_of.get(unit[0], len(nodes)), unit[0]))
    shares, start = [], 0
    for rank in range(local_world):
        count = len(units) // local_world + (rank < len(units) % local_world)
        shares.append(tuple(sorted(cpu for unit in units[start:start + count] for cpu in unit)))
        start += count
    return shares


@dataclass(frozen=True, kw_only=True)
class CorePlan:
    """What a rank runs on; `how` says why: "all" (one local rank: every core the process may use), "launcher"
    (an affinity the launcher set, kept) or "share" (share `local_rank` of `local_world` of the node's cores)."""

    cores: tuple[int, ...]
    how: Literal["all", "launcher", "share"]
    local_rank: int
    local_world: int
    node_cores: int
    """How many cores the node gives this job."""
    numa_nodes: tuple[int, ...] = ()
    """The NUMA nodes `cores` lie on (empty where the host reports none)."""

    @property
    def changes(self) -> bool:
        return self.how == "share"

    def describe(self) -> str:
        where = f" on NUMA node{'s' if len(self.numa_nodes) > 1 else ''} {_ranges(self.numa_nodes)}" \
            if self.numa_nodes else ""
        why = {"all": "every core this process may use",
               "launcher": f"local rank {self.local_rank} of {self.local_world}: the affinity its launcher set",
               "share": f"local rank {self.local_rank} of {self.local_world}: its share of the node's "
                        f"{self.node_cores}"}[self.how]
        return f"{len(self.cores)} cores ({_ranges(self.cores)}{where}; {why})"


def plan_cores(local_rank: int, local_world: int, affinity: Iterable[int], node: Iterable[int],
               nodes: Sequence[Iterable[int]] = (), cores: Sequence[Iterable[int]] = ()) -> CorePlan:
    """This rank's cores from its current `affinity`, the `node`'s cores, its NUMA `nodes` and physical `cores`."""
    affinity, node = frozenset(affinity), frozenset(node)
    if local_world <= 1 or not 0 <= local_rank < local_world:  # one rank, or a launch that does not say
        how, mine = "all", tuple(sorted(affinity))
    elif affinity < node:
        how, mine = "launcher", tuple(sorted(affinity))
    else:
        how, mine = "share", core_shares(local_world, affinity, nodes, cores)[local_rank]
    on = tuple(index for index, cpus in enumerate(nodes) if set(cpus) & set(mine)) if len(nodes) > 1 else ()
    return CorePlan(cores=mine, how=how, local_rank=local_rank, local_world=local_world,
                    node_cores=len(node | affinity), numa_nodes=on)


def worker_cores(cores: Sequence[int], threads: int) -> tuple[int, ...]:
    """The CPU AdamW worker's cores: all of `cores` but the first, kept for the thread that launches GPU work,
    where the kernel's `threads` still have a core each; else all of them."""
    cores = tuple(sorted(cores))
    return cores[1:] if threads <= len(cores) - 1 else cores


def _ranges(values: Sequence[int]) -> str:
    values, parts, start = sorted(values), [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


# Applying it -------------------------------------------------------------------------------------------------
_APPLIED: Optional[CorePlan] = None
"""The plan `share_cores` set up in this process (the affinity is a property of the process)."""


def applied() -> Optional[CorePlan]:
    return _APPLIED


def set_thread_affinity(cores: Iterable[int], threads: Optional[Iterable[int]] = None) -> None:
    """Bind the given threads (ids; default: every thread of this process) to `cores`; threads that exit
    meanwhile are skipped."""
    cores = set(cores)
    if threads is None:
        try:
            threads = [int(tid) for tid in os.listdir("/proc/self/task")]
        except OSError:
            threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):
            pass


def share_cores(env: Mapping[str, str] = os.environ) -> CorePlan:
    """Decide this rank's cores from the launch and apply them (see the module docstring); idempotent."""
    global _APPLIED
    if _APPLIED is not None:
        return _APPLIED
    rank, world = local_ranks(env)
    affinity = os.sched_getaffinity(0)
    node = node_cpus()
    plan = plan_cores(rank, world, affinity, node, numa_nodes(), physical_cores(affinity))
    if plan.changes:
        set_thread_affinity(plan.cores)
        import torch
        if "OMP_NUM_THREADS" not in env and torch.get_num_threads() > len(plan.cores):
            torch.set_num_threads(len(plan.cores))
        fit_compile_pool(len(plan.cores), env)
    quota = cgroups.cpu_quota()
    limited = f"; the cgroup's CPU quota is {quota:.1f} cores' time for the node's ranks" \
        if quota is not None and quota < plan.node_cores else ""
    logger.info(f"cores: {plan.describe()}{limited}")
    _APPLIED = plan
    return plan


def fit_compile_pool(cores: int, env: Mapping[str, str] = os.environ) -> None:
    """Inductor sizes its pool of compile workers from the cores the process may use when its config module is
    imported: imported after the share is set, it reads the share; imported before (importing a transformers model
    class or `Trainer` imports it), every local rank would start a pool for the whole node at its first compile, n
    times the node's cores in processes that hold memory and take the cores from the CPU AdamW. So a pool not started
    yet is cut to the share."""
    config = sys.modules.get("torch._inductor.config")
    if config is None or "TORCHINDUCTOR_COMPILE_THREADS" in env:
        return
    started = getattr(getattr(sys.modules.get("torch._inductor.async_compile"), "AsyncCompile", None),
                      "process_pool", None)
    if started is not None and hasattr(started, "cache_info") and started.cache_info().currsize:
        return  # its workers are running: it keeps its size
    if isinstance(config.compile_threads, int) and config.compile_threads > cores:
        config.compile_threads = cores


def pin_worker(cpu) -> tuple[int, ...]:
    """Keep the CPU AdamW's worker (cpu_optim.CpuOptimizer; its kernel's threads inherit the worker's affinity)
    off the launching thread's core (`worker_cores`): the worker's first job binds it. Returns its cores."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    mine = worker_cores(cores, cpu.kernel.threads)
    if mine != cores:
        cpu.submit_after(lambda: os.sched_setaffinity(0, mine))
    kept = f", core {cores[0]} left to the thread that launches GPU work" if mine != cores else ""
    logger.info(f"CPU AdamW: {cpu.kernel.threads} threads on cores {_ranges(mine)}{kept}")
    return mine
