"""Named profiler ranges around the engine's work on the thread that launches GPU kernels (hooks, waits), so a
torch.profiler trace shows where that thread's time goes (examples/bench/profile_step.py sums them).

A range costs ~2-6 us even when no profiler runs; the hooks fire thousands of times a step on the launching thread,
so the range is only opened while a profiler is active (a flag check otherwise, ~0.1 us)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

PREFIX = "stronghold."


def ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, inside the range PREFIX + `name` while a profiler runs."""
    label = PREFIX + name

    def call(*args: Any) -> Any:
        if torch._C._autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(label):
                return fn(*args)
        return fn(*args)

    return call


def span(name: str) -> contextlib.AbstractContextManager:
    """A `with` block inside the range PREFIX + `name` while a profiler runs."""
    if torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()
