"""Automatic placement: when the engine plans (planner.py, with the inputs plan_inputs.py takes from the live model
and machine) and what it measures for the plans after the first.

`"resident_blocks": "auto"` / `"window_size": "auto"` (the defaults) are settled in steps, because
activation memory depends on the batch, and the engine first sees a batch in its first step:
1. Construction (initial_plan.py): the GPU budget less a reserve for activations decides how many blocks
   start resident. The CPU AdamW's rate is measured then too, while the CPU has nothing else to do.
2. The first training forward (`Placement.first_forward`), before anything of it runs: where the model
   checkpoints its blocks, an upper estimate of the activations from the batch's shape
   (activation_estimate.py) replaces the reserve, and blocks are promoted before the first step needs them.
3. After the first optimizer step (`Placement.after_step`): the peak measured over that step's
   forward and backward passes replaces the reserve, the copy and CPU AdamW rates and one block's
   compute time are measured, and the runtime promotes streamed blocks to resident
   (`StrongholdRuntime.promote`) up to the new plan. The measured peak only grows the plan: a
   first step that ran within the reserve never asks for fewer resident blocks. Under `"blockwise_backward": "auto"`
   the plan is also made for the blockwise backward and the two weighed (schedule_choice.py); the runtime moves to it
   (`Relayout.backward_block_by_block`) where it wins.
Numbers given in the config are honoured: they are checked against the budgets at construction
(MemoryError with the parts and the knob to change) and never changed.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import psutil
import torch

from stronghold.planning import activation_estimate, plan_inputs, plan_text, planner, schedule_choice
from stronghold.planning.batch_room import BatchRoom
from stronghold.planning.initial_plan import DEFAULT_RATES, FIRST_WINDOW, agree, first_forward_target
from stronghold.planning.block_timer import BlockTimer
from stronghold.planning.measured_rates import MeasuredRates
from stronghold.planning.prediction import REFRESH_STEPS, PlacedPrediction
from stronghold.planning.promotion import PartClock
from stronghold.config import Settings
from stronghold.optim.deferral import DeferralShares
from stronghold.engine.layout_rules import blockwise_possible
from stronghold.engine.step_state import StepState
from stronghold.memory.allocator_view import reserved_by_stream
from stronghold.memory.long_context import batch_tokens

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class PlannedStart:
    """What the start-up plan on a GPU hands the placement: the model's sizes, the budgets and the plan itself."""

    spec: planner.ModelSpec
    budget: planner.Budgets
    plan: planner.Plan


class Placement(MeasuredRates, PlacedPrediction):
    """Owns the plan of one runtime: measures the first step and promotes blocks after it."""

    def __init__(self, runtime, spec: planner.ModelSpec, budget: planner.Budgets, settings: Settings,
                 plan: planner.Plan):
        """`settings`: resolved for a GPU (config.resolve), where None is what the placement decides."""
        self.runtime, self.spec, self.budget, self.settings = runtime, spec, budget, settings
        self.plan = plan
        self.initial = plan
        self.measured: dict = {}
        self.pending = settings.resident_blocks is None or settings.window_size is None
        self._started = False
        self._timer = BlockTimer()
        self._passes = 0
        self._allocated_at_start = 0
        self._reserved_at_start = 0
        """The allocator's reservation when the first step began: what the reserved peak's rise is measured from."""
        self._deferral = DeferralShares()
        self._placed = False
        """The plan after the first step is in force; its prediction follows the deferral share from then on."""
        self._timing_left = 0
        """Steps after the placement still to be timed; the prediction is refreshed after each (`_refresh`)."""
        self._block_s: list[float] = []
        """A block's GPU time in one pass (`_pass_seconds`) in each step timed after the placement."""
        self._adam_rates: list[float] = []
        """The resident AdamW's parameters a second in each step timed after the placement."""
        self._activations: Optional[planner.Activations] = None
        self._first_forward_seen = False
        self._cpu_rate: Optional[float] = None
        """The CPU AdamW's parameters a second (`measure_rates`)."""
        self._copy_rates: Optional[tuple[float, float]] = None
        """H2D and D2H bytes a second (`measure_rates`)."""
        self.room = BatchRoom(spec)
        self._block_input_bytes: Optional[int] = None
        """One block's input in the longest training forward so far (the blockwise backward's kept inputs)."""

    def first_forward(self, inputs: tuple, kwargs: dict, training: bool) -> None:
        """At the first training forward, before anything of it runs (no gradient or CPU update exists yet, so
        promotion moves only the blocks' states): plan with the batch's activation estimate in place of the
        construction-time reserve, and promote up to that plan. The ranks of a data-parallel job each plan from
        their own batch and GPU, then all take the fewest resident blocks (`first_forward_target`): promoting here
        rather than after the first step keeps that step from writing the moments of blocks it then promotes, a
        transient on every rank's host memory at once."""
        runtime = self.runtime
        if training:  # for the blockwise backward's choice (schedule_choice.py): the longest micro-batch's
            one = activation_estimate.block_input_bytes(runtime.model, batch_tokens(inputs, kwargs),
                                                        self.spec.compute_bytes)
            if one is not None and one > (self._block_input_bytes or 0):
                self._block_input_bytes = one
        if self._first_forward_seen or not (self.pending and training) or self.settings.resident_blocks is not None:
            return
        self._first_forward_seen = True
        if runtime.activations is not None or not runtime.stores:
            return  # offloaded activations (long context) are planned from the measured step alone
        planning = time.perf_counter()
        estimate = activation_estimate.checkpointed_decoder_activations(
            runtime.model, batch_tokens(inputs, kwargs), self.spec.compute_bytes)
        if estimate is not None and runtime.blockwise is not None:
            estimate = activation_estimate.blockwise(estimate, self.spec, self.initial.cached_parts,
                                                     runtime.blockwise.kept.to_host, runtime.runs_ahead)
        plan = None if estimate is None else self._first_plan(estimate)
        resident, window = first_forward_target(plan, runtime.resident_count, runtime.window_size,
                                                runtime.data_parallel is not None)
        first_on_drive = len(self.spec.blocks) - plan.nvme_blocks if plan is not None else runtime.nvme_from
        if resident <= runtime.resident_count and first_on_drive <= runtime.nvme_from:
            return
        started = time.perf_counter()
        # The copies on a thread: this forward's compile runs meanwhile, and each block's forward waits for its own.
        parts = runtime.promote(resident, window, background=True) if resident > runtime.resident_count else {}
        runtime.states_to_host(first_on_drive)
        if runtime.data_parallel is None or (resident, window) == (plan.resident_blocks, max(2, plan.window_size)):
            self.plan = plan  # with data parallel another rank's fewer blocks may have won: then it is not this one
        self.measured["first_forward"] = dict(
            activations_estimate_bytes=estimate.fixed_peak_bytes + estimate.per_block_bytes * len(self.spec.blocks),
            resident_blocks=runtime.resident_count, window_size=runtime.window_size, nvme_blocks=plan.nvme_blocks,
            plan_s=started - planning, promote_s=time.perf_counter() - started, promote_parts_s=parts)
        if runtime.data_parallel is None or runtime.data_parallel.rank == 0:
            logger.info(f"placement at the first forward (activations estimated from the batch: "
                        f"{self.measured['first_forward']['activations_estimate_bytes'] / planner.GIB:.2f} GiB): "
                        f"resident_blocks {runtime.resident_count}, window_size {runtime.window_size}")

    def make_room(self, inputs: tuple, kwargs: dict, training: bool) -> None:
        """Before a training forward, after `first_forward`: a micro-batch longer than any planned for takes its
        activations' room from the window (batch_room.py), where the window is the placement's to size."""
        if training and self.settings.window_size is None:
            measured = self.measured.get("activations_bytes")
            # The allocator's gap at the peak is in the measured activations and stays as the batches grow.
            self.room.before_forward(self.runtime, batch_tokens(inputs, kwargs), self.plan,
                                     None if measured is None else measured - self.measured["allocator_gap_bytes"])

    def _first_plan(self, estimate: planner.Activations) -> Optional[planner.Plan]:
        """The plan with the batch's activation estimate, or None where it leaves less room than the reserve did
        (the construction-time placement stays). With gradient accumulation and the window left to stronghold, no
        more resident blocks than `_fewest_reloads` allows: blocks only ever move onto the GPU, so a promotion here
        decides for every step after the first, and with accumulation a streamed block outside the window is copied
        in every micro-step while one inside it is copied once a step."""
        runtime = self.runtime
        window = FIRST_WINDOW if self.settings.window_size is None else self.settings.window_size

        def at(resident: Optional[int], slots: int, activations: planner.Activations = estimate) -> planner.Plan:
            return self._own_floor(self._plan_at(activations, resident, slots, self._budget()), DEFAULT_RATES)
        try:
            plan = at(None, window)
        except MemoryError:
            self._warn_kept_slots(estimate)
            return None
        if self.spec.accumulation_steps == 1 or self.settings.window_size is not None:
            return plan
        cap = self._fewest_reloads(runtime.resident_count, plan.resident_blocks)
        if cap is None or cap >= plan.resident_blocks:
            return plan
        try:
            return at(cap, window)
        except MemoryError:  # the host does not hold the fewer resident blocks beside the batch's estimate
            return plan

    def _fewest_reloads(self, built: int, most: int) -> Optional[int]:
        """Of the residencies from `built` to `most`, the one whose largest window leaves the fewest streamed blocks
        outside it, counting no activations (the first step measures them), ties to more resident blocks; None
        where none fits. Every resident block takes the GPU room of more than one slot (its gradients and, with
        accumulation, their fp32 accumulators), so the fewest usually sit at the least residency: where a window of
        every streamed block fits, the most resident blocks it fits beside (that layout moves the weights once a
        step, not twice a micro-step); where none does, as for the Llama-3-8B shape under 24 GiB, still the
        residency that reloads the fewest blocks a micro-step (there 0 resident and 21 slots, where the most that
        fit beside the first window were 1 and 11 slots: examples.bench.replay_plan)."""
        none, budget = planner.Activations(fixed_peak_bytes=0, per_block_bytes=0), self._budget()
        blocks, best = len(self.spec.blocks), None
        for resident in range(built, most + 1):
            try:
                window = self._plan_at(none, resident, None, budget).window_size
            except MemoryError:
                continue
            reloads = max(0, blocks - resident - window)
            if best is None or reloads <= best[0]:
                best = (reloads, resident)
        return None if best is None else best[1]

    def _plan_at(self, activations: planner.Activations, resident: Optional[int], slots: Optional[int],
                 budget: planner.Budgets) -> planner.Plan:
        """The planner's plan for the runtime as built, the residency `resident` and `slots` (None: the planner's
        choice)."""
        runtime = self.runtime
        return planner.plan(self.spec, activations, budget, DEFAULT_RATES, resident_blocks=resident,
                            window_size=slots, lean_until=runtime.lean_until, nvme_from=runtime.nvme_from,
                            nvme_shrink=self.settings.nvme_blocks is None,
                            gpu_accumulation=runtime.device_accum is not None,
                            rest_tiers=plan_inputs.built_tiers(self.spec, self.initial.cached_parts),
                            gradient_spares=runtime.gradient_spares, compact_master=runtime.compact_master,
                            pooled_grads=runtime.pooled_grads, blockwise=runtime.blockwise is not None)

    def _warn_kept_slots(self, estimate: planner.Activations) -> None:
        """Where the runtime as built fits the host only without the blockwise backward's kept inputs' slots (the
        setting forced on, the size of a batch unknown before its first forward): say so before the slots are made,
        as host memory that runs out later takes the process with it."""
        kept, runtime = self._kept_bytes(), self.runtime
        if not kept:
            return
        try:
            self._plan_at(estimate, runtime.resident_count, max(2, runtime.window_size), self.budget)
        except MemoryError:
            return  # it does not fit without them either: the slots are not what is short
        logger.warning(f"stronghold: the blockwise backward keeps {kept / planner.GIB:.2f} GiB of block inputs a step "
                       f"in page-locked host memory, which the placement as built leaves no room for in the host budget "
                       f"of {self.budget.host_bytes / planner.GIB:.2f} GiB: the host may run out. Set "
                       "\"blockwise_backward\" to \"auto\" (it is then taken only where it fits) or false, or train "
                       "with a smaller micro-batch or sequence")

    def before_forward(self, training: bool) -> None:
        if not self.pending or not training or self._started:
            return
        self._started = True
        device = self.runtime.device
        torch.cuda.synchronize(device)
        # Segments the set-up and a promotion freed stay reserved until given back: the re-plan counts reserved
        # memory beyond the allocated peak as the step's own fragmentation, which these are not.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        self._allocated_at_start = torch.cuda.memory_allocated(device)
        self._reserved_at_start = torch.cuda.memory_reserved(device)
        self._deferral.mark(self.runtime.cpu)
        self._timer.attach(self.runtime.blocks)
        self.runtime.resident.time_steps(True)

    def after_backward(self) -> None:
        """Counts the first step's passes; at its boundary, reads the peak of its forward and
        backward passes (before the optimizer step, whose lazily created AdamW moments the planner
        counts as placement memory, not as activations)."""
        if self._timing_left:
            self._passes += 1
            return
        if not (self._started and self.pending):
            return
        self._passes += 1
        if self.runtime.state is StepState.UPDATING and "peak_allocated_bytes" not in self.measured:
            device = self.runtime.device
            torch.cuda.synchronize(device)
            # Of the reserved memory beyond the allocated peak, the split segments' free parts are what the
            # allocator cannot give back under pressure (whole free segments it can): the report keeps their peak.
            split = torch.cuda.memory_stats(device).get("inactive_split_bytes.all.peak")
            transfers = self.runtime.transfers
            streams = {torch.cuda.current_stream(device).cuda_stream: "compute",
                       transfers.h2d_stream.cuda_stream: "h2d", transfers.d2h_stream.cuda_stream: "d2h"}
            self.measured["reserved_by_stream"] = reserved_by_stream(torch.cuda.memory_snapshot(), streams)
            self.measured.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                                 peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                                 peak_inactive_split_bytes=split,
                                 allocated_at_start_bytes=self._allocated_at_start,
                                 reserved_at_start_bytes=self._reserved_at_start)

    def after_step(self) -> None:
        """After the first optimizer step: measure, re-plan, promote (once). After each of the REFRESH_STEPS
        steps after it: refresh the prediction from the timings; after every later one: from the deferral share."""
        if self.runtime.mid_step:
            return  # not the end of an optimizer step (a micro-step of accumulation)
        if self._placed:
            self._deferral.end_step(self.runtime.cpu, len(self.runtime.stores) + len(self.initial.cached_parts))
            self.measured["deferred_share_per_step"] = list(self._deferral.shares)
            if self._timing_left:
                self._refresh()
            else:
                self._follow_deferral()
            return
        if not (self._started and self.pending and "peak_allocated_bytes" in self.measured):
            return
        clock = PartClock()
        self.pending = False
        self._deferral.end_step(self.runtime.cpu, len(self.runtime.stores) + len(self.initial.cached_parts))
        # The first plan's host buffers as built, before promotion frees any: what its host prediction
        # (Plan.host_rss_bytes) is about. The process's peak RSS can predate the engine (the model's own build).
        self.runtime.releaser.drain()  # the host buffers the first forward's promotion left behind are gone
        self.measured["host_rss_bytes_first_step"] = psutil.Process().memory_info().rss
        clock.mark("drain_s")
        self.plan = self._replan()
        clock.mark("replan_s")
        runtime = self.runtime
        resident, window = agree(self.plan.resident_blocks, self.plan.window_size)
        if self.plan.blockwise_backward and runtime.blockwise is None:
            # The switch waits for the first step's CPU work (the gradient buffers change hands): timed apart from
            # the switch itself, so the report says which of the two a long first step spent its seconds on.
            runtime.synchronize()
            clock.mark("cpu_wait_s")
            runtime.backward_block_by_block()
            clock.mark("blockwise_s")
        if (resident, window) != (runtime.resident_count, runtime.window_size):
            # The copies on a thread, beside the trainer's work between steps; the next forward waits block by block.
            self.measured["placement_promote_parts_s"] = runtime.promote(resident, window, background=True)
            clock.mark("promote_s")
        runtime.states_to_host(len(self.spec.blocks) - self.plan.nvme_blocks)
        if self.plan.gpu_accumulation and runtime.device_accum is None and runtime.blockwise is None:
            runtime.accumulate_on_gpu()
        clock.mark("relayout_s")
        # Part of the first step's time that the steps after it do not have: the report says how much.
        self.measured.update(placement_s=sum(clock.parts.values()), placement_parts_s=clock.parts)
        if runtime.data_parallel is None or runtime.data_parallel.rank == 0:  # the ranks agreed on one plan
            logger.info(f"placement after the first step (measured activations "
                        f"{self.measured['activations_bytes'] / planner.GIB:.2f} GiB):\n{plan_text.table(self.plan)}")
        # The first step streamed more blocks than the steps after it, and its CPU work shared the host with the
        # launches: its block time came out 7.0-9.4 ms for one Llama block on one machine, and the step predictions
        # carried that error. The steps after it, as placed, time the blocks again.
        self._timing_left = REFRESH_STEPS
        self._restart_timing()
        # The first step streamed more blocks and had no forecast of the norm: its share is not the placed steps'.
        self._deferral = DeferralShares()
        self._deferral.mark(runtime.cpu)
        self._placed = True

    def _replan(self) -> planner.Plan:
        runtime = self.runtime
        peak, reserved = self.measured["peak_allocated_bytes"], self.measured["peak_reserved_bytes"]
        # What the step added beyond the placement's own memory: activations, the resident and rest
        # gradients (and fp32 accumulators with accumulation), streamed gradients in flight. The
        # planner counts the gradients and accumulators itself, so they come off; the streamed ones
        # in flight stay in (counted twice: a small, safe overestimate). Allocator fragmentation seen
        # in this step (reserved beyond allocated at the peak) is added, as it will recur.
        resident_trainable = sum(p.numel() for p in runtime.resident.params if p.requires_grad)
        # The cached parts' gradients live on the GPU until their D2H as the resident ones do (planner: `rest`).
        resident_trainable_or_cached = resident_trainable + sum(
            p.trainable_numel for p in self.spec.rest_parts if p.name in self.initial.cached_parts)
        grads = resident_trainable_or_cached * self.spec.compute_bytes
        if self.spec.accumulation_steps > 1:
            grads += resident_trainable * planner.FP32_BYTES
        if runtime.device_accum is not None:
            # The streamed gradients held until a non-boundary backward ends: the planner counts them with
            # the streamed accumulators (which were allocated before the step, so are not in the peak's rise).
            grads += sum(s.trainable_numel for s in runtime.stores.values()) * self.spec.compute_bytes
        gap = max(0, reserved - peak)
        activations = max(0, peak - self._allocated_at_start - grads) + gap
        rates = self._rates()
        self.measured.update(activations_bytes=activations, allocator_gap_bytes=gap, rates=dataclasses.asdict(rates))
        resident, window = self.settings.resident_blocks, self.settings.window_size
        measured = planner.Activations(fixed_peak_bytes=activations, per_block_bytes=0, allocator_gap_bytes=gap)
        offload = 0
        if runtime.activations is not None and runtime.activations.block_input_bytes:
            measured, offload = activation_estimate.split_measured(activations, runtime.activations,
                                                                    len(self.spec.blocks), gap)
            self.measured.update(activation_block_input_bytes=measured.per_block_bytes)
        self._activations = measured
        # The lean stores were built at construction: blocks below lean_until stay lean while streamed.
        # Host accumulation can still move to the GPU (device_accum.switch_to_gpu), not back.
        accumulation = True if runtime.device_accum is not None else (
            None if self.settings.gpu_accumulation is None and runtime.data_parallel is None
            and runtime.blockwise is None else False)
        fixed = dict(window_size=window, activation_blocks=offload, lean_until=runtime.lean_until,
                     nvme_from=runtime.nvme_from, nvme_shrink=self.settings.nvme_blocks is None,
                     gpu_accumulation=accumulation, gradient_spares=runtime.gradient_spares,
                     compact_master=runtime.compact_master, pooled_grads=runtime.pooled_grads,
                     blockwise=runtime.blockwise is not None,
                     rest_tiers=plan_inputs.built_tiers(self.spec, self.initial.cached_parts))
        fitting = None
        try:
            new = planner.plan(self.spec, measured, self._budget(), rates, resident_blocks=resident, **fixed)
            if new.resident_blocks < runtime.resident_count:
                # Only promotion exists (demoting would need host buffers that were never made); the
                # first step ran at this residency, so keep it and let the window rule choose within it.
                fitting = new.resident_blocks
                new = planner.plan(self.spec, measured, self._budget(), rates,
                                   resident_blocks=runtime.resident_count, **fixed)
        except MemoryError:
            # The measured peak says no plan fits, yet the first step ran as placed: keep it, predicted anew, and
            # say what fits (a run that then runs out of GPU memory has its fix in the log).
            kept = self._as_built(measured, rates) or self.plan
            self.measured["over_budget"] = {"resident_blocks": runtime.resident_count,
                                            "resident_blocks_fitting": fitting}
            logger.warning(plan_text.over_budget(runtime.resident_count, fitting, kept, resident is not None))
            return kept
        if runtime.activations is not None:
            runtime.activations.set_chosen(new.activation_blocks)
        if (self.settings.blockwise_backward is None and self._block_input_bytes
                and blockwise_possible(self.settings, runtime, self.spec.accumulation_steps)):
            new, self._activations, weighed = schedule_choice.weigh(
                self.spec, self.budget, rates, new, measured, self._block_input_bytes,
                self.settings.pin_memory and runtime.device.type == "cuda", fixed, resident, runtime.resident_count,
                runtime.runs_ahead)
            self.measured["schedules"] = dataclasses.asdict(weighed)
        return self._own_floor(new, rates)

    @property
    def timing(self) -> bool:
        """The blocks' calls are being timed (their hooks attached)."""
        return bool(self._timer.handles)

    def report(self) -> dict:
        # A copy of `measured`: the caller adds to it (telemetry adds the peaks so far), and an alias let a
        # report taken during the first step fill `measured` before after_backward could, so after_step
        # re-planned from a dict without the first step's peak (KeyError in the main job on a GPU).
        return {"plan": self.plan.as_dict(), "initial_plan": self.initial.as_dict(), "measured": dict(self.measured),
                "longer_batches": list(self.room.shrunk),
                "auto": {"resident_blocks": self.settings.resident_blocks is None,
                         "window_size": self.settings.window_size is None}}

