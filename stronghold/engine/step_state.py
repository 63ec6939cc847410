"""Where the runtime is in the forward / backward / step cycle, and each streamed block's part of the
current micro-step (runtime.py moves both).

Every call order DeepSpeed allows gives what plain DeepSpeed with torch's AdamW gives, or a clear error before
anything changes (tests/engine/test_call_orders.py):
- forward(): in IDLE and ACCUMULATING; in UPDATING it raises (the step's update is already running).
- backward(): from IDLE or ACCUMULATING to ACCUMULATING, or at the boundary to UPDATING. In UPDATING it raises
  (DeepSpeed would add a second boundary backward's gradients into the first's, whose update has begun); so does one
  off the boundary with gradient_accumulation_steps 1 (nothing to accumulate in).
- step() at the boundary: from UPDATING, the update, then IDLE. From ACCUMULATING (the boundary's own backward did
  not run: a skipped micro-batch, or `managed_gradient_accumulation: false`, where every step() is the boundary) the
  window is ended first, as a boundary backward with no gradients would end it, so the update takes the gradients
  accumulated so far, as DeepSpeed's does: never part of the model. From IDLE no parameter has a gradient, so none is
  updated (torch's AdamW skips them) and the step is counted.
- An exception in backward, or a failure of the CPU optimizer that surfaces in step() before the global norm is
  known: back to the state before that micro-step, as if it never ran (runtime.abort_backward). Any other exception
  in step() before the norm (a stall's TimeoutError, a Ctrl-C): the step stays pending, and step() again completes it.
- save_checkpoint, load_checkpoint, optimizer.state_dict() / load_state_dict(): in IDLE only (`require_idle`).
"""
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
