"""What the CPU optimizer keeps per block and step: the AdamW segments of a block, the record of its
update (early or deferred, its sum of squares), what a micro-step added to an accumulator, the worker's
time counters, and the clip coefficient of a step."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from stronghold.optim.adamw_kernel import AdamWCoeffs
from stronghold.streaming.flag import Flag
from stronghold.streaming.store import BlockStore, ParamEntry


@dataclass(frozen=True)
class Segment:
    """A contiguous range of a block's trainable elements that shares one set of AdamW coefficients."""

    start: int
    stop: int
    coeffs: AdamWCoeffs
    group: int


@dataclass
class UpdateRecord:
    """One block's update in the current step, kept until `finish_step` validates it."""

    store: BlockStore
    entries: list[ParamEntry]
    """The entries this update steps (their `step` counters were advanced for it)."""
    segments: list[Segment]
    from_accum: bool
    unscale: float = 1.0
    """What the gradients are multiplied by to remove the loss scale (the early update used it)."""
    sq: float = 0.0
    """Sum of squares of the gradient the update uses, as stored (loss scale included; valid once
    `sq_ready` is set)."""
    applied: bool = False
    """The worker updated the block during backward (with the unclipped gradient)."""
    landed: Optional[object] = None
    """The D2H event of the gradients (None: the block had none this step); `abort` waits on it before it
    overwrites a lean store's gradients."""
    window_sum: bool = False
    """The gradient is the accumulation window's sum, summed on the GPU (device_accum.py): its buffer is next
    written at the next boundary, so a second pass may hold it (weights first)."""
    unpack: Optional[Callable[[], None]] = None
    """What writes the landed gradients into the gradient buffer (they came down in another layout:
    embedding_rows.py): run once they have landed, before anything reads the buffer, by whichever of the worker's job
    and step()'s claim runs."""
    sq_ready: Flag = field(default_factory=Flag)
    done: Flag = field(default_factory=Flag)
    claimed: bool = False
    """step() took the update over before the worker reached the block's job (`claim`): it runs after the
    global norm is known, in forward order, and the queued job does nothing."""
    early: bool = False
    """The worker's decision, final once `sq_ready` is set: apply the update as soon as the gradients are in."""
    _started: bool = field(default=False, repr=False)
    _finished: bool = field(default=False, repr=False)
    _confirmed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self) -> bool:
        """On the worker, its early update done: True if step() has already confirmed it (the worker releases the
        block), else step() will when it does (`confirm`). Exactly one of the two sees the other's mark."""
        with self._lock:
            self._finished = True
            return self._confirmed

    def confirm(self) -> bool:
        """On the thread running step(), with clipping: the early update stands. True if the worker has finished it
        (the caller releases the block); False if the worker will, as it finishes."""
        with self._lock:
            self._confirmed = True
            return self._finished

    def start(self) -> bool:
        """On the worker, as the block's job begins: False if step() has claimed the update."""
        with self._lock:
            self._started = not self.claimed
            return self._started

    def claim(self) -> bool:
        """On the thread running step(): take the update over if the worker has not started its job."""
        with self._lock:
            self.claimed = not self._started
            return self.claimed

    @property
    def grad(self) -> torch.Tensor:
        """The gradient this update applies: the accumulator's window sum, or the block's gradient buffer."""
        return self.store.accum if self.from_accum else self.store.grad


@dataclass
class MicroAccum:
    """A block's gradients added into its accumulator in the current micro-step (for `abort`)."""

    store: BlockStore
    present: list[ParamEntry]
    first: bool
    held: bool = False
    """Its gradients were not added but wait in the store's spare buffer (`store.life.held`) for the next
    micro-step's."""
    done: Flag = field(default_factory=Flag)


def group_coeffs(group: dict, step: int) -> AdamWCoeffs:
    beta1, beta2 = group["betas"]
    return AdamWCoeffs(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                       float(group["weight_decay"]), step)


def contiguous_ranges(entries: list[ParamEntry]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for entry in entries:
        if ranges and ranges[-1][1] == entry.offset:
            ranges[-1] = (ranges[-1][0], entry.offset + entry.numel)
        else:
            ranges.append((entry.offset, entry.offset + entry.numel))
    return ranges


def segments_of(entries: list[ParamEntry], coeffs: Callable[[ParamEntry], AdamWCoeffs]) -> list[Segment]:
    """Merge adjacent entries with the same coefficients into one kernel call each."""
    segments: list[Segment] = []
    for entry in entries:
        c = coeffs(entry)
        last = segments[-1] if segments else None
        if last is not None and last.stop == entry.offset and last.coeffs == c:
            segments[-1] = Segment(last.start, entry.offset + entry.numel, c, entry.group)
        else:
            segments.append(Segment(entry.offset, entry.offset + entry.numel, c, entry.group))
    return segments


def local_segments(segments: list[Segment], store: BlockStore) -> list[Segment]:
    """`segments` clipped to the store's shard, in shard coordinates (AdamW is elementwise, so a segment may
    be cut anywhere; each piece keeps its group's coefficients)."""
    lo, hi = store.shard_start, store.shard_stop
    return [Segment(max(s.start, lo) - lo, min(s.stop, hi) - lo, s.coeffs, s.group)
            for s in segments if min(s.stop, hi) > max(s.start, lo)]


@dataclass
class CpuStats:
    busy_s: float = 0.0
    """Worker time spent in kernels (accumulate, update, redo), not counting `landed_wait_s`."""
    kernel_s: float = 0.0
    """Of `busy_s`, the time inside the native kernel's calls (0 with the eager fallback); the rest is the jobs'
    Python and the GIL each ctypes return waits for."""
    landed_wait_s: float = 0.0
    """Worker time waiting for a block's gradients to land on the host (the GPU had not produced them)."""
    wait_step_s: float = 0.0
    """Host time `step()` waited for the last speculative updates (the CPU tail)."""
    grad_buffer_wait_s: float = 0.0
    """Time backward waited for a block's host gradient buffer to be read (`CpuOptimizer.take_grad_buffer`)."""
    redo_blocks: int = 0
    deferred_blocks: int = 0
    weights_first_blocks: int = 0
    """Deferred updates made in two passes, the next forward's weights first (weights_first.py)."""
    claimed_blocks: int = 0
    """Of the deferred updates, those step() took over from the worker's queue (`UpdateRecord.claim`)."""


def norm_and_clip_coef(sq_sum: float, max_norm: float, loss_scale: float = 1.0) -> tuple[float, float]:
    """Global gradient norm and torch's clip coefficient min(1, max_norm / (norm + 1e-6)), from the sum of
    squares of gradients multiplied by `loss_scale` (the norm is of the unscaled gradients)."""
    norm = math.sqrt(max(sq_sum, 0.0)) / loss_scale
    if max_norm <= 0:
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + 1e-6))
