"""The process's one-time share of the first torch.compile, done on a thread while the engine and the trainer set up.

The first block compile in a process pays for more than its graph: importing Inductor's compiler modules, and
hashing the installed torch and Triton into the keys of Inductor's on-disk cache (Triton's hash reads its shared
library). None of it depends on the model or its inputs, so a thread started with the compiled blocks (compile.py)
does it during set-up, and the first step is left the model's own compile (from Inductor's cache, where warm). The
thread runs no Dynamo and compiles nothing; the blocks' first compiled call waits for it (so the keys are computed
once, not twice at the same time), and so does a fork (os.register_at_fork): a child forked while the thread held a
module's import lock could not import that module.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MODULES = ("torch._inductor.compile_fx", "torch._functorch.aot_autograd", "torch._inductor.codecache",
           "torch._inductor.async_compile", "torch._inductor.runtime.triton_heuristics")
"""What the first Inductor compile imports beyond what `import torch` and transformers have."""

FORK_WAIT_S = 10.0
"""A fork waits at most this long (the thread's work is a few imports and two hashes): a fork from a thread that holds
an import lock the warm-up waits on must not hang for good."""
FIRST_CALL_WAIT_S = 60.0
"""The first compiled call waits at most this long; past it, the compile computes what it needs itself."""

_running: set["CompilerWarmUp"] = set()
_lock = threading.Lock()


def _wait_all_before_fork() -> None:
    with _lock:
        running = list(_running)
    for warm_up in running:
        warm_up.wait(FORK_WAIT_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_wait_all_before_fork)


class CompilerWarmUp:
    """Started at construction; `wait` before the first compile. `report` says what it took."""

    def __init__(self, device: torch.device):
        # A new thread's current device is GPU 0: name this process's one (the caller's current one if unindexed).
        unindexed = device.type == "cuda" and device.index is None
        self.device = torch.device("cuda", torch.cuda.current_device()) if unindexed else device
        self.seconds: Optional[float] = None
        """The thread's own time (None while it runs)."""
        self.waited_s = 0.0
        """How long callers (the first compiled call, a fork) waited for it."""
        self.error: Optional[str] = None
        """Why a part failed (the compile then does that part itself)."""
        self._thread = threading.Thread(target=self._run, name="stronghold-compiler-warm-up", daemon=True)
        with _lock:
            _running.add(self)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # this thread's current device: the key reads its name
            for name in MODULES:
                importlib.import_module(name)
            codecache = sys.modules["torch._inductor.codecache"]
            codecache.torch_key()
            codecache.CacheBase.get_system()  # Triton's hash and the device's name, cached for the process
        except Exception as err:  # private parts of torch that a release may move: the compile does them itself
            self.error = f"{type(err).__name__}: {err}"
            logger.debug(f"compile: the compiler warm-up stopped early ({self.error})")
        finally:
            self.seconds = time.perf_counter() - start
            with _lock:
                _running.discard(self)

    def wait(self, timeout_s: float = FIRST_CALL_WAIT_S) -> None:
        if self._thread is threading.current_thread() or not self._thread.is_alive():
            return
        start = time.perf_counter()
        self._thread.join(timeout_s)
        self.waited_s += time.perf_counter() - start

    def report(self) -> dict:
        out = {"warm_up_s": self.seconds, "warm_up_wait_s": self.waited_s}
        if self.error is not None:
            out["warm_up_error"] = self.error
        return out
