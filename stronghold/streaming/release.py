"""Host buffers given back off the thread that launches the GPU work.

A block that becomes resident leaves its host buffers behind: the fp32 master and moments (private mappings), the
pinned working copy and gradient buffers (shared mappings, page-locked: pinned.py). Dropping the last reference runs
their finalizers: cudaHostUnregister, then munmap, where the kernel frees the pages one by one, slowest for the
shared 4 KiB pages of the pinned buffers and for pages a step has written. On the training thread that is the likely
bulk (not timed apart) of a promotion's `move_s` (results/hf/first_step.jsonl: 1.42 s for 7 Llama 2.70 B blocks at
the first forward, 0.82 s for 2 blocks after the first step, whose moments the step had written), inside the first
steps.

`HostReleaser` takes such references over and drops them on one thread of its own, so the promotion returns once the
weights are on the device and the next forward runs while the pages go back. The thread makes the runtime's device
current first: a pinned buffer is unregistered in the CUDA context that registered it, and a new thread's current
device is the first GPU, not this rank's. `drain` waits until everything handed over is gone: before the process's
memory is measured, and at close.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

import torch

from stronghold.streaming.streams import indexed


class HostReleaser:
    def __init__(self, device: torch.device):
        self.device = indexed(device)  # here, on the caller's thread
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._pending = 0
        self._done = threading.Condition()
        self.errors: list[str] = []
        """Why a hand-over's `then` failed (the references were dropped anyway); the engine's report keeps them."""

    def release(self, objects: list, then: Optional[Callable[[], object]] = None) -> None:
        """Drop `objects` (the list is emptied on the releaser's thread), then call `then`. The caller must hold no
        other reference to them, or that reference frees them wherever it goes."""
        with self._done:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stronghold-host-release", daemon=True)
            self._thread.start()
        self._queue.put((objects, then))

    def drain(self) -> None:
        """Wait until every list handed over is dropped and its `then` has run."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        self.drain()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self.device.type == "cuda":
            try:
                torch.cuda.set_device(self.device)
            except Exception as err:  # the buffers still go; an unregister in the wrong context fails, reported
                self.errors.append(f"{type(err).__name__}: {err}")
        while True:
            item = self._queue.get()
            if item is None:
                return
            objects, then = item
            del item
            try:
                objects.clear()  # the last references: the buffers' finalizers run here
                del objects
                if then is not None:
                    then()
            except Exception as err:  # memory left held costs memory, not correctness: reported, never raised
                self.errors.append(f"{type(err).__name__}: {err}")
            finally:
                del then
                with self._done:  # whatever happened, `drain` must not wait for this hand-over forever
                    self._pending -= 1
                    self._done.notify_all()
