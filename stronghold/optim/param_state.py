"""Every parameter's optimizer state as the running engine holds it, in one enumeration.

Checkpoints (checkpoint.py) and the optimizer facade's state_dict (optimizer.py) both read and write
per-parameter AdamW state; where it lives depends on placement: a streamed block's parameters are
views of its flat host buffers (store.py), resident ones are tensors of a chunk's torch AdamW
(gpu_optim.py), and frozen resident ones are the model's own tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn


@dataclass
class ParamState:
    """One parameter as the running engine holds it (views of its buffers, not copies)."""

    name: str
    value: torch.Tensor
    """The fp32 master of a trainable parameter; the parameter's own value when frozen."""
    trainable: bool
    exp_avg: Optional[torch.Tensor] = None
    """None for frozen parameters and for resident ones that have not taken a step yet."""
    exp_avg_sq: Optional[torch.Tensor] = None
    step: int = 0


def names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def units(runtime, shapes_only: bool = False, gather: Optional[Callable] = None) -> Iterator[list[ParamState]]:
    """Every parameter, grouped as stored: per cached unit and streamed block, per resident chunk, then the rest.
    A sharded streamed block (data parallel) needs its full state: `gather(store)` brings it (see
    sharding.save_on_rank0) just before its unit is yielded, and it is dropped when the next is asked
    for, so one block's is held at a time (the caller must drop its references to a unit before asking
    for the next); with `shapes_only` the working copy stands in for names and shapes instead."""
    named = names(runtime.model)
    for store in runtime.host_stores():
        unit = []
        if shapes_only and (store.sharded or store.tier is not None) and store.life.gathered is None:
            for entry in store.entries:
                unit.append(ParamState(named[id(entry.param)], entry.host_view(store.working), entry.group is not None))
            yield unit
            continue
        # An NVMe store's state is read into private copies the same way (nvme.py), whoever asks.
        gathering = store.life.gathered is None and (
            (store.sharded and gather is not None) or (not store.sharded and store.tier is not None))
        if gathering:  # a sharded block from the ranks (its compact master merged there), else from its tier
            store.life.gather(gather(store) if store.sharded else store.tier.gather(store))
        try:
            # No local of this frame may hold a gathered tensor past the yield (only `unit`, dropped below).
            unit = [_streamed_state(store, entry, named[id(entry.param)]) for entry in store.entries]
            yield unit
        finally:
            if gathering:
                store.life.release_gathered()
    for chunk in runtime.resident.chunks:
        unit = []
        for param, master in zip(chunk.params, chunk.masters):
            state = chunk.optimizer.state.get(master, {})
            unit.append(ParamState(named[id(param)], master, True, state.get("exp_avg"), state.get("exp_avg_sq"),
                                   int(state["step"]) if "step" in state else 0))
        yield unit
    yield rest(runtime)


def _streamed_state(store, entry, name: str) -> ParamState:
    if entry.group is None:
        return ParamState(name, entry.host_view(store.working), False)
    master, exp_avg, exp_avg_sq = store.full_entry(entry)
    return ParamState(name, master, True, exp_avg, exp_avg_sq, entry.step)


def covered(runtime) -> set[int]:
    """id() of every parameter that is streamed, cached or updated on the GPU."""
    return {id(e.param) for store in runtime.host_stores() for e in store.entries} | {
        id(p) for chunk in runtime.resident.chunks for p in chunk.params}


def rest(runtime) -> list[ParamState]:
    """Parameters neither streamed nor updated on the GPU: frozen ones that stay resident."""
    done = covered(runtime)
    return [ParamState(name, p.data, False) for name, p in runtime.model.named_parameters() if id(p) not in done]


Moments = Optional[tuple[int, torch.Tensor, torch.Tensor]]
"""(step, exp_avg, exp_avg_sq) of one parameter, or None for "has not stepped" (no AdamW state)."""


@torch.no_grad()
def write_moments(runtime, moments: dict[str, Moments], owned: bool = False) -> None:
    """Set the AdamW state of the trainable parameters named in `moments` (fp32 values are copied, never
    aliased, unless `owned`: the caller gives them up, and a resident parameter's fp32 values on its device are
    kept as they are). The runtime must be quiescent (`runtime.synchronize()`)."""
    named = names(runtime.model)
    for store in runtime.host_stores():
        if store.sharded and any(named[id(e.param)] in moments for e in store.trainable):
            raise ValueError("stronghold: the optimizer state of a data-parallel engine is sharded over the ranks; "
                             "use engine.save_checkpoint / load_checkpoint, which re-shard it")
        if not any(named[id(e.param)] in moments for e in store.trainable):
            continue
        with store.states() as (_, all_exp_avg, all_exp_avg_sq):
            for entry in store.trainable:
                name = named[id(entry.param)]
                if name not in moments:
                    continue
                exp_avg, exp_avg_sq = entry.host_view(all_exp_avg), entry.host_view(all_exp_avg_sq)
                value = moments[name]
                if value is None:
                    entry.step = 0
                    exp_avg.zero_()
                    exp_avg_sq.zero_()
                else:
                    entry.step = int(value[0])
                    exp_avg.copy_(value[1].reshape(exp_avg.shape))
                    exp_avg_sq.copy_(value[2].reshape(exp_avg_sq.shape))
    for chunk in runtime.resident.chunks:
        optimizer = chunk.optimizer
        order = [p for group in optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        full, touched = optimizer.state_dict(), False
        for param, master in zip(chunk.params, chunk.masters):
            name = named[id(param)]
            if name not in moments:
                continue
            i, value, touched = index[id(master)], moments[name], True
            full["state"].pop(i, None)
            if value is not None and int(value[0]) > 0:  # a parameter that never stepped has no state, as in torch
                full["state"][i] = {
                    "step": torch.tensor(float(value[0])),
                    # Copies unless owned: torch's load_state_dict keeps a tensor that already has the right dtype
                    # and device.
                    "exp_avg": value[1].detach().to(master.device, torch.float32, copy=not owned).reshape(master.shape),
                    "exp_avg_sq": value[2].detach().to(master.device, torch.float32,
                                                       copy=not owned).reshape(master.shape)}
        if touched:
            optimizer.load_state_dict(full)  # places each state tensor as torch's AdamW wants it


def master_params(runtime) -> dict[int, torch.Tensor]:
    """id(param) -> the fp32 value the optimizer updates (host for streamed, device for resident).
    Call `runtime.synchronize()` first so every streamed block's latest update has landed. A sharded block
    (data parallel) holds only its shard of the fp32 master: its working copy stands in (the master
    itself in fp32; the bf16 weights otherwise, which is what a model's state_dict holds anyway)."""
    masters = {id(p): m for chunk in runtime.resident.chunks for p, m in zip(chunk.params, chunk.masters)}
    for store in runtime.host_stores():
        # An NVMe store's masters are copies read from the drive (nvme.py) unless the working copy is the master.
        read = store.tier.gather(store) if store.master is None and not store.sharded else None
        for entry in store.entries:
            source = store.master if entry.group is not None and not store.sharded else store.working
            masters[id(entry.param)] = (read[entry.offset][0] if read is not None and entry.group is not None
                                        else entry.host_view(source))
    for param in runtime.model.parameters():  # frozen resident parameters are their own value
        masters.setdefault(id(param), param.data)
    return masters
