"""Host-side state of each streamed block: flat buffers, the parameter layout in them, and residency.

Per streamed block (numel N, trainable T <= N):
- `working`: compute dtype, N elements, pinned. The H2D source. Trainable parameters come first,
  grouped by optimizer param group, so each group is one contiguous range for the CPU AdamW;
  frozen parameters follow. In fp32 mode this *is* the fp32 master (no second copy).
- `master`, `exp_avg`, `exp_avg_sq`: fp32, T elements, pageable (only DMA buffers need pinning).
- `grad`: compute dtype, T elements, pinned. The D2H destination of the block's gradients.
- `accum`: fp32, T elements, only with gradient accumulation: the sum over micro-steps.
While a block is not on the GPU, its parameters' `.data` are views of `working`, so the model
stays inspectable (shapes, state_dict) and a forgotten load fails loudly (device mismatch).
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Optional

import psutil
import torch
from torch import nn

GIB = 2 ** 30


class Residency(enum.Enum):
    HOST = "host"            # weights only in host memory
    IN_FLIGHT = "in_flight"  # H2D issued into a slot; compute must wait on the slot's ready event
    RESIDENT = "resident"    # in a slot and the compute stream already waited for it


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
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    accum: Optional[torch.Tensor]
    grad_sq: torch.Tensor
    """fp32, 1 element, pinned: the sum of squares of the gradients in `grad`, computed on the device as
    they are produced and copied down with them (the CPU optimizer decides early vs deferred on it)."""
    residency: Residency = Residency.HOST
    slot: Optional[int] = None
    version: int = 0
    """Bumped whenever the weights change; a slot holding an older version is stale."""
    updated: threading.Event = field(default_factory=threading.Event)
    """Set when `working` holds the final weights of the latest step (safe to read for H2D)."""
    grad_free: threading.Event = field(default_factory=threading.Event)
    """Set when the CPU is done with `grad` (safe for the next D2H to overwrite)."""

    trainable: list[ParamEntry] = field(default_factory=list)
    """The entries the optimizer updates (a prefix of `entries`)."""

    def __post_init__(self):
        self.updated.set()
        self.grad_free.set()
        self.trainable = [e for e in self.entries if e.group is not None]

    def point_params_at(self, buffer: torch.Tensor) -> None:
        """Make every parameter's .data a view of `buffer` (a GPU slot or the host working copy)."""
        for entry in self.entries:
            entry.param.data = entry.host_view(buffer)


@dataclass(frozen=True)
class HostPlan:
    """Bytes of host memory the streamed blocks need, by kind, for the error message and the check."""

    master_and_moments: int
    working: int
    grads: int
    accum: int
    freed: int
    """Bytes of the original parameter storage released as each block moves into our buffers."""

    @property
    def total(self) -> int:
        return self.master_and_moments + self.working + self.grads + self.accum

    def check_available(self, available: Optional[int] = None) -> None:
        available = psutil.virtual_memory().available if available is None else available
        # Keep a margin: the allocator, the data loader and pinned-memory bookkeeping need room too.
        needed = self.total - self.freed
        if needed > 0.9 * available:
            raise MemoryError(
                f"stronghold needs {self.total / GIB:.1f} GiB of host memory for the streamed blocks "
                f"(fp32 master + Adam moments {self.master_and_moments / GIB:.1f}, working copies "
                f"{self.working / GIB:.1f}, gradient buffers {self.grads / GIB:.1f}, accumulation "
                f"{self.accum / GIB:.1f}; {self.freed / GIB:.1f} of the model's own memory is reused), "
                f"but only {available / GIB:.1f} GiB is available. Raise \"resident_blocks\" to keep more "
                f"blocks on the GPU, use a smaller model, or free host memory. Nothing was allocated.")


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


def plan_host_memory(blocks: list[list[ParamEntry]], compute_dtype: torch.dtype, accumulate: bool) -> HostPlan:
    csize = torch.tensor([], dtype=compute_dtype).element_size()
    numel = sum(e.numel for entries in blocks for e in entries)
    trainable = sum(e.numel for entries in blocks for e in entries if e.group is not None)
    fp32_working = compute_dtype == torch.float32
    return HostPlan(
        master_and_moments=trainable * (8 if fp32_working else 12),
        working=numel * csize,
        grads=trainable * csize,
        accum=trainable * 4 if accumulate else 0,
        freed=sum(e.param.numel() * e.param.element_size() for entries in blocks for e in entries),
    )


def _empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def build_block_store(index: int, entries: list[ParamEntry], compute_dtype: torch.dtype, pin: bool,
                      accumulate: bool) -> BlockStore:
    """Move one block's parameters into fresh host buffers (fp32 master from the original values)."""
    numel = sum(e.numel for e in entries)
    trainable_numel = sum(e.numel for e in entries if e.group is not None)
    working = _empty(numel, compute_dtype, pin)
    if compute_dtype == torch.float32:
        master = working[:trainable_numel]
    else:
        master = torch.empty(trainable_numel, dtype=torch.float32)
    for entry in entries:
        source = entry.param.data.detach().reshape(-1)
        if source.device.type != "cpu":
            source = source.cpu()
        if entry.group is not None and master.data_ptr() != working.data_ptr():
            master[entry.offset:entry.offset + entry.numel].copy_(source)
        working[entry.offset:entry.offset + entry.numel].copy_(source)
    store = BlockStore(
        index=index, entries=entries, numel=numel, trainable_numel=trainable_numel, working=working,
        master=master, exp_avg=torch.zeros(trainable_numel, dtype=torch.float32),
        exp_avg_sq=torch.zeros(trainable_numel, dtype=torch.float32),
        grad=_empty(trainable_numel, compute_dtype, pin),
        accum=torch.zeros(trainable_numel, dtype=torch.float32) if accumulate else None,
        grad_sq=_empty(1, torch.float32, pin))
    # Releases the original storage (unless the caller holds other references to it).
    store.point_params_at(working)
    return store
