"""Promotion: streamed blocks become resident between optimizer steps (placement.py asks the runtime at the first
forward and after the first step, once the measured peak shows room), states and all. The runtime's `promote` owns
the sequence and its own fields (window, slots, counts); the pieces here read it and move one block's parameters and
states."""
from __future__ import annotations

import time
from typing import Optional

import torch

from stronghold.optim import param_state
from stronghold.distributed.sharding import gather_block
from stronghold.streaming.promotion_fill import BlockFill
from stronghold.streaming.staging import Stager
from stronghold.streaming.store import BlockStore


class PartClock:
    """Host seconds of a promotion's parts, each from the end of the one before."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = now - self._last
        self._last = now


def check_promotion(runtime, resident_blocks: int) -> range:
    """The streamed blocks that become resident (by index), or the error that names why none can now."""
    if runtime.mid_step:
        raise RuntimeError("stronghold: blocks can only change placement between optimizer steps")
    if resident_blocks < runtime.resident_count:
        raise ValueError(f"resident_blocks can only grow after construction ({runtime.resident_count} -> "
                         f"{resident_blocks}); set it in the config to start with fewer")
    return range(runtime.resident_count, min(resident_blocks, len(runtime.blocks)))


def fills_later(store: BlockStore) -> bool:
    """Whether a block's copies can be left to a PromotionFill's thread (streaming/promotion_fill.py): its states are
    host views that stay as they are until the copies are done (not a sharded block's gather, a drive's copies or a
    compact master's halves)."""
    return not store.sharded and store.tier is None and not store.compact


@torch.no_grad()
def move_to_device(runtime, store: BlockStore, named: dict[int, str], stager: Stager,
                   fill: Optional[BlockFill] = None) -> None:
    """One promoted block's parameters onto the device with its fp32 master, moments and step counter as they are, so
    training goes on exactly as if the block had been resident from the start (the runtime has taken the store out
    of its streamed blocks first). `named`: param_state.names of the model; `stager` copies the pageable states.
    With `fill` (a store that `fills_later`) every device tensor is made here, empty, and its copy listed in `fill`
    for the fill's thread; nothing reads them before that thread is waited for."""
    def to_device(source: torch.Tensor) -> torch.Tensor:
        if fill is None:
            return stager.to_device(source)
        out = torch.empty(source.shape, dtype=source.dtype, device=runtime.device)
        fill.copies.append((source, out))
        return out

    if store.sharded:  # every rank promotes the same blocks (initial_plan.agree), in order
        # Before any step (the promotion at the first forward) the moments are zeros that nothing reads.
        stepped = any(entry.step for entry in store.trainable)
        store.life.gather(gather_block(runtime.data_parallel, store, runtime.host_bytes, everywhere=True,
                                       moments=stepped, on_device=True))
    elif store.tier is not None:  # its state back in host memory and its file gone (nvme.py)
        store.tier.to_host(store, runtime.host_bytes)
    chunk, masters, moments = [], {}, {}
    fresh = store.sharded  # the gathered states are the gather's own buffers on the device: kept, not copied
    for entry in store.entries:
        param = entry.param
        if entry.group is None:
            working = entry.host_view(store.working)
            param.data = working.to(runtime.device, copy=True) if fill is None else to_device(working)
            continue
        master, exp_avg, exp_avg_sq = store.full_entry(entry)
        # The gathered states (fresh) are on the device already; the host's go through the stager, and then are
        # this block's own, which the optimizer state takes as they are (`owned`).
        on_device = master if fresh else to_device(master)
        if runtime.compute_dtype == torch.float32:  # the parameter is its own master (gpu_optim.py)
            param.data = on_device
        else:
            masters[id(param)] = on_device.float()
            if fill is None:
                param.data = masters[id(param)].to(runtime.compute_dtype)
            else:
                param.data = torch.empty(master.shape, dtype=runtime.compute_dtype, device=runtime.device)
                fill.casts.append((masters[id(param)], param.data))
        chunk.append((param, entry.group))
        if entry.step and not fresh:
            exp_avg, exp_avg_sq = to_device(exp_avg), to_device(exp_avg_sq)
        moments[named[id(param)]] = None if entry.step == 0 else (entry.step, exp_avg, exp_avg_sq)
    runtime.resident.add_chunk(chunk, masters)
    # Block by block: a sharded or NVMe block's moments are gathered copies (on the device, or in host memory from
    # the drive), which the optimizer state copies; holding every promoted block's until the end held all of them.
    param_state.write_moments(runtime, moments, owned=not fresh)
    store.life.release_gathered()


def release_host_cache() -> None:
    """The promoted blocks' small pinned buffers (torch's allocator: pinned.py) go back to torch's host cache, which
    keeps them until told otherwise: give them back to the system (public API since torch 2.9 or so; older versions
    keep the memory cached, which costs host RAM, not correctness). Run by the releaser once they are dropped."""
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "memory", None)
    if hasattr(empty_host_cache, "empty_host_cache"):
        empty_host_cache.empty_host_cache()


def release_device_cache(device: torch.device) -> None:
    """The old window's slots went back to the device allocator's cache, in segments of a size the new layout may
    never ask for: give those back."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def settle(runtime, indices: range) -> None:
    """Before the streamed blocks `indices` leave the host: their last updates done and the window's slots given
    back; the CPU's other queued updates run on. Each block's update job is its last, and the jobs run in order, so
    its `updated` and `grad_free` mean its state is final, unless the last step went weights first (then `updated`
    comes before the fp32 state) or several nodes still exchange shards on the CPU's thread (nodes.py: collectives
    that the promotion's own gather must not interleave with): there, `runtime.synchronize`. Data parallel on one
    node waits for the same two events on every rank: each rank enters the promotion's gather of a block after its
    own update of it, and the queued publications hold no promoted block's buffers (data_parallel.publish). Waiting
    for every update instead wrote the first moments of every streamed block while the promoted ones' states were
    still held: the node's host peak of the first steps."""
    cpu, data_parallel = runtime.cpu, runtime.data_parallel
    if cpu is None or cpu.split_last_step or (data_parallel is not None and data_parallel.nodes is not None):
        runtime.synchronize()
        return
    for index in indices:
        store = runtime.stores[index]
        cpu.wait(store.life.updated, f"the CPU update of block {index} before it becomes resident")
        cpu.wait(store.life.grad_free, f"the CPU optimizer to release block {index}'s gradient buffer")
    if runtime.window is not None:
        runtime.window.evict_all()
    runtime.cached.ensure(only_updated=True)
