"""The planner's inputs taken from the live model, machine and config: element counts per block and part
(`model_spec`), the GPU and host budgets (`budgets`) and the tiers of the parts outside the blocks (`rest_tiers`). The
placement (placement.py) plans with them at construction and after the first step."""
from __future__ import annotations

import logging
import shutil
import socket
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
from torch import nn

from stronghold import cgroups
from stronghold.planning import planner
from stronghold.planning.plan_types import DRIVE_SLOTS
from stronghold.config import Settings
from stronghold.integrations.discovery import ModelParts, row_table, split_rest
from stronghold.streaming import nvme_io, nvme_path
from stronghold.streaming.store import cpu_param_bytes

logger = logging.getLogger(__name__)


def model_spec(model: nn.Module, parts: ModelParts, trainable_ids: set[int], compute_dtype: torch.dtype,
               accumulation_steps: int) -> planner.ModelSpec:
    """Element counts per block and for the rest of the model, and by part of the rest (discovery.split_rest);
    tied parameters counted once."""
    seen: set[int] = set()

    def count(params) -> tuple[int, int]:
        numel = trainable = 0
        for param in params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            numel += param.numel()
            trainable += param.numel() if id(param) in trainable_ids else 0
        return numel, trainable

    blocks = []
    for block in parts.blocks:
        numel, trainable = count(block.parameters())
        blocks.append(planner.BlockSpec(numel=numel, trainable_numel=trainable))
    named = dict(model.named_parameters())
    rest_parts = []
    for name, names in split_rest(model, parts).items():
        numel, trainable = count(named[n] for n in names)
        rows = name == "input" and row_table(
            model, [named[n] for n in names if id(named[n]) in trainable_ids], parts.blocks) is not None
        rest_parts.append(planner.PartSpec(name=name, numel=numel, trainable_numel=trainable,
                                           before_blocks=name == "input", row_gradients=rows))
    leftover = count(model.parameters())
    assert leftover == (0, 0), "every parameter outside the blocks is in a part"
    return planner.ModelSpec(blocks=tuple(blocks), rest_numel=sum(p.numel for p in rest_parts),
                             rest_trainable_numel=sum(p.trainable_numel for p in rest_parts),
                             compute_bytes=torch.tensor([], dtype=compute_dtype).element_size(),
                             bf16=compute_dtype == torch.bfloat16,
                             accumulation_steps=accumulation_steps, rest_parts=tuple(rest_parts))


@dataclass(frozen=True)
class DeviceMemory:
    """What the GPU budget is made of, read from the device (`read`) or given (tests)."""

    free: int
    """Free on the device (cudaMemGetInfo): what other processes leave."""
    total: int
    reserved: int
    """Held by this process's caching allocator (free for our own placement to reuse)."""
    allocated: int
    fraction: float = 1.0
    """The process's memory fraction (torch.cuda.set_per_process_memory_fraction): its allocator fails beyond
    fraction x total, whatever is free."""

    @classmethod
    def read(cls, device: torch.device) -> "DeviceMemory":
        free, total = torch.cuda.mem_get_info(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
        return cls(free=free, total=total, reserved=torch.cuda.memory_reserved(device),
                   allocated=torch.cuda.memory_allocated(device),
                   fraction=get_fraction(device) if get_fraction is not None else 1.0)


def gpu_budget_bytes(memory: DeviceMemory, limit_gb: Optional[float]) -> int:
    """The least of: free memory plus what this process's allocator already holds (our own placement reuses it), the
    process's memory fraction of the card, and the cap (`gpu_memory_limit_gb`). A process capped by a fraction that
    was planned against the free memory ran out of memory in its first step."""
    gpu = min(memory.free + memory.reserved, int(memory.fraction * memory.total))
    if limit_gb is not None:
        gpu = min(gpu, int(limit_gb * planner.GIB))
    return gpu


def budgets(model: nn.Module, settings: Settings, device: torch.device,
            memory: Optional[DeviceMemory] = None) -> planner.Budgets:
    """GPU: `gpu_budget_bytes` of the device's memory (`memory`, read from it unless given). Host: available RAM plus
    the model's own CPU storage, which each block gives back as its parameters move into stronghold's buffers."""
    memory = DeviceMemory.read(device) if memory is None else memory
    gpu = gpu_budget_bytes(memory, settings.gpu_memory_limit_gb)
    # What this process already holds on the GPU, except the model's own parameters (placement
    # replaces them), is not ours to plan with: another model, an evaluation copy, cached tensors.
    on_gpu = sum(p.numel() * p.element_size() for p in _unique(model.parameters()) if p.device == device)
    held = max(0, memory.allocated - on_gpu)
    gpu -= held
    own = cpu_param_bytes(model)
    # Data parallel (data_parallel.py): the ranks split the host states and a node's ranks share one working
    # copy, so the node's available memory is the budget for the whole plan, not per rank. Across nodes a node
    # holds only its own ranks' shards: counting them all keeps the check on the safe side.
    local_ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    process = max(0, psutil.Process().memory_info().rss - own)
    limit = settings.host_memory_limit_gb
    reclaimed = own if local_ranks == 1 else node_model_bytes(own)
    return planner.Budgets(gpu_bytes=max(1, gpu), gpu_held_bytes=held, host_bytes=host_available(limit) + reclaimed,
                           local_ranks=local_ranks, host_process_bytes=process, host_limit_gb=limit,
                           drive=drive(settings))


def drive(settings: Settings) -> Optional[planner.Drive]:
    """The NVMe tier's drive under "nvme_path" (checked: a writable directory on a drive), its free space and rates:
    cached there by an earlier run on the same filesystem, else measured now (nvme_io.measure_rates, a few seconds)."""
    if settings.nvme_path is None:
        return None
    path = nvme_path.check_path(settings.nvme_path)
    rates = nvme_io.cached_rates(path)
    if rates is None:
        rates = nvme_io.measure_rates(path)
        logger.info(f"NVMe drive at {path}: {rates['read_bytes_per_s'] / 1e9:.2f} GB/s read, "
                    f"{rates['write_bytes_per_s'] / 1e9:.2f} GB/s write "
                    f"({'O_DIRECT' if rates['direct'] else 'buffered'}, {rates['probe_bytes'] / 2 ** 20:.0f} MiB "
                    f"measured; cached in {nvme_io.RATES_FILE})")
    return planner.Drive(free_bytes=shutil.disk_usage(path).free, read_bytes_per_s=rates["read_bytes_per_s"],
                         write_bytes_per_s=rates["write_bytes_per_s"], **drive_slots(settings),
                         max_io_s=settings.stall_timeout_s)


def drive_slots(settings: Settings) -> dict:
    """planner.Drive's staging buffer fields for "nvme_buffers": a number as set, or "auto" (None) up to DRIVE_SLOTS,
    fewer where that keeps a block off the drive; the runtime without a plan (the CPU) builds DRIVE_SLOTS."""
    return {"slots": settings.nvme_buffers or DRIVE_SLOTS, "fewer_slots": settings.nvme_buffers is None}


def node_model_bytes(own: int) -> int:
    """The CPU model bytes of every rank on this node (each built its own copy of the model, and the node-shared
    working copy replaces them all), gathered over the ranks: a collective. It also makes every rank wait until all
    have built their models, so the memory available read after it has none of them still to come."""
    host = socket.gethostname()
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (host, own))
    return sum(nbytes for name, nbytes in everyone if name == host)


_CONTAINER_TOLD: list[bool] = []
"""Whether the log has said that a container's limit binds (once a process: the budget is read more than once)."""


def host_available(limit_gb: Optional[float]) -> int:
    """Host bytes stronghold's buffers may add to what this process holds now: the memory available, no more than a
    container's memory cgroup still allows (cgroups.memory_available), and with `host_memory_limit_gb` no more than
    the limit less the process's resident set (the model's own storage, which the buffers replace, is added back by
    the callers, as for the available memory)."""
    available = psutil.virtual_memory().available
    contained = cgroups.memory_available()
    if contained is not None and contained < available:
        if not _CONTAINER_TOLD:
            _CONTAINER_TOLD.append(True)
            logger.info(f"host memory: the container's memory limit leaves {contained / planner.GIB:.2f} GiB of the "
                        f"{available / planner.GIB:.2f} GiB the host has available: planning with the former")
        available = contained
    if limit_gb is None:
        return available
    return max(0, min(available, int(limit_gb * planner.GIB) - psutil.Process().memory_info().rss))


def _unique(params):
    return {id(p): p for p in params}.values()


TIER_OF = {"gpu": planner.Tier.RESIDENT, "host": planner.Tier.CACHED, None: None}
"""The planner's tier for each resolved value of "rest_placement" (None: the planner's choice)."""


def rest_tiers(settings: Settings, spec: planner.ModelSpec):
    """The planner's `rest_tiers` from "rest_placement": one tier (or None) where every part has the same, else one
    per part of the model."""
    tiers = {part: TIER_OF[where] for part, where in settings.rest_placement.items()}
    if len(set(tiers.values())) == 1:
        return next(iter(tiers.values()))
    return {part.name: tiers.get(part.name) for part in spec.rest_parts}


def cached_on_cpu(settings: Settings) -> frozenset[str]:
    """The parts in the cached tier on a CPU device, where nothing is planned: those "rest_placement" sets to "host"
    (the settings keep the others resident there, as the rest always was)."""
    return frozenset(part for part, where in settings.rest_placement.items() if where == "host")


def built_tiers(spec: planner.ModelSpec, cached: frozenset[str]) -> dict:
    """The tiers a runtime was built with (`cached`: the initial plan's cached parts, which the runtime was built
    from): the parts outside the blocks keep theirs after construction."""
    return {p.name: planner.Tier.CACHED if p.name in cached else planner.Tier.RESIDENT for p in spec.rest_parts}
