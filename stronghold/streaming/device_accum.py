"""Gradient accumulation of the streamed blocks on the GPU (`"gpu_accumulation"`, planner `gpu_accumulation`).

Without it, every micro-step's streamed gradients go down to the host and the CPU adds them into an fp32
accumulator: with accumulation 8 on the Llama 2.7 B shape that is ~10 host-DRAM bytes per streamed parameter
per micro-step (bf16 read, fp32 read and write), 8 times a step, besides the D2H itself, and the step can become
bound by host memory bandwidth (~180 GB of DRAM traffic per step; 0.80-0.87x plain DeepSpeed on the slower
hosts). With it, each streamed block keeps an fp32 accumulator on the GPU (4 bytes per trainable parameter) and
its gradients leave the GPU once per optimizer step, as that sum:

- a micro-step that is not the boundary keeps the block's gradients in `.grad` until backward ends, then
  adds them into the accumulator (`fold`), as gpu_optim.ResidentOptimizer does for the resident blocks. A
  backward that fails before its end therefore leaves every accumulator as it was: dropping `.grad` is the
  whole rollback, exact (the host path subtracts the failed micro-step back out in fp32).
- the boundary micro-step adds each block's gradients to a copy of its accumulator (`window_sum`) as the
  block's backward finishes; that copy goes down to the host in one D2H (fp32) and the CPU AdamW reads it
  as the gradient, as it would read its own accumulator. The accumulator itself is not written, so a
  boundary backward that fails leaves it intact too.

The sums are the host path's, operation for operation: the window's first gradient converted to fp32, then
one fp32 addition per later micro-step, in micro-step order, so the applied gradient is bit-identical.

GPU bytes per streamed trainable parameter: 4 (the accumulator) plus the compute dtype's size for the
gradients held until a non-boundary backward ends; the planner counts both (plan_bytes.gpu_bytes).

The construction-time plan reserves half the GPU for the first step's activations, where the accumulators
rarely fit; `switch_to_gpu` turns it on after the first step when the measured plan says so.
"""
from __future__ import annotations

from typing import Optional

import torch

from stronghold.streaming.store import BlockStore, ParamEntry


@torch.no_grad()
def add_grads(total: torch.Tensor, present: list[ParamEntry]) -> None:
    """Add the `present` entries' gradients into `total` (flat fp32, the store's trainable layout) and drop them."""
    for entry in present:
        entry.host_view(total).add_(entry.param.grad)
        entry.param.grad = None


def sum_of_squares(total: torch.Tensor) -> torch.Tensor:
    """A window sum's sum of squares, a 0-d fp32 tensor on its device. A norm, not total.square().sum(): that would
    hold a second block-sized fp32 tensor."""
    return torch.linalg.vector_norm(total).square()


class DeviceAccumulators:
    def __init__(self, stores: dict[int, BlockStore], device: torch.device):
        self.device = device
        self.accum: dict[int, torch.Tensor] = {
            index: torch.empty(store.trainable_numel, dtype=torch.float32, device=device)
            for index, store in stores.items()}
        """Per streamed block, fp32, its trainable elements in the store's layout: the sum of the window's
        earlier micro-steps, valid once the block's window has begun (the runtime's `accum_started`)."""
        self._held: list[tuple[int, list[ParamEntry], bool]] = []
        """Blocks whose gradients of the current (non-boundary) micro-step wait in `.grad` for `fold`, and
        whether their window had begun before this micro-step."""

    def hold(self, index: int, present: list[ParamEntry], started: bool) -> None:
        """A non-boundary micro-step's gradients of block `index` are complete: keep them for `fold`."""
        if present:
            self._held.append((index, present, started))

    @torch.no_grad()
    def fold(self) -> None:
        """After a non-boundary backward: add the held gradients into the accumulators, drop `.grad`."""
        for index, present, started in self._held:
            acc = self.accum[index]
            if not started:
                # The window's first gradients of this block: parameters without one yet start from zero.
                acc.zero_()
            add_grads(acc, present)
        self._held.clear()

    def drop(self) -> None:
        """A backward failed: forget its held gradients (the caller clears `.grad`); accumulators unchanged."""
        self._held.clear()

    @torch.no_grad()
    def window_sum(self, index: int, present: list[ParamEntry],
                   started: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """At the boundary: the block's whole-window gradient (fp32, flat, a fresh tensor) and its sum of
        squares (a 0-d fp32 tensor on the device), with this micro-step's `present` gradients added to the
        earlier micro-steps' sum (`started`: there is one); None when the block got no gradient in the
        window. The accumulator is left as it was."""
        if not started and not present:
            return None
        if started:
            total = self.accum[index].clone()
            for entry in present:
                entry.host_view(total).add_(entry.param.grad)
        else:
            total = torch.zeros_like(self.accum[index])
            for entry in present:
                entry.host_view(total).copy_(entry.param.grad)
        for entry in present:
            entry.param.grad = None
        return total, sum_of_squares(total)

    def pop(self, index: int) -> None:
        """Block `index` became resident (promotion.py): its accumulator is freed."""
        del self.accum[index]

    @property
    def nbytes(self) -> int:
        return sum(acc.numel() * acc.element_size() for acc in self.accum.values())


def switch_to_gpu(runtime) -> Optional[DeviceAccumulators]:
    """Move a runtime built with host accumulation to accumulation on the GPU, between steps (placement.py,
    after the first step, when the measured plan is faster that way). Each store's pinned fp32 host
    accumulator becomes its gradient buffer (where the window sums land) and its compute-dtype gradient
    buffers are freed: the host layout of a store built for the GPU way. Returns the accumulators, which the runtime
    keeps (`Relayout.accumulate_on_gpu`)."""
    if runtime.mid_step:
        raise RuntimeError("stronghold: gradient accumulation can only move to the GPU between optimizer steps")
    if runtime.device_accum is not None or not runtime.stores:
        return runtime.device_accum
    runtime.synchronize()  # no CPU job still reads a gradient buffer or accumulator
    for store in runtime.stores.values():
        assert store.accum is not None and not store.lean and not store.sharded
        store.grad, store.accum, store.grad_spare = store.accum, None, None
    return DeviceAccumulators(runtime.stores, runtime.device)
