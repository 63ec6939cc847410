"""Where the runtime is in the forward / backward / step cycle, and each streamed block's part of the
current micro-step (runtime.py moves both)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class StepState(enum.Enum):
    """Where the runtime is in the forward / backward / step cycle (the engine's calls move it)."""

    IDLE = "idle"                  # no gradients pending: forward, backward, save all fine
    ACCUMULATING = "accumulating"  # micro-steps of an accumulation window have added gradients
    UPDATING = "updating"          # a boundary backward ended: updates are in flight until step()


@dataclass
class MicroState:
    """Per streamed block, on the thread that runs backward."""

    arrived: int = 0
    offloaded: bool = False
    accum_started: bool = False
    accum_before: bool = False
    """`accum_started` when this micro-step's backward began (restored if it fails)."""
