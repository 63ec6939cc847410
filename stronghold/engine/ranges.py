"""Named profiler ranges around the engine's work on the thread that launches GPU kernels (hooks, waits), so a
torch.profiler trace shows where that thread's time goes (examples/bench/profile_step.py sums them), and the same
hooks' wall time without a profiler (`ranged(..., totals)`: the report's host_hook_s_per_step).

A range costs ~2-6 us even when no profiler runs; the hooks fire thousands of times a step on the launching thread,
so the range is only opened while a profiler is active (a flag check otherwise, ~0.1 us). The profiler's own cost per
recorded op makes its figures upper bounds; the totals are the unprofiled measure (two clock reads a call)."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional

import torch

PREFIX = "stronghold."


def ranged(name: str, fn: Callable[..., Any], totals: Optional[dict[str, float]] = None) -> Callable[..., Any]:
    """`fn`, inside the range PREFIX + `name` while a profiler runs; its seconds added to `totals[name]` if given."""
    label = PREFIX + name

    def call(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            if torch._C._autograd._profiler_enabled():
                with torch.autograd.profiler.record_function(label):
                    return fn(*args)
            return fn(*args)
        finally:
            if totals is not None:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

    return call


def span(name: str) -> contextlib.AbstractContextManager:
    """A `with` block inside the range PREFIX + `name` while a profiler runs."""
    if torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()


def timed(name: str, fn: Callable[[], Any]) -> float:
    """Run `fn` (a wait) inside the range PREFIX + `name` while a profiler runs; its wall seconds."""
    start = time.perf_counter()
    with span(name):
        fn()
    return time.perf_counter() - start
