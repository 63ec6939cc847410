"""The cached tier (planner Tier.CACHED): a part of the model outside the blocks (the input embeddings; the final norm
and LM head) whose compute-dtype weights and gradients stay on the GPU while its fp32 master and AdamW moments live
on the host and the CPU AdamW updates them.

A cached part is one *unit*: a BlockStore (store.py) built as a streamed block's, which the runtime hands to the CPU
optimizer exactly as it hands a streamed block (cpu_optim.py: host accumulation, speculation and deferral for exact
global clipping, redo, rollback), and a flat buffer on the device that its parameters' `.data` are views of, always.
Units have negative indices (OUTPUT_INDEX, INPUT_INDEX), so step()'s forward-order passes over deferred updates
(cpu_optim.finish_step) update them before any block: the next forward reads them first.

Between steps the device buffer is the one copy the model computes with. A step's update moves the store's version
on (cpu_optim.submit_grads); before anything reads the weights again `ensure` waits for the unit's update (the
store's `updated`, set once its working copy holds the final weights) and copies the working copy in on the H2D
stream, the compute stream waiting for that copy only. Nothing tells in general where in a forward a parameter
outside the blocks is read (the fused linear + cross-entropy reads the head's weight in the root module's forward,
never calling the head), so every unit is made current before a forward begins: a forward pre-hook on the model and
on each module that owns a unit's parameter (a submodule called on its own). The copies of units whose update is
already done are issued at the end of step() (`prefetch`), the others when the forward needs them.

Tied weights (a head that is the input embedding's weight) are one parameter: one entry, one master, one update,
in the unit of the part that owns it first (discovery.split_rest).

With data parallel a unit's store is built sharded with the streamed blocks' (sharding.build_sharded_stores: its
working copy in the node-shared copy, this rank's shard of its states) and its gradients are reduce-scattered as a
block's (handoff.py); a load then also waits until every local rank has published its shard of the update
(`shared`: NodeSharedCopy.wait), and a prefetch skips a unit that is not published yet.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stronghold.streaming.pinned import HostMeter
from stronghold.streaming.store import BlockStore, ParamEntry, build_block_store
from stronghold.streaming.streams import Slot, Transfers

if TYPE_CHECKING:
    from stronghold.distributed.shared_host import NodeSharedCopy

OUTPUT_INDEX, INPUT_INDEX = -2, -1
"""Store indices of the output and input parts: below every block's, output first (cpu_optim sorts by index)."""
INDEX_OF = {"output": OUTPUT_INDEX, "input": INPUT_INDEX}


@dataclass
class Unit:
    """One cached part: its host store and its device copy."""

    name: str
    store: BlockStore
    device: Slot
    """The flat device buffer the parameters are views of; its events order the H2D after the compute that read the
    old weights (`free`) and the compute after the H2D (`ready`), as a window slot's."""
    loaded_version: int
    """The store version the device buffer holds, or is being copied (`in_flight`)."""
    in_flight: bool = False
    """A copy was issued (prefetch) and the compute stream has not waited for it yet."""


@dataclass
class CachedStats:
    loads: int = 0
    waits: int = 0
    """Units whose CPU update (with data parallel: any local rank's shard of it) a forward had to wait for."""
    wait_cpu_s: float = 0.0
    """Host time a forward waited for a unit's CPU update before its copy could start."""


class CachedUnits:
    def __init__(self, transfers: Transfers, wait: Callable):
        """`wait(event, what)`: the CPU optimizer's wait, which raises if the optimizer failed."""
        self.transfers, self.wait = transfers, wait
        self.shared: Optional[NodeSharedCopy] = None
        """With data parallel: the node-shared copy whose publications a load waits for (`adopt`)."""
        self.units: dict[int, Unit] = {}
        self.stats = CachedStats()
        self._handles: list[RemovableHandle] = []

    def reset_stats(self) -> None:
        self.stats = CachedStats()

    def build(self, layouts: dict[int, tuple[str, list[ParamEntry]]], compute_dtype: torch.dtype, pin: bool,
              accumulate: bool, host: HostMeter, spare: bool = True, summed: frozenset[int] = frozenset()) -> None:
        """Move each part's parameters into a host store (fp32 master from their values, with host accumulation when
        accumulating, and a spare gradient buffer if `spare`) and onto the device as views of one flat buffer. The
        units in `summed` get their window's gradient as one fp32 sum (the blockwise backward's input part,
        engine/blockwise.py): an fp32 gradient buffer, no accumulator, no spare. The
        stores are built at once, on a thread each: building is mostly the first touch of their host pages, which the
        kernel serves faster from several cores (store.build_block_stores); the device side follows in order."""
        with ThreadPoolExecutor(max_workers=max(1, len(layouts)), thread_name_prefix="stronghold-setup") as setup:
            futures = {index: setup.submit(build_block_store, index, entries, compute_dtype, pin,
                                           accumulate and index not in summed, host,
                                           spare=spare and index not in summed,
                                           grad_dtype=torch.float32 if index in summed else None)
                       for index, (_, entries) in layouts.items()}
            for index, (name, _) in layouts.items():
                self.adopt(name, futures[index].result(), compute_dtype)

    def adopt(self, name: str, store: BlockStore, compute_dtype: torch.dtype,
              shared: Optional[NodeSharedCopy] = None) -> None:
        """Make a built store (a sharded one with data parallel, whose working copy is in `shared`) a unit: its
        parameters become views of a device buffer filled from the working copy."""
        if shared is not None:
            self.shared = shared
        device = Slot(store.index, torch.empty(store.numel, dtype=compute_dtype, device=self.transfers.device),
                      self.transfers.event(), self.transfers.event())
        device.buffer.copy_(store.working)  # at construction: a plain (synchronous) copy
        self.units[store.index] = Unit(name, store, device, loaded_version=store.life.version)
        store.point_params_to(store.param_views(device.buffer))

    @property
    def stores(self) -> dict[int, BlockStore]:
        return {index: unit.store for index, unit in self.units.items()}

    def _load(self, unit: Unit) -> None:
        self.transfers.load(unit.device, unit.store.working)
        unit.loaded_version, unit.in_flight = unit.store.life.version, True
        self.stats.loads += 1

    def ensure(self, only_updated: bool = False) -> None:
        """Make every unit's device copy its current weights, the compute stream ordered after the copies. With
        `only_updated`, units whose update has not finished keep their copy (a synchronize between a backward and
        its step)."""
        for unit in self.units.values():
            store = unit.store
            if unit.loaded_version != store.life.version:
                own = store.life.updated.is_set()
                if not own and only_updated:
                    continue
                if not own or (self.shared is not None and not self.shared.ready(store.index)):
                    start = time.perf_counter()
                    self.stats.waits += 1
                    self.wait(store.life.updated, f"the CPU update of the {unit.name} part before a forward")
                    if self.shared is not None:
                        self.shared.wait(store.index)  # the other local ranks' shards of the update
                    self.stats.wait_cpu_s += time.perf_counter() - start
                self._load(unit)
            if unit.in_flight:
                self.transfers.wait_ready(unit.device)
                unit.in_flight = False

    def prefetch(self) -> None:
        """Issue the copies of the units whose update is done (at the end of step()): the next forward only waits."""
        for unit in self.units.values():
            if unit.loaded_version != unit.store.life.version and unit.store.life.updated.is_set() and (
                    self.shared is None or self.shared.ready(unit.store.index)):
                self._load(unit)

    def attach(self, model: nn.Module, before_forward: Callable[[], None]) -> None:
        """`before_forward` (which ensures the units) as a forward pre-hook of the model and of every module that owns
        one of the units' parameters."""
        assert not self._handles, "cached units' hooks are already attached"
        ids = {id(e.param) for unit in self.units.values() for e in unit.store.entries}
        owners = [model] + [m for m in model.modules() if m is not model
                            and any(id(p) in ids for p in m.parameters(recurse=False))]
        for module in owners:
            self._handles.append(module.register_forward_pre_hook(lambda module, args: before_forward()))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
