"""The placement's prediction as it runs (a mixin of placement.Placement, whose plan, timers and measurements it
reads): the plan of the placement as built, with the rates of the steps timed after the placement (`_refresh`, for
REFRESH_STEPS steps) and then the deferral share as it moves (`_follow_deferral`). A runtime on the blockwise backward
is predicted by that schedule's floor and planned beside its kept inputs' host slots (`_budget`, `_own_floor`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from stronghold.planning import plan_inputs, planner, schedule_choice
from stronghold.planning.block_timer import typical

logger = logging.getLogger("stronghold.planning.placement")

UNBOUNDED_BYTES = 2 ** 62
"""A budget no plan reaches: the placement as it runs, predicted where the byte counts say it does not fit."""
REFRESH_STEPS = 3
"""Steps timed again after the placement; the prediction takes `typical` of their block times and resident AdamW
rates. Disturbances only add time, and they are large: the step right after the promotion timed 7.8 ms a block of
GPT-2 1.72 B against about 6.1 later (H100), and at 4.94-8.36 B two of three steps timed 12-13 ms against 4.8 (the
CPU still busy with the deferred updates of the steps before). The fastest step alone read 12% under the next one at
2.52 B where nothing was disturbed, and the median of three picked a disturbed step at 4.94 B (+36%)."""


class PlacedPrediction:
    def _restart_timing(self) -> None:
        self._timer.reset()
        self._passes = 0
        self.runtime.resident.time_steps(True)

    def _refresh(self) -> None:
        """The plan's prediction with the typical block time and resident AdamW rate of the steps timed since the
        placement and the median deferral share of the steps since; the placement is unchanged."""
        self._timing_left -= 1
        # The copy and CPU AdamW rates of the first step's measurement stay; the GPU's times (`typical` of the steps
        # timed, REFRESH_STEPS) and the deferral share are new.
        kept = {k: v for k, v in self.measured["rates"].items()
                if k not in ("gpu_s_per_block", "gpu_s_fixed", "deferred_share", "gpu_adam_params_per_s")}
        block_s, adam_rate = self._pass_seconds(), self._adam_rate()
        if block_s is not None:
            self._block_s.append(block_s)
        if adam_rate is not None:
            self._adam_rates.append(adam_rate)
        kept["gpu_adam_params_per_s"] = (1 / typical([1 / rate for rate in self._adam_rates]) if self._adam_rates
                                         else self.measured["rates"].get("gpu_adam_params_per_s"))
        block_s = typical(self._block_s) if self._block_s else None
        rates = self._with_block_time(kept, block_s, self._deferral.typical())
        self.measured["block_s_after_placement"] = list(self._block_s)
        if self._timing_left:
            self._restart_timing()
        else:
            self._timer.detach()
            self.runtime.resident.time_steps(False)
        if self._predict(rates):
            if self.runtime.data_parallel is None or self.runtime.data_parallel.rank == 0:
                logger.info(f"predicted step after {len(self._block_s)} timed step(s) as placed: "
                            f"{self.plan.predicted_step_s:.4f} s")

    def _follow_deferral(self) -> None:
        """The prediction again when the median deferral share moved (deferral.py: clipping's share changes as
        training goes, and a benchmark's report covers the steps after its warm-up)."""
        share, last = self._deferral.typical(), self.measured.get("rates_refreshed")
        if share is None or last is None or share == last.get("deferred_share"):
            return
        self._predict(planner.Rates(**{**last, "deferred_share": share}))

    def _predict(self, rates: planner.Rates) -> bool:
        """The plan's prediction with `rates`, the placement unchanged (`_as_built`); False where none is made (the
        placement runs on; only its prediction stays)."""
        self.measured["rates_refreshed"] = dataclasses.asdict(rates)
        plan = self._as_built(self._activations, rates)
        if plan is None:
            return False
        self.plan = plan
        return True

    def _as_built(self, activations: planner.Activations, rates: planner.Rates) -> Optional[planner.Plan]:
        """The plan of the placement as it runs, with `rates`. Where the planner's byte counts say it does not fit
        (the measured peak counts the allocator's cached-but-free memory too, and that can fill the whole cap) the
        placement runs on all the same: its plan is then made without the budgets' bounds, so that its prediction
        is still the measured rates', and the budgets it reports are the real ones. None where even that finds none
        (the drive's space, the one bound left)."""
        runtime = self.runtime
        fixed = dict(resident_blocks=runtime.resident_count,
                     window_size=max(2, runtime.window_size) if runtime.stores else None,
                     activation_blocks=self.plan.activation_blocks, lean_until=runtime.lean_until,
                     nvme_from=runtime.nvme_from, gpu_accumulation=runtime.device_accum is not None,
                     rest_tiers=plan_inputs.built_tiers(self.spec, self.initial.cached_parts),
                     gradient_spares=runtime.gradient_spares, compact_master=runtime.compact_master,
                     pooled_grads=runtime.pooled_grads, blockwise=runtime.blockwise is not None)
        try:
            return self._own_floor(planner.plan(self.spec, activations, self._budget(), rates, **fixed), rates)
        except MemoryError:
            unbounded = dataclasses.replace(self.budget, gpu_bytes=UNBOUNDED_BYTES, host_bytes=UNBOUNDED_BYTES)
            try:
                plan = planner.plan(self.spec, activations, unbounded, rates, **fixed)
            except MemoryError:
                return None
            return self._own_floor(dataclasses.replace(plan, gpu_budget_bytes=self.budget.gpu_bytes,
                                                       host_budget_bytes=self.budget.host_bytes), rates)

    def _kept_bytes(self) -> int:
        """The blockwise backward's kept inputs a step in host slots (0: it does not run, or keeps them on the GPU, or
        no training forward has shown their size yet)."""
        blockwise = self.runtime.blockwise
        if blockwise is None or not self._block_input_bytes:
            return 0
        return schedule_choice.kept_bytes(self.spec, self._block_input_bytes, blockwise.kept.to_host)

    def _budget(self) -> planner.Budgets:
        """The budgets this runtime's plans get: the host's less the kept inputs' page-locked slots, which the
        planner's host stores leave out (schedule_choice.beside_kept_inputs)."""
        kept = self._kept_bytes()
        if not kept:  # no blockwise backward keeping inputs on the host, or no training forward has shown their size
            return self.budget
        rows = schedule_choice.window_rows_numel(self.spec, self._block_input_bytes)
        return schedule_choice.beside_kept_inputs(self.budget, kept, rows)

    def _own_floor(self, plan: planner.Plan, rates: planner.Rates) -> planner.Plan:
        """`plan` predicted by its own schedule's floor: the blockwise backward's where it runs (the planner's floor is
        host accumulation's), with the whole host budget (`_budget` took the kept inputs' slots off it)."""
        if self.runtime.blockwise is None or not self._block_input_bytes:
            return plan
        plan = dataclasses.replace(plan, host_budget_bytes=self.budget.host_bytes)
        return schedule_choice.with_blockwise_floor(plan, self.spec, rates, self._kept_bytes(),
                                                    self._block_input_bytes, self.runtime.runs_ahead)
