"""A micro-step's bounds: what backward starts from (noted so that an exception can return to it), what it leaves
at its end, and the return when it fails. A mixin of runtime.StrongholdRuntime, whose state it reads and moves (the
step state, the per-block micro-step states, the CPU optimizer, the window, the resident part).
"""
from __future__ import annotations

from typing import Optional

from stronghold.engine.step_state import StepState
from stronghold.streaming.schedule import Phase


class MicroSteps:
    def begin_backward(self, boundary: bool, loss_scale: float = 1.0) -> None:
        """A backward of a loss multiplied by `loss_scale` (fp16 loss scaling; 1.0 otherwise) begins."""
        if self.state is StepState.UPDATING:
            raise RuntimeError("stronghold: backward() was called twice without step() in between at a gradient-"
                               "accumulation boundary; call engine.step() after each engine.backward()")
        if not boundary and self.accumulation_steps == 1 and self.window is not None:
            raise ValueError("stronghold: backward() outside a gradient-accumulation boundary, but "
                             "gradient_accumulation_steps is 1, so the streamed blocks have no buffers to accumulate "
                             "in (set_gradient_accumulation_boundary(False), or \"managed_gradient_accumulation\": "
                             "false?); set gradient_accumulation_steps in ds.json to the micro-batches of a step")
        self._begin_micro_step(boundary, loss_scale)
        if boundary:
            self._read_ahead_states()
        if self.activations is not None:
            self.activations.begin(Phase.BACKWARD)
        # Blockwise, only the boundary's backward walks the blocks (blockwise.py).
        if self.window is not None and (boundary or self.blockwise is None):
            self.window.begin(Phase.BACKWARD, True)

    def _read_ahead_states(self) -> None:
        """The NVMe tier starts reading the states the boundary backward's updates want first: the last blocks'."""
        if self.nvme is not None:
            self.nvme.expect(sorted(self.stores.values(), key=lambda s: -s.index))

    def _begin_micro_step(self, boundary: bool, loss_scale: float) -> None:
        """What a micro-step starts from, noted so that `abort_backward` can return to it."""
        # The scale changes only in step(), so every micro-step of a window carries the same one.
        assert self.state is StepState.IDLE or loss_scale == self.loss_scale, (loss_scale, self.loss_scale)
        self._state_before_backward = self.state
        self._prepared = None
        self.boundary = boundary
        self.loss_scale = loss_scale
        if self.resident_reductions is not None:
            self.resident_reductions.begin(boundary)
        if self.cpu is None:
            return
        self.cpu.begin_micro_step(self.host_stores(), 1.0 / loss_scale)
        for index, state in self.micro.items():
            state.arrived, state.offloaded = 0, False
            state.accum_before = state.accum_started
            for entry in self._store(index).trainable:
                entry.grad_this_micro = False
                entry.window_before = entry.grad_this_window

    def end_backward(self) -> None:
        """Offload what backward left partial (unused parameters) and, at the boundary, blocks that got
        gradients only in earlier micro-steps."""
        if self.blockwise is not None:
            if self.boundary:
                self.blockwise.walk()
            else:
                self.blockwise.commit()
        if self.cpu is not None:
            for index, state in self.micro.items():
                store = self._store(index)
                if state.offloaded:
                    continue
                if state.arrived or (self.boundary and any(e.grad_this_window for e in store.trainable)):
                    self._offload(index)
            self.transfers.release_held()
        if not self.boundary:
            self.resident.end_micro_step()
            if self.device_accum is not None:
                self.device_accum.fold()
        elif self.resident_reductions is not None:
            self.resident_reductions.end_backward()  # step() waits for them
        if self.window is not None:
            self.window.end_walk()
        self.state = StepState.UPDATING if self.boundary else StepState.ACCUMULATING

    def abort_backward(self) -> None:
        """An exception escaped backward: discard this micro-step and leave everything as it was before
        it began (earlier micro-steps' accumulated gradients included), so the caller can go on."""
        self._prepared = None
        failure: Optional[BaseException] = None
        if self.blockwise is not None:
            self.blockwise.abort()
        if self.cpu is not None:
            self.transfers.wait_offloads()  # the copies of the buffers `abort` gives back have landed
            try:
                self.cpu.abort()
            except RuntimeError as err:
                failure = err
            for index, state in self.micro.items():
                state.arrived, state.offloaded = 0, False
                state.accum_started = state.accum_before
                for entry in self._store(index).trainable:
                    entry.param.grad = None
                    entry.grad_this_micro = False
                    entry.grad_this_window = entry.window_before
            if self.window is not None:
                self.window.reset()
            if self.device_accum is not None:
                self.device_accum.drop()
        if self.activations is not None:
            self.activations.begin(Phase.FORWARD)
        self.resident.drop_micro_step()
        if self.resident_reductions is not None:
            self.resident_reductions.drop()
        self.state = self._state_before_backward
        if failure is not None:
            raise failure
