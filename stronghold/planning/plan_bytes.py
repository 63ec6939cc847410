"""GPU and host bytes of a placement, by part (planner.py plans with them). The accounting mirrors the engine as
built: store.py (host buffers of a streamed block: `store_bytes` is the one model of them, which the runtime's check
before it allocates uses too), gpu_optim.py (resident AdamW: fp32 masters, one chunk's fp32
gradient at a time), streams.py (W flat slots of the largest streamed block), device_accum.py (streamed gradients
accumulated on the GPU), cached.py (parts outside the blocks with their states on the host: plan_rest.py). Pure."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from stronghold.planning import plan_rest
from stronghold.planning.plan_result import GpuBytes, HostBytes, HostParts
from stronghold.planning.plan_types import (ACTIVATION_PREFETCH_BLOCKS, COMPACT_MASTER_BYTES, COMPACT_STAGING_SLOTS,
                                            FP32_BYTES, GIB, GRAD_POOL_BUFFERS, MOMENTS_BYTES, NVME_ALIGN,
                                            ROW_PIECE_BYTES, STREAMED_GRADS_IN_FLIGHT, Activations, Budgets,
                                            ModelSpec, default_host_margin)


def resident_bytes(numel: int, trainable: int, compute_bytes: int, accumulate: bool) -> int:
    """GPU bytes of parameters kept and updated on the GPU (gpu_optim.py): the weight of every
    parameter; per trainable one its gradient, an fp32 master (bf16 mode; in fp32 the weight is the
    master), the two moments, and with accumulation the fp32 accumulator."""
    master = 0 if compute_bytes == FP32_BYTES else FP32_BYTES
    accum = FP32_BYTES if accumulate else 0
    return numel * compute_bytes + trainable * (compute_bytes + master + MOMENTS_BYTES + accum)


def gpu_activation_bytes(model: ModelSpec, activations: Activations, offloaded: int) -> int:
    """The fixed peak, the per-block bytes of the blocks kept on the GPU, and those of the offloaded
    blocks that are back for backward at once."""
    kept = len(model.blocks) - offloaded
    return activations.fixed_peak_bytes + activations.per_block_bytes * (
        kept + min(offloaded, ACTIVATION_PREFETCH_BLOCKS))


def gpu_bytes(model: ModelSpec, activations: Activations, budgets: Budgets, resident: int, window: int,
               offloaded: int = 0, gpu_accumulation: bool = False, cached: frozenset[str] = frozenset()) -> GpuBytes:
    """`cached`: the parts outside the blocks in the cached tier (plan_rest.py)."""
    cb, accumulate = model.compute_bytes, model.accumulation_steps > 1
    kept, streamed = model.blocks[:resident], model.blocks[resident:]
    kept_rest, cached_rest = plan_rest.split(model, cached)
    rest_numel, rest_trainable = sum(p.numel for p in kept_rest), sum(p.trainable_numel for p in kept_rest)
    # ResidentOptimizer's torch path upcasts one chunk's bf16 gradients at a time (a chunk is one resident block or
    # the resident rest of the model); in fp32 mode the gradient already is fp32, and with accumulation the update
    # reads the fp32 accumulators (counted in `resident_bytes`) as they are.
    chunk = max([b.trainable_numel for b in kept] + [rest_trainable])
    transients = 0 if cb == FP32_BYTES or accumulate else chunk * FP32_BYTES
    if streamed:
        # With accumulation on the GPU what waits for its D2H is the block's fp32 window sum (device_accum.py).
        in_flight = FP32_BYTES if gpu_accumulation else cb
        transients += STREAMED_GRADS_IN_FLIGHT * in_flight * max(b.trainable_numel for b in streamed)
    # device_accum.py: an fp32 accumulator per streamed trainable parameter, and its gradient held until a
    # non-boundary backward ends.
    accumulators = sum(b.trainable_numel for b in streamed) * (FP32_BYTES + cb) if gpu_accumulation else 0
    slot = max((b.numel for b in streamed), default=0) * cb  # streams.allocate_slots: one size fits all
    return GpuBytes(
        resident=sum(resident_bytes(b.numel, b.trainable_numel, cb, accumulate) for b in kept),
        rest=resident_bytes(rest_numel, rest_trainable, cb, accumulate) + plan_rest.cached_gpu_bytes(cached_rest, cb),
        window=window * slot, transients=transients,
        activations=gpu_activation_bytes(model, activations, offloaded),
        margin=budgets.gpu_margin_bytes, accumulators=accumulators)


def state_kinds(compute_bytes: int) -> int:
    """fp32 tensors per trainable element in an NVMe state file without compact masters: master and moments, or only
    the moments in fp32 (where the working copy is the master)."""
    return MOMENTS_BYTES // FP32_BYTES + (0 if compute_bytes == FP32_BYTES else 1)


def state_file_bytes(trainable_numel: int, compute_bytes: int, compact: bool = False) -> int:
    """One block's NVMe state file (streaming/nvme.py): its moments and, in bf16/fp16, its fp32 master (with
    `compact` only the master's low half: the working copy holds the high one, compact.py), padded."""
    master = 0 if compute_bytes == FP32_BYTES else COMPACT_MASTER_BYTES if compact else FP32_BYTES
    return -(-trainable_numel * (MOMENTS_BYTES + master) // NVME_ALIGN) * NVME_ALIGN


def drive_staging_bytes(largest_trainable: int, compute_bytes: int, slots: int, compact: bool = False) -> int:
    """Host bytes of the NVMe tier's staging (nvme.py): `slots` buffers of the largest block's file, and with `compact`
    one fp32 buffer where a hold other than the update's merges a master."""
    merged = FP32_BYTES * largest_trainable if compact else 0
    return slots * state_file_bytes(largest_trainable, compute_bytes, compact) + merged


def drive_bytes(model: ModelSpec, resident: int, nvme: int, compact: bool = False) -> int:
    """Bytes on the drive for the last `nvme` of the blocks streamed at `resident`."""
    return sum(state_file_bytes(b.trainable_numel, model.compute_bytes, compact)
               for b in model.blocks[len(model.blocks) - nvme:]) if nvme else 0


def store_bytes(blocks: Sequence[tuple[int, int]], compute_bytes: int, accumulate: bool, lean: int = 0,
                gpu_accumulation: bool = False, spares: bool = True, on_drive: int = 0,
                drive_slots: int = 0, compact: bool = False, pooled: bool = False) -> HostParts:
    """Host bytes of the stores (store.py, cached.py) of these blocks, each given as (numel, trainable numel), in
    block order. The working copy holds every parameter (frozen ones only there); the rest is per trainable
    parameter. The first `lean` blocks have no gradient buffer (their gradients land in the working copy). With
    accumulation on the GPU the gradient buffer is fp32 (the window's sum lands there) and there is no host
    accumulator; with host accumulation `spares` gives each block a second gradient buffer (one micro-step's
    gradients wait while the next land); each block has its gradients' sum of squares (one fp32). The last `on_drive` blocks keep their fp32 state on the drive (nvme.py): in
    host memory only `drive_slots` staging buffers (at most one a block) of the largest one's file. With `compact`
    the others keep their masters' low halves, and COMPACT_STAGING_SLOTS fp32 buffers of the largest (compact.py); the
    drive's files hold the low halves too, beside one fp32 buffer of the largest drive block (nvme.py). With
    `pooled` (host accumulation without spares) the blocks share GRAD_POOL_BUFFERS landing buffers of the largest
    (grad_pool.py)."""
    master = 0 if compute_bytes == FP32_BYTES else COMPACT_MASTER_BYTES if compact else FP32_BYTES
    trainable = sum(t for _, t in blocks)
    drive = [t for _, t in blocks[len(blocks) - on_drive:]] if on_drive else []
    staging = (drive_staging_bytes(max(drive), compute_bytes, min(drive_slots, on_drive), compact)
               if on_drive else 0)
    in_memory = [t for _, t in blocks[:len(blocks) - on_drive]]
    if compact and in_memory:
        staging += COMPACT_STAGING_SLOTS * FP32_BYTES * max(in_memory)
    host_accumulate = accumulate and not gpu_accumulation
    grad_bytes = FP32_BYTES if gpu_accumulation else compute_bytes * (2 if host_accumulate and spares else 1)
    return HostParts(
        master_and_moments=(trainable - sum(drive)) * (master + MOMENTS_BYTES) + staging,
        working=sum(n for n, _ in blocks) * compute_bytes,
        grads=((GRAD_POOL_BUFFERS * max(t for _, t in blocks) if pooled and blocks else
                sum(t for _, t in blocks[lean:])) * grad_bytes + len(blocks) * FP32_BYTES),  # + `grad_sq`
        accumulators=trainable * FP32_BYTES if host_accumulate else 0)


def unit_store_bytes(parts: Sequence[tuple[str, int, int]], compute_bytes: int, accumulate: bool, spares: bool,
                     summed: frozenset[str] = frozenset(), rows: frozenset[str] = frozenset(),
                     window_rows_numel: Optional[int] = None) -> HostParts:
    """`store_bytes` of the cached parts (cached.py), each given as (name, numel, trainable numel): they accumulate on
    the host whatever the blocks do, with `spares`, but for those in `summed` (the blockwise backward's input part),
    whose one fp32 gradient buffer takes the window's sum (no accumulator, no spare). Of those, a table in `rows`
    keeps the window's rows in its place (`window_rows_numel` elements, where known: engine/embedding_rows.py) and one
    piece of dense gradient."""
    total = (store_bytes([(n, t) for name, n, t in parts if name not in summed], compute_bytes, accumulate,
                         spares=spares)
             + store_bytes([(n, t) for name, n, t in parts if name in summed], compute_bytes, accumulate,
                           gpu_accumulation=True))
    if window_rows_numel is not None:
        for name, _, t in parts:
            if name in summed and name in rows:
                total = dataclasses.replace(total, grads=total.grads - FP32_BYTES * max(0, t - window_rows_numel)
                                            + min(ROW_PIECE_BYTES, FP32_BYTES * t))
    return total


def host_bytes(model: ModelSpec, budgets: Budgets, resident: int, lean: int = 0,
               gpu_accumulation: bool = False, cached: frozenset[str] = frozenset(), spares: bool = True,
               nvme: int = 0, compact: bool = False, pooled: bool = False, blockwise: bool = False) -> HostBytes:
    """`store_bytes` of the blocks streamed at `resident` and of the cached parts outside the blocks (host
    accumulation, with spares unless the blocks accumulate on the host without them: cached.py), for the node: the
    working copy is one per node, the rest is split over the node's ranks (HostBytes.per_rank_private). `compact`:
    the streamed blocks' masters are compact (the cached parts' are not: their staging would outweigh the saving);
    `pooled`: the streamed blocks share pooled landing buffers (the cached parts keep their own); `blockwise`: the
    blockwise backward's layout (engine/runtime.py): the streamed blocks' as with `gpu_accumulation`, and the cached
    input part's one fp32 sum (`unit_store_bytes`)."""
    cb, accumulate = model.compute_bytes, model.accumulation_steps > 1
    fp32_grads = gpu_accumulation or blockwise
    streamed = [(b.numel, b.trainable_numel) for b in model.blocks[resident:]]
    cached_parts = plan_rest.split(model, cached)[1]
    parts = [(p.name, p.numel, p.trainable_numel) for p in cached_parts]
    total = (store_bytes(streamed, cb, accumulate, lean, fp32_grads, spares, nvme,
                         budgets.drive.slots if nvme else 0, compact, pooled)
             + unit_store_bytes(parts, cb, accumulate, spares or fp32_grads,
                                plan_rest.BLOCKWISE_SUMMED if blockwise else frozenset(),
                                frozenset(p.name for p in cached_parts if p.row_gradients), budgets.window_rows_numel))
    return HostBytes(**dataclasses.asdict(total), margin=budgets.host_margin_bytes, local_ranks=budgets.local_ranks)


def check_host_fits(needed: HostParts, available: int, freed: int, limit_gb: Optional[float] = None) -> None:
    """Refuse, before anything is allocated, stores that do not fit the host memory `available` with the planner's
    margin (`default_host_margin` of the same budget: what is available plus `freed`, the model's own storage that
    the stores replace). `limit_gb`: the "host_memory_limit_gb" that `available` reflects, named in the error."""
    if needed.total - freed + default_host_margin(available + freed) > available:
        raise MemoryError(
            f"stronghold needs {needed.total / GIB:.1f} GiB of host memory for the streamed blocks "
            f"(fp32 master + Adam moments {needed.master_and_moments / GIB:.1f}, working copies "
            f"{needed.working / GIB:.1f}, gradient buffers {needed.grads / GIB:.1f}, accumulation "
            f"{needed.accumulators / GIB:.1f}; {freed / GIB:.1f} of the model's own memory is reused), "
            f"but only {available / GIB:.1f} GiB is available"
            f"{f' under host_memory_limit_gb={limit_gb:g}' if limit_gb is not None else ''}. Raise "
            f"\"resident_blocks\" to keep more blocks on the GPU, use a smaller model, or free host memory"
            f"{' (or raise the limit)' if limit_gb is not None else ''}. Nothing was allocated.")


def block_gpu_bytes(model: ModelSpec) -> int:
    """GPU bytes of the largest block made resident (for the advice in the messages)."""
    largest = max(model.blocks, key=lambda b: b.numel)
    return resident_bytes(largest.numel, largest.trainable_numel, model.compute_bytes, model.accumulation_steps > 1)
