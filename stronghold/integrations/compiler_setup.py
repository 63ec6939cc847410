"""The process's one-time share of the first Inductor compile, done on a thread while the engine and the trainer set up.

The first block compile in a process pays for more than its graph: importing Inductor's compiler modules (about two
seconds on a small CPU), hashing the installed torch into the keys of Inductor's on-disk cache (`torch_key`), loading
cuBLAS for the device, and the first use of Dynamo, AOTAutograd and Inductor themselves (their tables and lazy parts,
the cache's machinery, Inductor's compile workers, Triton's driver). None of it depends on the model or its inputs,
and all of it is kept for the process, so a thread started with the compiled blocks (compile.py) does it during
set-up, and the first step is left the model's own compile (docs/results.md, "First step against a steady one"). The
imports, the key and cuBLAS come first; then, on a GPU, a rehearsal compiles a block in miniature
(compile_rehearsal.py), which is where Dynamo's first use is paid. Triton's own hash (`CacheBase.get_system`) is left
out: the blocks' compile, cold or warm, does not compute it.

On a thread rather than in the engine's construction: done there it cost the set-up more than it took off the first
step (docs/results.md). The one line (hf.prepare) starts it at once (`start_early`), while the user's script builds
its Trainer and data, as the engine is built only in Trainer's `train()`; otherwise the engine starts it at the start
of its construction, beside the host buffers (compile.start_set_up). The engine takes that thread over, and waits for a
running one before its CPU probe (`wait_all`), whose rates a thread sharing the cores would lower. The first training
call and the blocks' first compiled call wait for it (so no two of our compiles run at once), and so does a fork
(os.register_at_fork): a child forked while the thread held a module's import lock could not import that module.
Private parts of torch: where a release moved one, the compile does that part itself, and the report says why
(`set_up_error`, `set_up_rehearsal_error`).
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional, Union

import torch

from stronghold.integrations import compile_rehearsal
from stronghold.streaming.streams import indexed

logger = logging.getLogger(__name__)

MODULES = ("torch._inductor.compile_fx", "torch._functorch.aot_autograd", "torch._inductor.codecache",
           "torch._inductor.async_compile", "torch._inductor.runtime.triton_heuristics")
"""What the first Inductor compile imports beyond what `import torch` and transformers have."""

FORK_WAIT_S = 60.0
"""A fork waits at most this long (the thread's work is a few imports, a hash and a small compile, whose kernels a
first run in a fresh Inductor cache compiles): a fork from a thread that holds an import lock the set-up waits on must
not hang for good."""
REASON_CHARS = 300
"""A failed rehearsal's report keeps this much of the error (a compile's can hold a whole traceback)."""
FIRST_CALL_WAIT_S = 60.0
"""The first compiled call waits at most this long; past it, the compile computes what it needs itself."""

_running: set["CompilerSetUp"] = set()
_early: dict[torch.device, "CompilerSetUp"] = {}
"""Set-ups started by `start_early`, by device, until an engine takes one over (`take_early`)."""
_lock = threading.Lock()


def wait_all(timeout_s: float) -> None:
    """Wait for every running set-up, each at most `timeout_s`."""
    with _lock:
        running = list(_running)
    for set_up in running:
        set_up.wait(timeout_s)


def _wait_all_before_fork() -> None:
    wait_all(FORK_WAIT_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_wait_all_before_fork)


def start_early(device: torch.device, backend: Union[str, Callable] = "inductor",
                options: Optional[dict] = None) -> "CompilerSetUp":
    """Start a set-up for `device` now, for the engine built later to take over; one per device (a second call, e.g.
    a second prepared model, returns the first's while no engine has taken it)."""
    key = indexed(device)
    if key not in _early:  # the callers (the one line, the engine's construction) run on one thread
        _early[key] = CompilerSetUp(device, backend, options)
    return _early[key]


def take_early(device: torch.device) -> Optional["CompilerSetUp"]:
    """The set-up `start_early` started for `device`, handed over once (None where there is none)."""
    with _lock:
        return _early.pop(indexed(device), None)


class CompilerSetUp:
    """Started by the one line or the engine's construction; `wait` before the first compile. `report` says what it
    took."""

    def __init__(self, device: torch.device, backend: Union[str, Callable] = "inductor", options: Optional[dict] = None,
                 rehearse: Optional[bool] = None):
        self.device = indexed(device)  # here: a new thread's current device is GPU 0
        self.backend, self.options = backend, options
        self.rehearse = device.type == "cuda" if rehearse is None else rehearse
        """Whether the thread compiles the miniature block (compile_rehearsal.py): by default where the blocks compile
        by default, on a GPU (compile.compile_wanted)."""
        self.seconds: Optional[float] = None
        """The thread's own time (None while it runs)."""
        self.rehearsal_s: Optional[float] = None
        self.rehearsal_error: Optional[str] = None
        self.waited_s = 0.0
        """How long callers (the CPU probe, the first training call or compiled call, a fork) waited for it."""
        self.error: Optional[str] = None
        """Why a part failed (the compile then does that part itself)."""
        self._thread = threading.Thread(target=self._run, name="stronghold-compiler-set-up", daemon=True)
        with _lock:
            _running.add(self)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._process_parts()
            if self.rehearse:
                self._rehearse()
        finally:
            self.seconds = time.perf_counter() - start
            with _lock:
                _running.discard(self)

    def _process_parts(self) -> None:
        try:
            for name in MODULES:
                importlib.import_module(name)
            sys.modules["torch._inductor.codecache"].torch_key()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                torch.cuda.current_blas_handle()  # loads cuBLAS for the process (the handle is this thread's)
        except Exception as err:  # private parts of torch that a release may move: the compile does them itself
            self.error = f"{type(err).__name__}: {err}"
            logger.debug(f"compile: the compiler's set-up stopped early ({self.error})")

    def _rehearse(self) -> None:
        start = time.perf_counter()
        try:
            compile_rehearsal.rehearse(self.device, self.backend, self.options)
        except Exception as err:  # whatever the compile raised: the blocks' own compile meets it there, and says so
            self.rehearsal_error = f"{type(err).__name__}: {str(err).strip()[:REASON_CHARS]}"
            logger.debug(f"compile: the rehearsal failed ({self.rehearsal_error})")
        finally:
            self.rehearsal_s = time.perf_counter() - start

    def wait(self, timeout_s: float = FIRST_CALL_WAIT_S) -> None:
        if self._thread is threading.current_thread() or not self._thread.is_alive():
            return
        start = time.perf_counter()
        self._thread.join(timeout_s)
        self.waited_s += time.perf_counter() - start

    def report(self) -> dict:
        out = {"set_up_s": self.seconds, "set_up_wait_s": self.waited_s}
        if self.error is not None:
            out["set_up_error"] = self.error
        if self.rehearse:
            out["set_up_rehearsal_s"] = self.rehearsal_s
        if self.rehearsal_error is not None:
            out["set_up_rehearsal_error"] = self.rehearsal_error
        return out
