"""The rates a re-plan takes: the copies' bandwidths and the CPU AdamW's (and through it the host DRAM's) rate,
probed at construction; from the step just timed, the resident AdamW's, one block's GPU time in a pass and the share
of updates deferred past backward. A mixin of placement.Placement, whose timers and measurements it reads.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import psutil
import torch

from stronghold.planning import host_load, planner
from stronghold.planning.initial_plan import DEFAULT_RATES


class MeasuredRates:
    def measure_rates(self) -> None:
        """At construction, while the CPU has nothing else to do: after the first step it still runs that step's
        deferred updates, and a probe beside them measured half the rate (1.8-2.9 G params/s against 4.3 alone
        on an H200 host), while waiting for them first held up the placement by the whole of that work. The copy
        probe too: after the first step it waited for the step's queued GPU work and cost the placement 0.21 s."""
        runtime = self.runtime
        if self.pending and runtime.cpu is not None:
            from stronghold.engine.telemetry import copy_bandwidths, cpu_adam_probe
            # Each repeat by the kernel's clock and the wall's, the host's load and the CPUs this process kept busy
            # beside the median the plans take: between runs of one shape on one machine the probe has differed by
            # more than half, enough to move a schedule choice (docs/results.md). The kernel's clock leaves out the
            # wait for the GIL that a busy Python thread adds to the wall's; few CPUs busy says others took the
            # cores, and the host's other busy processes over the probe name them (host_load.py); all of them busy
            # at a low rate says the memory was the contended part.
            host_before = host_load.snapshot()
            cpu, start = time.process_time(), time.perf_counter()
            probe = cpu_adam_probe(runtime.cpu.kernel, numel=16 * 2 ** 20, dtype=runtime.compute_dtype)
            wall = time.perf_counter() - start
            busy = (time.process_time() - cpu) / max(1e-9, wall)
            self._cpu_rate = statistics.median(probe.params_per_s)
            self.measured["cpu_adam_probe"] = {
                "params_per_s": probe.params_per_s, "wall_params_per_s": probe.wall, "process_cpus_busy": busy,
                "process_threads": psutil.Process().num_threads(),
                "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                **host_load.between(host_before, host_load.snapshot(), wall)}
            if runtime.device.type == "cuda":
                self._copy_rates = copy_bandwidths(max(b.numel for b in self.spec.blocks))

    def _rates(self) -> planner.Rates:
        from stronghold.engine.telemetry import copy_bandwidths
        h2d, d2h = self._copy_rates or copy_bandwidths(max(b.numel for b in self.spec.blocks))
        rates = dict(h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                     cpu_adam_params_per_s=DEFAULT_RATES.cpu_adam_params_per_s)
        if self._cpu_rate is not None:
            rates["cpu_adam_params_per_s"] = self._cpu_rate
            # Host DRAM bandwidth as the AdamW kernel itself achieves it (ADAM_HOST_BYTES per parameter; bf16
            # and fp32 both move 28): the copies and the optimizer share it, which the CPU term alone misses.
            # A torch copy (27 GB/s) understated it 3x; the kernel's own rate needs no second probe. With it
            # GPT-2 5.14 B / 8.36 B under 32 GiB predict 1.00 / 1.71 s against 1.20 / 2.46 measured (from
            # -29% / -43%), Llama GA 8 unchanged at 2.32 vs 2.33 (H200).
            rates["host_memory_bytes_per_s"] = rates["cpu_adam_params_per_s"] * planner.ADAM_HOST_BYTES
        rates["gpu_adam_params_per_s"] = self._adam_rate()
        return self._with_block_time(rates, self._pass_seconds(), self._deferral.typical())

    def _pass_seconds(self) -> Optional[float]:
        """One block's GPU time in one pass of the step just timed: its forward, and its recompute and backward as
        measured between resident blocks (checkpointing), else as twice the forward calls' time (a block's backward
        costs about twice its forward; with checkpointing each block's forward runs twice a pass, calls 2)."""
        forward = self._timer.seconds()
        if forward is None:
            return None
        calls_per_pass = self._timer.calls / max(1, self._passes * len(self.spec.blocks))
        resident = self.runtime.resident_count
        backward = (self._timer.backward_seconds(below=resident, streamed=resident < len(self.spec.blocks))
                    if calls_per_pass > 1.5 else None)
        return forward + backward if backward is not None else forward * (calls_per_pass + 2)

    def _with_block_time(self, rates: dict, block_s: Optional[float], deferred_share: Optional[float]) -> planner.Rates:
        """`rates` with `deferred_share` (deferral.py) and `block_s` (a block's GPU time in one pass) added."""
        if deferred_share is not None:
            # Updates run after backward (deferred by clipping, lean blocks always, claimed, or redone): the next
            # forward waits for them, so they add a tail the overlapped terms miss (Llama GA 8: 0.2 s a step).
            rates["deferred_share"] = deferred_share
        if block_s is None:
            return planner.Rates(**rates, gpu_s_per_block=DEFAULT_RATES.gpu_s_per_block, gpu_s_fixed=0.0)
        per_block = block_s
        # Embeddings, head and loss: the head's matmuls scale with its parameters like a block's.
        head = self.spec.rest_numel / max(1, self.spec.blocks[0].numel)
        return planner.Rates(**rates, gpu_s_per_block=per_block, gpu_s_fixed=per_block * head)

    def _adam_rate(self) -> Optional[float]:
        """The resident AdamW's parameters a second in the step just timed (None: it updated nothing)."""
        timings = [(start, end, numel) for start, end, numel in self.runtime.resident.timings or () if numel]
        if not timings:
            return None
        torch.cuda.synchronize(self.runtime.device)
        return max(numel / (start.elapsed_time(end) / 1e3) for start, end, numel in timings)
