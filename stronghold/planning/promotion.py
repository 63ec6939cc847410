"""Promotion: streamed blocks become resident between optimizer steps (placement.py calls it after the
first step, once the measured peak shows room), states and all."""
from __future__ import annotations

import torch

from stronghold.optim import param_state
from stronghold.distributed.sharding import gather_block


@torch.no_grad()
def promote(runtime, resident_blocks: int, window_size: int) -> None:
    """Make the leading streamed blocks up to `resident_blocks` resident and give the rest
    `window_size` slots, between steps (placement.py calls this after the first step). Each
    promoted block's fp32 master, moments and step counter move to the device as they are, so
    training goes on exactly as if the block had been resident from the start."""
    if runtime.mid_step:
        raise RuntimeError("stronghold: blocks can only change placement between optimizer steps")
    if resident_blocks < runtime.resident_count:
        raise ValueError(f"resident_blocks can only grow after construction ({runtime.resident_count} -> "
                         f"{resident_blocks}); set it in the config to start with fewer")
    _settle(runtime, range(runtime.resident_count, min(resident_blocks, len(runtime.blocks))))
    runtime.hooks.detach()
    runtime.window = None
    runtime.transfers.slots = []  # frees the old slots before the promoted blocks need the memory
    named = param_state.names(runtime.model)
    for index in range(runtime.resident_count, min(resident_blocks, len(runtime.blocks))):
        store = runtime.stores.pop(index)
        del runtime.micro[index], runtime.landed[index]
        if runtime.device_accum is not None:
            runtime.device_accum.pop(index)
        if store.sharded:  # every rank promotes the same blocks (initial_plan.agree), in order
            store.gathered = gather_block(runtime.data_parallel, store, runtime.host_bytes, everywhere=True)
        elif store.tier is not None:  # its state back in host memory and its file gone (nvme.py)
            store.tier.to_host(store, runtime.host_bytes)
        chunk, masters, moments = [], {}, {}
        for entry in store.entries:
            param = entry.param
            if entry.group is None:
                param.data = entry.host_view(store.working).to(runtime.device, copy=True)
                continue
            master, exp_avg, exp_avg_sq = store.full_entry(entry)
            if runtime.compute_dtype == torch.float32:  # the parameter is its own master (gpu_optim.py)
                param.data = master.to(runtime.device, copy=True)
            else:
                masters[id(param)] = master.to(runtime.device, torch.float32, copy=True)
                param.data = masters[id(param)].to(runtime.compute_dtype)
            chunk.append((param, entry.group))
            moments[named[id(param)]] = None if entry.step == 0 else (entry.step, exp_avg, exp_avg_sq)
        runtime.resident.add_chunk(chunk, masters)
        # Block by block: a sharded or NVMe block's moments are gathered copies, and holding every promoted block's
        # until the end took 8 host bytes a promoted parameter on every rank at once: with several ranks, the node's
        # host peak.
        param_state.write_moments(runtime, moments)
        moments.clear()
        store.gathered = None
    store = None  # the last promoted block's buffers are free only once nothing refers to them
    # The promoted blocks' pinned buffers go back to torch's host cache, which keeps them until
    # told otherwise: give them back to the system (public API since torch 2.9 or so; older
    # versions keep the memory cached, which costs host RAM, not correctness).
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "memory", None)
    if runtime.device.type == "cuda" and hasattr(empty_host_cache, "empty_host_cache"):
        empty_host_cache.empty_host_cache()
    runtime.resident_count = len(runtime.blocks) - len(runtime.stores)
    runtime.window_size = min(window_size, len(runtime.stores))
    if runtime.stores:
        runtime._build_window()
    elif runtime.cpu is not None and not runtime.cached.units:  # the cached units keep the CPU optimizer
        runtime.cpu.close()
        runtime.cpu = None
        runtime.device_accum = None


def _settle(runtime, indices: range) -> None:
    """Before the streamed blocks `indices` leave the host: their last updates done and the window's slots given
    back; the CPU's other queued updates run on. Each block's update job is its last, and the jobs run in order, so
    its `updated` and `grad_free` mean its state is final, unless the last step went weights first (then `updated`
    comes before the fp32 state) or a data-parallel rank's shards are still being exchanged: there, as in any other
    case, `runtime.synchronize`."""
    cpu = runtime.cpu
    if cpu is None or runtime.data_parallel is not None or cpu.split_last_step:
        runtime.synchronize()
        return
    for index in indices:
        store = runtime.stores[index]
        cpu.wait(store.updated, f"the CPU update of block {index} before it becomes resident")
        cpu.wait(store.grad_free, f"the CPU optimizer to release block {index}'s gradient buffer")
    if runtime.window is not None:
        runtime.window.evict_all()
    runtime.cached.ensure(only_updated=True)
