"""GPU and host bytes of a placement, by part (planner.py plans with them). The accounting mirrors the engine as
built: store.py (host buffers of a streamed block), gpu_optim.py (resident AdamW: fp32 masters, one chunk's fp32
gradient at a time), streams.py (W flat slots of the largest streamed block), device_accum.py (streamed gradients
accumulated on the GPU), cached.py (parts outside the blocks with their states on the host: plan_rest.py). Pure."""
from __future__ import annotations

from stronghold.planning import plan_rest
from stronghold.planning.plan_types import (ACTIVATION_PREFETCH_BLOCKS, FP32_BYTES, MOMENTS_BYTES, NVME_ALIGN,
                                            STREAMED_GRADS_IN_FLIGHT, Activations, Budgets, GpuBytes, HostBytes,
                                            ModelSpec)


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
    # ResidentOptimizer upcasts one chunk's bf16 gradients at a time (a chunk is one resident block or
    # the resident rest of the model); in fp32 mode the gradient already is fp32.
    chunk = max([b.trainable_numel for b in kept] + [rest_trainable])
    transients = 0 if cb == FP32_BYTES else chunk * FP32_BYTES
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


def nvme_state_bytes(model: ModelSpec, trainable_numel: int) -> int:
    """One NVMe block's state file (streaming/nvme.py): fp32 master (bf16/fp16 only) and moments, padded."""
    master = 0 if model.compute_bytes == FP32_BYTES else FP32_BYTES
    return -(-trainable_numel * (master + MOMENTS_BYTES) // NVME_ALIGN) * NVME_ALIGN


def drive_bytes(model: ModelSpec, resident: int, nvme: int) -> int:
    """Bytes on the drive for the last `nvme` of the blocks streamed at `resident`."""
    return sum(nvme_state_bytes(model, b.trainable_numel) for b in model.blocks[len(model.blocks) - nvme:]) if nvme \
        else 0


def host_bytes(model: ModelSpec, budgets: Budgets, resident: int, lean: int = 0,
                gpu_accumulation: bool = False, cached: frozenset[str] = frozenset(), spares: bool = True,
                nvme: int = 0) -> HostBytes:
    """store.plan_host_memory, by part, for the node: the working copy holds every streamed parameter (frozen
    ones only there) once per node; the rest is per trainable parameter, split over the node's ranks. The
    first `lean` streamed blocks have no gradient buffer (their gradients land in the working copy). With
    accumulation on the GPU the gradient buffer is fp32 (the window's sum lands there) and there is no host
    accumulator; with host accumulation `spares` gives each block a second gradient buffer. The cached parts
    outside the blocks add their stores (plan_rest.cached_host_bytes). The last `nvme` streamed blocks keep their
    fp32 state on the drive: in host memory only the staging buffers (Budgets.drive.slots, at most one a block)."""
    cb = model.compute_bytes
    parts = plan_rest.cached_host_bytes(plan_rest.split(model, cached)[1], cb, model.accumulation_steps > 1)
    streamed = model.blocks[resident:]
    numel = sum(b.numel for b in streamed)
    trainable = sum(b.trainable_numel for b in streamed)
    buffered = sum(b.trainable_numel for b in streamed[lean:])
    master = 0 if cb == FP32_BYTES else FP32_BYTES
    on_drive = [b.trainable_numel for b in model.blocks[len(model.blocks) - nvme:]] if nvme else []
    staging = min(budgets.drive.slots, nvme) * nvme_state_bytes(model, max(on_drive)) if nvme else 0
    return HostBytes(
        master_and_moments=(trainable - sum(on_drive)) * (master + MOMENTS_BYTES) + staging + parts.master_and_moments,
        working=numel * cb + parts.working,
        # With host accumulation and spares two gradient buffers a block: one micro-step's wait while the next
        # lands (store.py).
        grads=buffered * (FP32_BYTES if gpu_accumulation
                          else cb * (2 if model.accumulation_steps > 1 and spares else 1))
        + parts.grads,
        accumulators=(trainable * FP32_BYTES if model.accumulation_steps > 1 and not gpu_accumulation else 0)
        + parts.accumulators,
        margin=budgets.host_margin_bytes, local_ranks=budgets.local_ranks)


def block_gpu_bytes(model: ModelSpec) -> int:
    """GPU bytes of the largest block made resident (for the advice in the messages)."""
    largest = max(model.blocks, key=lambda b: b.numel)
    return resident_bytes(largest.numel, largest.trainable_numel, model.compute_bytes, model.accumulation_steps > 1)
