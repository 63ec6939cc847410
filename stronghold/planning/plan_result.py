"""The planner's output (planner.py): a placement's bytes per device and part (`GpuBytes`, `HostParts`, `HostBytes`),
its step-time floor terms (`FloorTerms`) and the `Plan` that holds them. Units as in plan_types.py. Plain frozen
dataclasses: no torch, no device or psutil calls.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from stronghold.planning.plan_types import Drive, Tier


@dataclass(frozen=True, kw_only=True)
class GpuBytes:
    resident: int
    """Resident blocks: weight, gradient, fp32 master (bf16 mode) and moments."""
    rest: int
    """Embeddings, final norm, head: resident parts with the same accounting, cached parts their weights and
    gradients (streaming/cached.py)."""
    window: int
    """window_size slots of the largest streamed block's weights."""
    transients: int
    """One resident chunk's fp32 gradient during the GPU step (bf16 mode) and the streamed gradients
    waiting for their D2H (STREAMED_GRADS_IN_FLIGHT blocks)."""
    activations: int
    margin: int
    accumulators: int = 0
    """With gradient accumulation on the GPU (device_accum.py): per streamed trainable parameter its fp32
    accumulator and its gradient held until a non-boundary backward ends."""

    @property
    def peak(self) -> int:
        """Predicted peak allocation: every part at once (conservative: the logits peak and the
        resident gradients do not quite coincide)."""
        return self.resident + self.rest + self.window + self.transients + self.activations + self.accumulators

    @property
    def needed(self) -> int:
        return self.peak + self.margin


@dataclass(frozen=True)
class HostParts:
    """Host bytes of stores (streamed blocks, cached parts), by kind: plan_bytes.store_bytes computes them for both
    the planner and the allocator's check (engine/runtime.py), so the planned and the checked figures are one."""

    master_and_moments: int = 0
    """fp32 master (bf16 mode only; its low halves and the staging buffers with a compact master) + exp_avg +
    exp_avg_sq of the trainable parameters (the NVMe tier's staging buffers in place of those on the drive)."""
    working: int = 0
    """Compute-dtype copy of every parameter (the H2D source)."""
    grads: int = 0
    """Gradient buffers per trainable parameter (the D2H destination; two with host accumulation and spares)."""
    accumulators: int = 0
    """fp32 sum over the micro-steps, with host accumulation."""

    @property
    def total(self) -> int:
        return self.master_and_moments + self.working + self.grads + self.accumulators

    def __add__(self, other: "HostParts") -> "HostParts":
        return HostParts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True, kw_only=True)
class HostBytes(HostParts):
    """A placement's host bytes for the node (the stores' parts above) and the margin kept free."""

    margin: int
    local_ranks: int = 1
    """The node's data-parallel ranks: the parts are the node's bytes (states sharded, working shared)."""

    @property
    def per_rank_private(self) -> int:
        """What one rank holds besides the shared working copy: its shard of the states and gradient buffers."""
        return -(-(self.master_and_moments + self.grads + self.accumulators) // self.local_ranks)

    @property
    def needed(self) -> int:
        return self.total + self.margin


@dataclass(frozen=True, kw_only=True)
class FloorTerms:
    """Seconds per optimizer step; each term alone is a lower bound on the step."""

    gpu_s: float
    h2d_s: float
    d2h_s: float
    cpu_adam_s: float
    """AdamW of the streamed trainable parameters, plus the accumulation passes when accumulating."""
    cpu_tail_s: float
    """Not overlapped: the last streamed block's D2H + CPU update + H2D that the resident blocks'
    backward and next forward do not cover (see _floor)."""
    host_memory_s: float = 0.0
    """Every byte the step moves through host DRAM (H2D and D2H sources/destinations, the CPU
    AdamW's ~28 bytes per parameter and ~10 per accumulation pass) over its bandwidth."""
    activation_h2d_s: float = 0.0
    """Offloaded activations coming back in backward. They share the H2D link with the weights, so
    the copy floor is h2d_s + activation_h2d_s (likewise D2H)."""
    activation_d2h_s: float = 0.0
    walk_s: float = 0.0
    """GPU compute with each walk's weight copies (plan_floor.walk): a forward or backward walk over the
    streamed blocks takes as long as its compute or its copies, whichever is longer (>= gpu_s)."""
    nvme_s: float = 0.0
    """The NVMe blocks' states read once and written once a step at the drive's measured rates (one drive: the
    two directions add)."""

    @property
    def step_s(self) -> float:
        return max(self.gpu_s, self.walk_s, self.h2d_s + self.activation_h2d_s, self.d2h_s + self.activation_d2h_s,
                   self.cpu_adam_s, self.host_memory_s, self.nvme_s) + self.cpu_tail_s


@dataclass(frozen=True, kw_only=True)
class Plan:
    resident_blocks: int
    window_size: int
    """Slots on the GPU; 0 when nothing is streamed."""
    window_wanted: int
    """What the window rule asked for; more than window_size when GPU memory cut it."""
    tiers: tuple[Tier, ...]
    gpu: GpuBytes
    host: HostBytes
    floor: FloorTerms
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    gpu_budget_bytes: int
    host_budget_bytes: int
    activation_blocks: int = 0
    """Leading blocks whose activations go to the host (activations.py)."""
    activation_bytes_per_step: int = 0
    """Activation bytes copied each way per optimizer step."""
    lean_blocks: int = 0
    """Leading streamed blocks in the lean tier (Tier.LEAN): the fewest that make host memory fit."""
    gpu_accumulation: bool = False
    """The streamed blocks' gradients are accumulated on the GPU and sent down once per step (device_accum.py)."""
    blockwise_backward: bool = False
    """The blockwise backward (engine/blockwise.py): the streamed blocks' and the cached input part's host gradient
    buffers hold one fp32 sum a step, with no accumulator and no spare."""
    pooled_grads: bool = False
    """With host accumulation, the streamed blocks share GRAD_POOL_BUFFERS landing buffers (streaming/grad_pool.py)
    instead of one each, where the plan fits host memory only so."""
    compact_master: bool = False
    """The streamed blocks in host memory keep their fp32 master as the low halves beside the bf16 working copy
    (streaming/compact.py): 2 host bytes a trainable parameter less, where the plan fits host memory only so."""
    gradient_spares: bool = False
    """With host accumulation, each streamed block and cached part has a second gradient buffer (store.py
    `grad_spare`); False where the plan fits host memory only without them, or where there is no host accumulation
    (where the blocks accumulate on the GPU, the cached parts, which always accumulate on the host, keep theirs)."""
    host_process_bytes: int = 0
    """Budgets.host_process_bytes: what the process held besides the plan's buffers when it was made."""
    rest_tiers: tuple[tuple[str, Tier], ...] = ()
    """Each part outside the blocks (ModelSpec.rest_parts) with its tier: RESIDENT or CACHED."""
    nvme_blocks: int = 0
    """Last streamed blocks whose fp32 master and moments live on the NVMe drive (streaming/nvme.py): the fewest
    that make host memory fit."""
    nvme_bytes_per_step: int = 0
    """Bytes read from plus written to the drive per optimizer step (each NVMe block's state once each way)."""
    drive: Optional[Drive] = None
    """Budgets.drive, for the table."""

    @property
    def cached_parts(self) -> frozenset[str]:
        """The parts outside the blocks in the cached tier."""
        return frozenset(name for name, tier in self.rest_tiers if tier is Tier.CACHED)

    @property
    def predicted_step_s(self) -> float:
        return self.floor.step_s

    @property
    def host_rss_bytes(self) -> int:
        """Predicted peak RSS of this process: what it held at planning plus the planned host buffers it maps (with
        data parallel: its shard of the states and gradient buffers, and the node's shared working copy)."""
        return self.host_process_bytes + self.host.per_rank_private + self.host.working

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tiers"] = [tier.value for tier in self.tiers]
        out["rest_tiers"] = {name: tier.value for name, tier in self.rest_tiers}
        out["gpu"].update(peak=self.gpu.peak, needed=self.gpu.needed)
        out["host"].update(total=self.host.total, needed=self.host.needed, rss=self.host_rss_bytes)
        out["predicted_step_s"] = self.predicted_step_s
        return out
