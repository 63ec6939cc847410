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


def require_idle(state: StepState, call: str) -> None:
    """`call` reads or replaces the whole training state (a checkpoint, the optimizer's state dict), which is only
    whole between steps: pending gradients would be lost, or applied later to other weights and step counts (the
    streamed blocks' AdamW steps of the pending update have already begun). So it raises, before anything changes."""
    if state is StepState.IDLE:
        return
    where = ("after the backward() that ends a gradient-accumulation window" if state is StepState.UPDATING
             else "in the middle of a gradient-accumulation window")
    raise ValueError(f"{call} was called between backward() and step() ({where}), so the pending gradients would be "
                     f"lost or applied to other weights; call {call} after engine.step() at an accumulation boundary")


@dataclass
class MicroState:
    """Per streamed block, on the thread that runs backward."""

    arrived: int = 0
    offloaded: bool = False
    accum_started: bool = False
    accum_before: bool = False
    """`accum_started` when this micro-step's backward began (restored if it fails)."""
