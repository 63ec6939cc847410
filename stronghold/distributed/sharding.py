"""The streamed blocks' host states over the ranks (and the cached units', cached.py: blocks here): built sharded,
gathered one block at a time.

With data parallel each rank keeps only its shard of each streamed block's fp32 master, moments, gradient
buffer and accumulator, and the node keeps one shared working copy (data_parallel.py, shared_host.py).
This module makes sure no rank ever holds much more than that, not even for a moment:

Start-up (`build_sharded_stores`, called by the runtime in place of building full stores):
1. the node-shared working copy is created from the layouts' sizes, before any store exists;
2. block by block: local rank 0 writes its parameters into the block's part of the shared copy (on each
   node its own copy, which the nodes' first ranks then receive from rank 0: nodes.py); in
   bf16 / fp16 rank 0's fp32 values of the block's trainable parameters are broadcast and each rank keeps
   its shard of them as its master (the one transient: one block's fp32 master, 4 bytes per trainable
   element); in fp32 the master is the rank's shard of the shared copy itself; moments, gradient buffer
   and accumulator are allocated at shard size; then the block's parameters view the shared copy, which
   releases the model's own storage of that block before the next block is built;
3. a barrier: every rank sees the filled shared copy before anything reads it.
Every rank starts from rank 0's weights (as DeepSpeed's `_broadcast_model`), fp32 masters from rank 0's
original values, never from the compute-dtype copy. The earlier order (a full replica per rank, then
broadcast, then shard) peaked at a whole replica per rank: twice the node's steady state with 2 ranks.

Saves (`save_on_rank0`): rank 0 writes the checkpoint and drives the others: before it reads a sharded
block it announces the block, every rank sends its shard to rank 0 only (`dist.gather`, one state kind at
a time), rank 0 writes the block's shard file and drops it before announcing the next. So rank 0 holds one
block's fp32 states (12 bytes per trainable element, plus one kind's padded gather buffer) beyond its
steady state, the others nothing but their send buffer. When rank 0 finishes, or fails anywhere, it
announces that last, with its error, so no rank is left waiting in a gather that will not come.

Promotion (runtime.promote) gathers a block on every rank into the collective's device (`gather_block(everywhere=
True, on_device=True)`): the gathered states are the resident block's, views of the gather's buffer, with no round
trip through host memory (a D2H copy into fresh pageable pages, then the H2D copy of the promotion).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from stronghold.distributed.shared_host import SharedCopyConfig, create_shared_copy, shard_range
from stronghold.streaming.compact import CompactMasters
from stronghold.streaming.lifecycle import EntryStates
from stronghold.streaming.pinned import HostMeter
from stronghold.streaming.store import BlockStore, ParamEntry

if TYPE_CHECKING:
    from stronghold.distributed.data_parallel import DataParallel

T = TypeVar("T")

STAGE_NUMEL = 1 << 24
"""Elements per piece when a host buffer is broadcast through the device (NCCL cannot read host memory):
bounds the temporary device memory of the start-up broadcast to 64 MiB of fp32."""


def broadcast_host(data_parallel: DataParallel, tensor: torch.Tensor) -> None:
    """Broadcast a flat host buffer from rank 0, through the device when the backend needs it."""
    config, source = data_parallel.config, data_parallel.source()
    if config.device.type == "cpu":
        dist.broadcast(tensor, source, group=config.group)
        return
    stage = torch.empty(min(tensor.numel(), STAGE_NUMEL), dtype=tensor.dtype, device=config.device)
    for start in range(0, tensor.numel(), STAGE_NUMEL):
        piece = tensor[start:start + STAGE_NUMEL]
        view = stage[:piece.numel()]
        if data_parallel.rank == 0:
            view.copy_(piece)
        dist.broadcast(view, source, group=config.group)
        if data_parallel.rank != 0:
            piece.copy_(view)


def _fill_from_params(target: torch.Tensor, entries: list[ParamEntry], trainable_only: bool) -> None:
    for entry in entries:
        if trainable_only and entry.group is None:
            continue
        source = entry.param.data.detach().reshape(-1)
        target[entry.offset:entry.offset + entry.numel].copy_(source)  # casts, and copies from a device


@torch.no_grad()
def build_sharded_stores(data_parallel: DataParallel, layouts: dict[int, list[ParamEntry]],
                         compute_dtype: torch.dtype, pin: bool, accumulate: bool,
                         host: HostMeter, compact: Optional[CompactMasters] = None) -> dict[int, BlockStore]:
    """This rank's sharded store of each streamed block, over one node-shared working copy filled from rank
    0's parameters (see the module docstring); a collective over the data-parallel group. `compact`: each rank keeps
    its shard's compact master (compact.py): the low halves, beside its shard of the shared copy."""
    if not layouts:
        return {}
    rank, world, leader = data_parallel.rank, data_parallel.world_size, data_parallel.local_rank == 0
    config = SharedCopyConfig(local_rank=data_parallel.local_rank, local_world=data_parallel.local_world,
                              global_ranks=data_parallel.node_ranks(), timeout_s=data_parallel.config.shared_timeout_s)
    sizes = {i: (sum(e.numel for e in entries), compute_dtype) for i, entries in layouts.items()}
    shared = create_shared_copy(sizes, config, data_parallel.gather_on_node)
    data_parallel.share(shared)  # first: a failure below still closes it with the runtime
    host.track(shared.raw)
    stores = {}
    for index, entries in layouts.items():
        numel, trainable_numel = sizes[index][0], sum(e.numel for e in entries if e.group is not None)
        start, stop = shard_range(trainable_numel, rank, world)
        working = shared.working[index]
        if leader:  # each node's first rank fills its node's copy, with rank 0's values
            _fill_from_params(working, entries, trainable_only=False)
            if data_parallel.nodes is not None:
                data_parallel.nodes.broadcast_from_first_node(working)
        if compute_dtype == torch.float32:
            master = working[start:stop]  # the master is the shared copy: rank 0's values, after the barrier
        else:
            # fp32 from rank 0's original values, not from the compute-dtype copy: one block's transient.
            full = host.empty(trainable_numel, torch.float32)
            if rank == 0:
                _fill_from_params(full, entries, trainable_only=True)
            broadcast_host(data_parallel, full)
            if compact is None or index < 0:  # a cached unit's master is never compact (plan_bytes.host_bytes)
                master = host.track(full[start:stop].clone())
            else:  # the high halves are the leader's bf16 copy of these values: the same rounding, rewritten
                master, low = None, host.empty(stop - start, torch.int16)
                compact.fill(full[start:stop], working[start:stop], low)
            del full
        length = stop - start
        store = BlockStore(
            index=index, entries=entries, numel=numel, trainable_numel=trainable_numel, working=working,
            master=master, exp_avg=host.zeros(length), exp_avg_sq=host.zeros(length),
            grad=host.empty(length, compute_dtype, pin), accum=host.zeros(length) if accumulate else None,
            grad_sq=host.empty(1, torch.float32, pin), shard_start=start, shard_stop=stop,
            grad_spare=host.empty(length, compute_dtype, pin) if accumulate else None)
        if compact is not None and master is None:
            compact.add(store, low)
        # Releases this block's original storage before the next block is built (unless the caller holds it).
        store.point_params_at(working)
        stores[index] = store
    data_parallel.gather(None)  # every rank sees the filled copy before anything reads it
    shared.register_for_dma(data_parallel.config.device)
    return stores


@torch.no_grad()
def gather_block(data_parallel: DataParallel, store: BlockStore, host: HostMeter,
                 everywhere: bool, moments: bool = True, on_device: bool = False) -> Optional[EntryStates]:
    """A sharded block's full fp32 states, per trainable entry, on every rank (`everywhere`) or on rank 0
    only (None elsewhere); a collective: every rank calls it for the same blocks in order. One state kind
    is gathered at a time (through the device where the backend needs it), so the host holds one kind's
    padded buffer beside the per-entry tensors being filled. Without `moments` only the master is gathered
    (the moments come back None): for a block that no step has updated yet, whose moments are all zero.
    `on_device`: the entries are views of each kind's gather buffer on the collective's device, owned by nobody
    else (a promotion keeps them as the resident states), instead of host copies counted by `host`."""
    receives = everywhere or data_parallel.rank == 0
    states: dict[int, list[torch.Tensor]] = {entry.offset: [] for entry in store.trainable}
    with store.states(write=False) as parts:  # a compact master merged (compact.py)
        for part in parts if moments else parts[:1]:
            _gather_part(data_parallel, store, host, part, everywhere, states, on_device)
    if not receives:
        return None
    return {offset: tuple((kinds + [None, None])[:3]) for offset, kinds in states.items()}


def _gather_part(data_parallel: DataParallel, store: BlockStore, host: HostMeter, part: torch.Tensor,
                 everywhere: bool, states: dict[int, list[torch.Tensor]], on_device: bool) -> None:
    """One state kind of `gather_block`, appended per trainable entry to `states` where this rank receives."""
    config, world = data_parallel.config, data_parallel.world_size
    size = math.ceil(store.trainable_numel / world)
    receives = everywhere or data_parallel.rank == 0
    on_host = config.device.type == "cpu"
    send = part
    if not on_host or part.numel() != size:
        send = host.zeros(size) if on_host else torch.zeros(size, dtype=torch.float32, device=config.device)
        send[:part.numel()].copy_(part)
    flat = None
    if receives:
        flat = host.empty(size * world, torch.float32) if on_host and not on_device else torch.empty(
            size * world, dtype=torch.float32, device=config.device)
    if everywhere:
        dist.all_gather_into_tensor(flat, send, group=config.group)
    else:
        dist.gather(send, list(flat.view(world, size)) if flat is not None else None,
                    dst=data_parallel.source(), group=config.group)
    if receives:
        for entry in store.trainable:
            piece = flat[entry.offset:entry.offset + entry.numel].view(entry.shape)
            states[entry.offset].append(piece if on_device else host.track(piece.to("cpu", copy=True)))
    del flat, send


def _announce(data_parallel: DataParallel, message: tuple) -> tuple:
    """Rank 0's `message` on every rank."""
    box = [message if data_parallel.rank == 0 else None]
    dist.broadcast_object_list(box, src=data_parallel.source(), group=data_parallel.config.group)
    return box[0]


def save_on_rank0(data_parallel: DataParallel, stores: dict[int, BlockStore], host: HostMeter,
                  write: Callable[[Callable[[BlockStore], EntryStates]], T]) -> Optional[T]:
    """Rank 0 runs `write(gather)`, where `gather(store)` brings a sharded block's full state to rank 0 (the
    other ranks take part in each gather as rank 0 announces it); every rank raises if rank 0 failed.
    Returns `write`'s result on rank 0, None elsewhere."""
    if data_parallel.rank != 0:
        while True:
            kind, value = _announce(data_parallel, ())
            if kind == "done":
                break
            gather_block(data_parallel, stores[value], host, everywhere=False)
        if value is not None:
            raise RuntimeError(f"stronghold: failed on another rank, so this one stops too; rank 0: {value}")
        return None

    def gather(store: BlockStore) -> EntryStates:
        _announce(data_parallel, ("gather", store.index))
        return gather_block(data_parallel, store, host, everywhere=False)

    try:
        result = write(gather)
    except Exception as err:
        _announce(data_parallel, ("done", f"{type(err).__name__}: {err}"))
        raise
    _announce(data_parallel, ("done", None))
    return result
