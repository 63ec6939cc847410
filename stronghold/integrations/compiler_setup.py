"""The process's one-time share of the first Inductor compile, done while the engine is built, not in the first step.

The first block compile in a process pays for more than its graph: importing Inductor's compiler modules (over a
second on a small CPU), hashing the installed torch into the keys of Inductor's on-disk cache (`torch_key`), and
creating the device's cuBLAS handle. None of it depends on the model or its inputs, and it is all cached for the
process, so construction does it (compile.compile_blocks) and the first step is left the model's own compile
(docs/results.md, "First step against a steady one"). Triton's own hash (`CacheBase.get_system`, a second of hashing
its library) is left out: the blocks' compile, cold or warm, does not compute it.

Synchronous on purpose: a thread doing the same beside the set-up could hold an import lock when the process forks (a
data loader's worker), which the child could then never take, so it needed a fork handler; the work is a fraction of
a second on a GPU host against the engine's set-up of tens of seconds. Private parts of torch: where a release moved
one, the compile does that part itself, and the report says why (`set_up_error`).
"""
from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MODULES = ("torch._inductor.compile_fx", "torch._functorch.aot_autograd", "torch._inductor.codecache",
           "torch._inductor.async_compile", "torch._inductor.runtime.triton_heuristics")
"""What the first Inductor compile imports beyond what `import torch` and transformers have."""


def prepare_compiler(device: torch.device) -> dict:
    """Do the first compile's process-wide work now. Returns {"set_up_s": seconds} and, where a part failed,
    "set_up_error" (the compile then does that part itself)."""
    start = time.perf_counter()
    error: Optional[str] = None
    try:
        for name in MODULES:
            importlib.import_module(name)
        codecache = sys.modules["torch._inductor.codecache"]
        codecache.torch_key()
        if device.type == "cuda":
            with torch.cuda.device(device if device.index is not None else torch.cuda.current_device()):
                torch.cuda.current_blas_handle()
    except Exception as err:  # a private part of torch that a release moved: the compile does it itself
        error = f"{type(err).__name__}: {err}"
        logger.debug(f"compile: the compiler's set-up stopped early ({error})")
    out = {"set_up_s": time.perf_counter() - start}
    if error is not None:
        out["set_up_error"] = error
    return out
