"""Host-side state of each streamed block: flat buffers and the parameter layout in them. Where the block is and
who may touch it now (its lifecycle) is `BlockStore.life` (lifecycle.py).

Per streamed block (numel N, trainable T <= N):
- `working`: compute dtype, N elements, pinned. The H2D source. Trainable parameters come first,
  grouped by optimizer param group, so each group is one contiguous range for the CPU AdamW;
  frozen parameters follow. In fp32 mode this *is* the fp32 master (no second copy).
- `master`, `exp_avg`, `exp_avg_sq`: fp32, T elements, pageable (only DMA buffers need pinning). In the NVMe tier
  (nvme.py) they live in a file instead and are None here (the master only in bf16/fp16); with a compact master
  (compact.py) `master` is None and `master_lo` holds its low halves: every reader and writer goes through
  `states()`, which gives the in-memory tensors, or a staging buffer holding the block's current state.
- `grad`: compute dtype, T elements, pinned. The D2H destination of the block's gradients (with `pool`, a shared
  buffer's, from the D2H to the CPU's sum only: grad_pool.py; None between). In a *lean*
  store (planner Tier.LEAN, bf16/fp16 without accumulation, one rank) it is `working[:T]`: the block's
  weights are not read again between its backward and its update, which rewrites them from the master,
  so the gradients can occupy them (2 host bytes less per parameter). Its update always waits for
  step() (cpu_optim.py: an early update could not be undone without the gradient), and a step that is
  skipped or aborted restores the weights from the master (`restore_working`), exactly: the working copy
  is always the master rounded to nearest, as the kernel and torch both round.
- `accum`: fp32, T elements, only with gradient accumulation on the host: the sum over micro-steps. With
  accumulation on the GPU (device_accum.py) there is none and `grad` is fp32: the window's sum lands there.
While a block is not on the GPU, its parameters' `.data` are views of `working`, so the model
stays inspectable (shapes, state_dict) and a forgotten load fails loudly (device mismatch).

With data parallel the store is built sharded (sharding.py): `working` is the block's part of the
node-shared copy (shared_host.py) and master / exp_avg / exp_avg_sq / grad / accum hold only this rank's
shard [shard_start, shard_stop) of the T trainable elements. Offsets of entries, segments and ranges stay
block coordinates; `local_ranges` (and cpu_records.local_segments) translate them into the shard's.

Every host buffer made for the stores is allocated through (or registered with) the runtime's `HostMeter`,
which counts the bytes held and their high-water mark (planning/plan_bytes.store_bytes is what they are planned
and checked as, before any is made): how the tests check that set-up and saves never
hold more than one block's full state beyond the steady state.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from stronghold.streaming.compact import CompactMasters
from stronghold.streaming.grad_pool import GradPool
from stronghold.streaming.lifecycle import BlockLife
from stronghold.streaming.pinned import HostMeter

GIB = 2 ** 30
SETUP_THREADS = 8
"""Blocks whose host buffers are built at once (build_block_stores)."""


@dataclass
class ParamEntry:
    """One parameter of a streamed block, and where it lives in the block's flat buffers."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    group: Optional[int]
    """Optimizer param group index; None for a frozen (not optimized) parameter."""
    step: int = 0
    """AdamW steps this parameter has taken (bias correction), kept per parameter as torch does."""
    grad_this_micro: bool = False
    grad_this_window: bool = False
    window_before: bool = False
    """`grad_this_window` when the current micro-step's backward began (restored if it fails)."""

    def host_view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset:self.offset + self.numel].view(self.shape)


@dataclass
class BlockStore:
    """Buffers and state of one streamed block (see the module docstring)."""

    index: int
    entries: list[ParamEntry]
    numel: int
    trainable_numel: int
    working: torch.Tensor
    master: Optional[torch.Tensor]
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    """None where the NVMe tier keeps them (`tier`); read and written through `states()`."""
    grad: Optional[torch.Tensor]
    accum: Optional[torch.Tensor]
    grad_sq: torch.Tensor
    """fp32, 1 element, pinned: the sum of squares of the gradients in `grad`, computed on the device as
    they are produced and copied down with them (the CPU optimizer decides early vs deferred on it)."""
    lean: bool = False
    """`grad` is `working[:trainable_numel]` (see the module docstring)."""
    grad_spare: Optional[torch.Tensor] = None
    """With host accumulation: a second gradient buffer, so that a micro-step's gradients can wait in one while the
    next micro-step's land in the other, and the CPU adds both in one pass (cpu_optim.py, `held`)."""
    pool: Optional[object] = None
    """The grad_pool.GradPool whose buffers `grad` borrows, or None (the store's own buffer)."""
    row_grads: Optional[object] = None
    """An input table's gradient as the window's rows (engine/embedding_rows.py), where `grad` is None: the CPU
    optimizer reads it through optim/grad_pieces.py."""
    master_lo: Optional[torch.Tensor] = None
    """int16, the trainable elements (this rank's shard): a compact master's low halves (compact.py), or None."""
    life: BlockLife = field(default_factory=BlockLife)
    """Where the block's weights, gradients and states are, and who may touch them now: its weights' version and
    `updated`, its gradient buffer's `grad_free` and `held`, its slot and residency, its `gathered` states
    (lifecycle.py, their only writer)."""

    trainable: list[ParamEntry] = field(default_factory=list)
    """The entries the optimizer updates (a prefix of `entries`)."""
    shard_start: int = 0
    shard_stop: int = -1
    """This rank's [start, stop) of the trainable elements (all of them unless sharded; -1: T)."""
    tier: Optional[object] = None
    """What `states()` goes through: the nvme.NvmeStates that keeps this block's fp32 state on a drive, the
    compact.CompactMasters that merges its master, or None (the fp32 tensors in host memory)."""
    _views_cache: Optional[list[torch.Tensor]] = field(default=None, repr=False)
    _grad_cache: Optional[dict[int, dict[int, torch.Tensor]]] = field(default=None, repr=False)
    """Per gradient buffer (by data pointer): its entries' views, so that `grad` and `grad_spare` trading places every
    other micro-step (cpu_optim.py) costs no new views."""

    def __setattr__(self, name, value):
        # The cached views hold their buffer's memory: replacing a buffer (device_accum.py swaps `grad`) drops them;
        # `grad` taking the spare's place keeps them.
        if name == "working" or (name == "grad" and not (value is not None and value is self.__dict__.get("grad_spare"))):
            object.__setattr__(self, "_views_cache" if name == "working" else "_grad_cache", None)
        object.__setattr__(self, name, value)

    def __post_init__(self):
        self.trainable = [e for e in self.entries if e.group is not None]
        if self.shard_stop < 0:
            self.shard_stop = self.trainable_numel

    @property
    def sharded(self) -> bool:
        return (self.shard_start, self.shard_stop) != (0, self.trainable_numel)

    def local_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Block ranges clipped to this rank's shard, in shard coordinates (empty pieces dropped)."""
        lo, hi = self.shard_start, self.shard_stop
        return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if min(b, hi) > max(a, lo)]

    def private_bytes(self) -> int:
        """Host bytes this rank holds for the block besides the working copy (states, gradient buffers)."""
        buffers = [self.exp_avg, self.exp_avg_sq] + ([] if self.lean or self.pool is not None else [self.grad])
        buffers += [b for b in (self.accum, self.master_lo) if b is not None]
        if self.master is not None and self.master.data_ptr() != self.working[self.shard_start:].data_ptr():
            buffers.append(self.master)
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    @contextlib.contextmanager
    def states(self, write: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(master, exp_avg, exp_avg_sq) for the duration: the host tensors, or in the NVMe tier a staging buffer's
        views, written back to the drive afterwards if `write` (nvme.py). Holds never nest."""
        if self.tier is None:
            yield self.master, self.exp_avg, self.exp_avg_sq
        else:
            with self.tier.hold(self, write) as views:
                yield views

    @property
    def compact(self) -> bool:
        """The master is kept as the working copy's high half and a low half (compact.py; on a drive: nvme.py)."""
        return self.master_lo is not None or getattr(self.tier, "compact", None) is not None

    @contextlib.contextmanager
    def halves(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A compact master's (low half, exp_avg, exp_avg_sq) for an update in place with the working copy as the high
        half: the host tensors, or a staging buffer's views on a drive, written back after."""
        if self.master_lo is not None:
            yield self.master_lo, self.exp_avg, self.exp_avg_sq
        else:
            with self.tier.hold_halves(self) as views:
                yield views

    def full_entry(self, entry: ParamEntry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A trainable entry's whole master, exp_avg, exp_avg_sq (a sharded or NVMe store must be gathered)."""
        if not self.sharded and self.tier is None:
            return entry.host_view(self.master), entry.host_view(self.exp_avg), entry.host_view(self.exp_avg_sq)
        assert self.life.gathered is not None, "a sharded or NVMe store's full state must be gathered first"
        return self.life.gathered[entry.offset]

    def restore_working(self) -> None:
        """A lean store's weights back from the master (over gradients that will not be applied)."""
        if self.lean:
            with self.states(write=False) as (master, _, _):
                self.working[:self.trainable_numel].copy_(master)

    def param_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's view of `buffer`, in `entries` order (streams.Slot keeps those of its buffer)."""
        return [entry.host_view(buffer) for entry in self.entries]

    def point_params_at(self, buffer: torch.Tensor) -> None:
        """Make every parameter's .data a view of `buffer` (a GPU slot or the host working copy; the working copy's
        views are made once)."""
        self.point_params_to(self._working_views() if buffer is self.working else self.param_views(buffer))

    def point_params_to(self, views: list[torch.Tensor]) -> None:
        """Make every parameter's .data its view in `views` (`param_views` order), made before: the window
        re-points each streamed block twice a micro-step, and slicing the views anew cost 59-89 us a Llama block
        against 2-4 us to assign made ones (H200), on the thread that launches the GPU work."""
        for entry, view in zip(self.entries, views):
            entry.param.data = view

    def _working_views(self) -> list[torch.Tensor]:
        if self._views_cache is None:
            self._views_cache = self.param_views(self.working)
        return self._views_cache

    def grad_destinations(self) -> dict[int, torch.Tensor]:
        """Each trainable entry's view of `grad` (by offset; the D2H destination of its gradient), made once."""
        assert not self.sharded, "a sharded store's gradient buffer holds its shard, not whole entries"
        if self._grad_cache is None:
            self._grad_cache = {}
        views = self._grad_cache.get(self.grad.data_ptr())
        if views is None:
            views = self._grad_cache[self.grad.data_ptr()] = {e.offset: e.host_view(self.grad) for e in self.trainable}
        return views


def cpu_param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters on the CPU (tied ones once): what stronghold's buffers replace, as the
    streamed blocks move into them and the rest moves to the device."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in unique if p.device.type == "cpu")


def order_entries(named: list[tuple[str, nn.Parameter]], group_of: dict[int, int]) -> list[ParamEntry]:
    """Lay out a block: trainable parameters by group (one contiguous range per group), then frozen."""
    trainable = [(group_of[id(p)], i, n, p) for i, (n, p) in enumerate(named) if id(p) in group_of]
    frozen = [(n, p) for n, p in named if id(p) not in group_of]
    entries, offset = [], 0
    for group, _, name, param in sorted(trainable, key=lambda t: (t[0], t[1])):
        entries.append(ParamEntry(name, param, offset, param.numel(), param.shape, group))
        offset += param.numel()
    for name, param in frozen:
        entries.append(ParamEntry(name, param, offset, param.numel(), param.shape, None))
        offset += param.numel()
    return entries


def counts(entries: list[ParamEntry]) -> tuple[int, int]:
    """(numel, trainable numel) of a block laid out as `entries`: what plan_bytes.store_bytes counts its store by."""
    return sum(e.numel for e in entries), sum(e.numel for e in entries if e.group is not None)


def build_block_store(index: int, entries: list[ParamEntry], compute_dtype: torch.dtype, pin: bool,
                      accumulate: bool, host: Optional[HostMeter] = None, lean: bool = False,
                      grad_dtype: Optional[torch.dtype] = None, spare: bool = True,
                      compact: Optional[CompactMasters] = None, pool: Optional[GradPool] = None) -> BlockStore:
    """Move one block's parameters into fresh host buffers (fp32 master from the original values).
    `grad_dtype`: of the gradient buffer, the compute dtype unless given (fp32 for the window sums that
    gradient accumulation on the GPU sends down, device_accum.py). `compact`: keep the master compact (compact.py);
    `pool`: borrow the landing buffer from it (host accumulation without spares: grad_pool.py)."""
    if lean and (compute_dtype == torch.float32 or accumulate):
        raise ValueError("a lean store needs a bf16/fp16 working copy and no gradient accumulation")
    if compact is not None and (lean or compute_dtype != torch.bfloat16):
        raise ValueError("a compact master needs a bf16 working copy that is not lean")
    if pool is not None and (not accumulate or spare or lean):
        raise ValueError("pooled gradient buffers need host accumulation without spares, and no lean store")
    host = host or HostMeter()
    numel = sum(e.numel for e in entries)
    trainable_numel = sum(e.numel for e in entries if e.group is not None)
    working = host.empty(numel, compute_dtype, pin)
    low = host.empty(trainable_numel, torch.int16) if compact is not None else None
    if compute_dtype == torch.float32:
        master = working[:trainable_numel]
    else:
        master = None if compact is not None else host.empty(trainable_numel, torch.float32)
    for entry in entries:
        source = entry.param.data.detach().reshape(-1)
        if source.device.type != "cpu":
            source = source.cpu()
        if entry.group is not None and low is not None:
            # A bf16 value is its own rounding, with a zero low half; a wider one is split.
            high = entry.host_view(working).view(-1)
            if source.dtype == torch.bfloat16:
                high.copy_(source)
                entry.host_view(low).view(-1).zero_()
            else:
                compact.fill(source.float().contiguous(), high, entry.host_view(low).view(-1))
            continue
        if entry.group is not None and master.data_ptr() != working.data_ptr():
            master[entry.offset:entry.offset + entry.numel].copy_(source)
        working[entry.offset:entry.offset + entry.numel].copy_(source)
    store = BlockStore(
        index=index, entries=entries, numel=numel, trainable_numel=trainable_numel, working=working,
        master=master, exp_avg=host.zeros(trainable_numel), exp_avg_sq=host.zeros(trainable_numel),
        grad=working[:trainable_numel] if lean else None if pool is not None else host.empty(
            trainable_numel, grad_dtype or compute_dtype, pin),
        # Pinned like `grad`: with accumulation moved to the GPU after the first step (device_accum.py) it
        # becomes the D2H destination of the window sums. Not zeroed: a window's first accumulation writes
        # every element (cpu_optim._accumulate), and zeroing it cost 0.7 s a Llama block on a VM.
        accum=host.empty(trainable_numel, torch.float32, pin) if accumulate else None,
        grad_sq=host.empty(1, torch.float32, pin), lean=lean, pool=pool,
        grad_spare=host.empty(trainable_numel, grad_dtype or compute_dtype, pin) if accumulate and spare else None)
    if compact is not None:
        compact.add(store, low)
    # Releases the original storage (unless the caller holds other references to it).
    store.point_params_at(working)
    return store


def build_block_stores(layouts: dict[int, list[ParamEntry]], compute_dtype: torch.dtype, pin: bool, accumulate: bool,
                       host: HostMeter, lean_until: int, grad_dtype: torch.dtype,
                       spares: bool = True, compact: Optional[CompactMasters] = None,
                       pool: Optional[GradPool] = None) -> dict[int, BlockStore]:
    """`build_block_store` for every streamed block, several at once: set-up is the first touch of every
    page of the host buffers (and their page-locking), which the kernel serves faster from several cores.
    Each block's buffers replace only its own parameters' storage, so the host peak is the same as one by
    one: the planned buffers, reached with the last block."""
    workers = max(1, min(SETUP_THREADS, len(os.sched_getaffinity(0)), len(layouts)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stronghold-setup") as setup:
        futures = {i: setup.submit(build_block_store, i, entries, compute_dtype, pin, accumulate, host,
                                  lean=i < lean_until, grad_dtype=grad_dtype, spare=spares, compact=compact,
                                  pool=pool)
                   for i, entries in layouts.items()}
        return {i: future.result() for i, future in futures.items()}
