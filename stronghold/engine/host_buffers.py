"""The streamed blocks' host buffers, built for the runtime (runtime.py): in host memory, sharded over the node's
data-parallel ranks (with the cached parts' stores), or with their fp32 states in files on the NVMe drive."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stronghold.config import Settings
from stronghold.distributed.data_parallel import DataParallel
from stronghold.distributed.sharding import build_sharded_stores
from stronghold.optim.cpu_adam import load_kernel
from stronghold.streaming.compact import CompactMasters
from stronghold.streaming.grad_pool import GradPool
from stronghold.streaming.nvme import NvmeStates
from stronghold.streaming.nvme_setup import build_on_drive
from stronghold.streaming.pinned import HostMeter
from stronghold.streaming.store import BlockStore, ParamEntry, build_block_store, build_block_stores, counts


@dataclass(frozen=True)
class BufferLayout:
    """How the streamed blocks' buffers are laid out (the runtime's placement and check_layout decided it)."""

    compute_dtype: torch.dtype
    pin: bool
    host_accumulate: bool
    """Micro-steps' gradients are summed on the host (else the host receives one fp32 sum a step, or no sums)."""
    accumulate: bool
    """Accumulation over micro-steps at all (the sharded stores keep their accumulators for it)."""
    fp32_grads: bool
    """The gradients reach the host as fp32 sums (GPU accumulation, the blockwise backward)."""
    lean_until: int
    """Blocks below this index have no gradient buffer (store.py)."""
    spares: bool
    """A second gradient buffer per store (store.py)."""
    compact_master: bool
    pooled_grads: bool
    drive_slots: int
    """The NVMe tier's staging buffers."""


@dataclass
class HostBuffers:
    stores: dict[int, BlockStore]
    """The streamed blocks' stores by block index, in order."""
    unit_stores: dict[int, BlockStore]
    """With data parallel, the cached units' stores (negative indices), built sharded with the blocks'."""
    nvme: Optional[NvmeStates]
    """The tier of the blocks whose fp32 states live on the drive, or None."""


def build_host_buffers(layouts: dict[int, list[ParamEntry]], unit_layouts: dict[int, list[ParamEntry]],
                       on_drive: set[int], layout: BufferLayout, settings: Settings,
                       data_parallel: Optional[DataParallel], host: HostMeter) -> HostBuffers:
    """`layouts`: the streamed blocks' entries by index; `unit_layouts`: the cached units' (built here only with data
    parallel, sharded with the blocks'); `on_drive`: the blocks whose fp32 states go to settings.nvme_path."""
    # A rank holds its shard of a block's master (sharding.py): its staging buffer is the largest shard's.
    shards = 1 if data_parallel is None else data_parallel.world_size
    in_memory = [-(-counts(entries)[1] // shards) for i, entries in layouts.items() if i not in on_drive]
    compact_kernel = load_kernel(settings.cpu_optimizer_threads) if layout.compact_master else None
    """Splits and merges compact masters, in host memory (compact.py) and on the drive (nvme.py)."""
    compact = CompactMasters(compact_kernel, max(in_memory), host) if layout.compact_master and in_memory else None
    pool = (GradPool(max(counts(entries)[1] for entries in layouts.values()), layout.compute_dtype, layout.pin, host)
            if layout.pooled_grads and layouts else None)
    grad_dtype = torch.float32 if layout.fp32_grads else layout.compute_dtype
    unit_stores: dict[int, BlockStore] = {}
    if data_parallel is not None:
        built = build_sharded_stores(data_parallel, {**layouts, **unit_layouts}, layout.compute_dtype, layout.pin,
                                     layout.accumulate, host, compact)
        stores = {i: store for i, store in built.items() if i >= 0}
        unit_stores = {i: store for i, store in built.items() if i < 0}
    else:
        stores = build_block_stores({i: e for i, e in layouts.items() if i not in on_drive}, layout.compute_dtype,
                                    layout.pin, layout.host_accumulate, host, layout.lean_until, grad_dtype,
                                    layout.spares, compact, pool)
    nvme: Optional[NvmeStates] = None
    if on_drive:
        nvme, built = build_on_drive(settings.nvme_path, {i: layouts[i] for i in sorted(on_drive)},
                                     layout.compute_dtype, lambda i, entries: (
            build_block_store(i, entries, layout.compute_dtype, layout.pin, layout.host_accumulate, host,
                              lean=i < layout.lean_until, grad_dtype=grad_dtype, spare=layout.spares, pool=pool)),
            slots=layout.drive_slots, host=host, compact=compact_kernel)
        stores = dict(sorted({**stores, **built}.items()))
    return HostBuffers(stores, unit_stores, nvme)
