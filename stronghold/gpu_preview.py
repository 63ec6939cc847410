"""GPU previews: the GPU writes some streamed blocks' next weights at the update boundary, beside the CPU.

At an accumulation boundary whose streamed updates wait for the global norm, the CPU previews every streamed block's
next compute-dtype weights (weights_first.py) and the next forward waits for each in turn. The previews are bound by
host memory bandwidth, 18 bytes a parameter: on the Llama 2.70 B GA 8 point under 32 GiB they end ~0.2 s after the
forward could have begun, most of the gap to plain DeepSpeed (results/placement/NOTES.md, session 29). PCIe is idle
then. So every other streamed block (forward order) is previewed on the GPU instead: its fp32 master, moments and
gradient go up (16 bytes a parameter), stronghold_ops' `adamw_preview` kernel computes the weights the CPU kernel
would, bit for bit, and they come down into the block's working copy (2 bytes), from where the next forward loads
them as any other. The CPU's second pass (the fp32 state) is unchanged; it waits until the copies up have read the
block. Measured alone on the H200 (examples/probe_gpu_preview.py, run96): a CPU preview 16-17 ms a 79 M-element
block, the GPU's 18 ms with 12 bytes up (53 GB/s); both at once, 8 blocks took 82-88 ms against 115-125 ms on the
CPU alone, the CPU's kernels ~10% slower beside the copies.

Copies up from pageable memory ran at a tenth of that rate (140-170 ms a block), so the chosen blocks' master and
moments are page-locked where they are (cudaHostRegister; they stay on their huge pages), and excluded from a fork's
child (MADV_DONTFORK) so that a DataLoader worker's fork copies none of them. The gradient is in a pinned buffer
already (the accumulator, or the window sum's D2H destination).

A thread of its own issues the copies and kernels (a block is ~20 chunks, ~120 launches, kept off the thread that
launches the forward) through a ring of two chunk-sized staging sets on the GPU, and sets each block's `updated`
event once its weights are in the working copy. On the CPU (tests: `"gpu_previews": true`) the same thread runs the
same kernel in Triton's interpreter, synchronously.
"""
from __future__ import annotations

import ctypes
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .cpu_adam import AdamWCoeffs
from .pinned import EXACT_MIN_BYTES, host_register, host_unregister
from .store import BlockStore

CHUNK_NUMEL = 8 * 2 ** 20
"""Elements a staging set holds: 32 MiB copies run at PCIe's full rate, ~10 chunks a Llama block keep the preview
thread's launches (each holds the GIL a little while the launching thread wants it) few, and the ring is 288 MiB."""

RING_SETS = 2
"""Staging sets: one filling while the kernel and the copy down of the other run."""

RING_BYTES_PER_ELEMENT = RING_SETS * (4 * 4 + 2)
"""GPU bytes of the ring per chunk element: per set, fp32 master, moments and gradient, and the compute-dtype
weights (the planner counts `ring_bytes()`)."""

_MADV_DONTFORK, _MADV_DOFORK = 10, 11
_PAGE = 4096


def ring_bytes() -> int:
    return CHUNK_NUMEL * RING_BYTES_PER_ELEMENT


def gpu_previews_on(setting, device: torch.device, compute_dtype: torch.dtype, one_process: bool) -> bool:
    """The config's `gpu_previews` for this run: "auto" is on a GPU, in bf16/fp16 (fp32 has no separate working
    copy to preview), on one process (a sharded store previews nothing)."""
    possible = compute_dtype != torch.float32 and one_process
    if setting == "auto":
        return possible and device.type == "cuda"
    if setting and not possible:
        raise ValueError("stronghold: \"gpu_previews\": true needs bf16 or fp16 and one process (fp32 has no working "
                         "copy to preview, and data parallel shards the state); set it to \"auto\" or false")
    return bool(setting)


def _madvise(tensor: torch.Tensor, advice: int) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if ctypes.CDLL(None).madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), advice) != 0:
        raise OSError(ctypes.get_errno(), "madvise")


def _state(store: BlockStore) -> list[torch.Tensor]:
    return [store.master, store.exp_avg, store.exp_avg_sq]


@dataclass
class _Job:
    store: BlockStore
    grad: torch.Tensor
    segments: list[tuple[int, int, AdamWCoeffs]]
    scale: float
    on_written: Callable[[], None]
    issued: threading.Event = field(default_factory=threading.Event)
    reads: Optional[object] = None
    """CUDA event after the last copy up (None on the CPU, where the job is complete once issued)."""


class GpuPreviews:
    def __init__(self, device: torch.device, stores: dict[int, BlockStore], register: Callable[[int, int], int] = host_register,
                 unregister: Callable[[int], object] = host_unregister):
        self.device = device
        self.stores = stores
        """The runtime's streamed blocks (the same dict: promotion removes from it)."""
        self.cuda = device.type == "cuda"
        self._register, self._unregister = register, unregister
        self.blocks: dict[int, list[torch.Tensor]] = {}
        """Blocks previewed here, with their page-locked state tensors (empty list on the CPU)."""
        self.staging = [[torch.empty(CHUNK_NUMEL, dtype=torch.float32, device=device) for _ in range(4)]
                        for _ in range(RING_SETS)]
        self._outs: dict[torch.dtype, list[torch.Tensor]] = {}
        self._free: list[Optional[object]] = [None] * RING_SETS
        self._next = 0
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.compute_stream = torch.cuda.Stream(device) if self.cuda else None
        self.error: Optional[BaseException] = None
        self._lock_blocks = threading.Lock()
        self._locking: set[int] = set()
        self._active: set[int] = set()
        """Blocks queued for page-locking on the preview thread."""
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="stronghold-gpu-previews", daemon=True)
        self._thread.start()

    # Which blocks --------------------------------------------------------------------------------------------
    def choose(self) -> None:
        """Every other streamed block in forward order, starting with the second: the CPU, whose first preview
        starts without a copy's latency, takes the first. Called at each step that previews (so a run whose CPU
        never previews, e.g. a host-bound one, locks nothing), after the caller drained when blocks may have left
        (promotion). Blocks no longer chosen are unlocked at once; new ones are locked on the preview thread, behind
        this step's previews, and previewed here from the next step on. A block whose state cannot be page-locked
        (the limit of locked memory) stays with the CPU."""
        stores = self.stores
        wanted = {index for position, index in enumerate(sorted(stores))
                  if position % 2 == 1 and self._eligible(stores[index])}
        self.prune(wanted)
        with self._lock_blocks:
            new = [stores[index] for index in sorted(wanted) if index not in self.blocks and index not in self._locking]
            self._locking.update(store.index for store in new)
        if new and self.cuda:
            self._queue.put(lambda: self._lock_all(new))
        elif new:  # nothing to page-lock on the CPU
            self._lock_all(new)
        with self._lock_blocks:
            self._active = set(self.blocks)  # this step's: a block still being locked joins at the next

    def prune(self, wanted: Optional[set[int]] = None) -> None:
        """Unlock the blocks no longer streamed (promotion), or not in `wanted`."""
        with self._lock_blocks:
            gone = [i for i in self.blocks if i not in self.stores or (wanted is not None and i not in wanted)]
        if gone:
            self.drain()  # no job of theirs still copying, and no lock queued behind one
        for index in gone:
            self.release(index)

    def _lock_all(self, stores: list[BlockStore]) -> None:
        for store in stores:
            locked = self._lock(store)
            with self._lock_blocks:
                self._locking.discard(store.index)
                if locked is not None:
                    self.blocks[store.index] = locked

    def previews(self, store: BlockStore) -> bool:
        """Whether this step's preview of `store` is made here (fixed by `choose` for the step)."""
        return store.index in self._active

    @staticmethod
    def _eligible(store: BlockStore) -> bool:
        # A lean store's gradients are in its working copy, which the preview writes; a sharded one previews nothing.
        # The gradient must be fp32 (accumulating steps: the host accumulator or the GPU's window sum), as staged.
        grad = store.grad if store.accum is None else store.accum
        return (not store.lean and not store.sharded and store.trainable_numel > 0 and grad.dtype == torch.float32
                and store.master.data_ptr() != store.working.data_ptr())

    def _lock(self, store: BlockStore) -> Optional[list[torch.Tensor]]:
        if not self.cuda:
            return []
        state = _state(store)
        # Only whole anonymous mappings (pinned.pageable_empty): page-aligned, registered and advised alone.
        if any(t.data_ptr() % _PAGE or t.numel() * t.element_size() < EXACT_MIN_BYTES for t in state):
            return None
        locked: list[torch.Tensor] = []
        for tensor in state:
            if self._register(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
                self._unlock(locked)
                return None
            locked.append(tensor)
            _madvise(tensor, _MADV_DONTFORK)
        return locked

    def _unlock(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            _madvise(tensor, _MADV_DOFORK)
            self._unregister(tensor.data_ptr())

    def release(self, index: int) -> None:
        """Block `index` is no longer chosen, or the runtime closes: unlock its state. No job of the block is in flight
        (the caller drained, or the block was not previewed here this step)."""
        with self._lock_blocks:
            locked = self.blocks.pop(index)
            self._active.discard(index)
        self._unlock(locked)

    # Work ------------------------------------------------------------------------------------------------------
    def submit(self, jobs: list[_Job]) -> None:
        """Preview these blocks, in order, on the preview thread."""
        self.check()
        if jobs:
            self._queue.put(lambda: self._preview(jobs))

    def job(self, store: BlockStore, grad: torch.Tensor, segments: list[tuple[int, int, AdamWCoeffs]], scale: float,
            on_written: Callable[[], None]) -> _Job:
        return _Job(store, grad, segments, scale, on_written)

    @staticmethod
    def wait_read(job: _Job) -> None:
        """On the CPU worker, before its second pass writes the block's state: the copies up have read it."""
        job.issued.wait()
        if job.reads is not None:
            job.reads.synchronize()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("stronghold's GPU previews failed") from self.error

    def drain(self) -> None:
        self._queue.join()
        self.check()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60.0)
        for index in list(self.blocks):
            self.release(index)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                self._queue.task_done()
                return
            try:
                if self.error is None:
                    work()
            except BaseException as err:  # noqa: BLE001 - surfaced by check() / drain() on the caller's thread
                self.error = err
            finally:
                self._queue.task_done()

    def _preview(self, jobs: list[_Job]) -> None:
        try:
            written = [self._issue(job) for job in jobs]
            for job, event in zip(jobs, written):
                if event is not None:
                    event.synchronize()
                job.on_written()
        finally:
            for job in jobs:
                job.issued.set()  # never leave the worker's second pass waiting on a failed job

    def _out(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._outs:
            self._outs[dtype] = [torch.empty(CHUNK_NUMEL, dtype=dtype, device=self.device) for _ in range(RING_SETS)]
        return self._outs[dtype][k]

    def _issue(self, job: _Job):
        """Launch a block's chunks through the ring; returns the event after its weights reach the working copy."""
        import triton

        from stronghold_ops.kernels.adamw_preview import adamw_preview

        store = job.store
        sources = _state(store) + [job.grad]
        working = store.working[store.shard_start:]
        for start, stop, coeffs in job.segments:
            c = coeffs.as_struct()
            for lo in range(start, stop, CHUNK_NUMEL):
                hi, k = min(lo + CHUNK_NUMEL, stop), self._next
                self._next = (k + 1) % RING_SETS
                n, stage, out = hi - lo, self.staging[k], self._out(k, working.dtype)
                with torch.cuda.stream(self.copy_stream) if self.cuda else _nothing():
                    if self._free[k] is not None:
                        self.copy_stream.wait_event(self._free[k])
                    for dst, src in zip(stage, sources):
                        dst[:n].copy_(src[lo:hi], non_blocking=self.cuda)
                    copied = self.copy_stream.record_event() if self.cuda else None
                with torch.cuda.stream(self.compute_stream) if self.cuda else _nothing():
                    if copied is not None:
                        self.compute_stream.wait_event(copied)
                    adamw_preview[(triton.cdiv(n, 1024),)](
                        *stage, out, n, job.scale, c.decay, c.w1, c.beta2, c.omb2, c.neg_step_size, c.bc2_sqrt,
                        c.eps, BLOCK=1024, enable_fp_fusion=False)
                    working[lo:hi].copy_(out[:n], non_blocking=self.cuda)
                    self._free[k] = self.compute_stream.record_event() if self.cuda else None
        job.reads = self.copy_stream.record_event() if self.cuda else None
        job.issued.set()
        return self.compute_stream.record_event() if self.cuda else None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
