"""What each timed step spent where, step by step: the step-to-step spread is as large as the differences the A/Bs
look for (one step in four 0.4 s slower at every stronghold point of one Llama sweep), so the record keeps per step the
collector's pauses (Python's gc, generation by generation) and, for stronghold, the engine's own waits and CPU time.
Read before and after each step, on the thread that runs it; nothing here changes what the step does.

`gc_promoted`: objects a step moved into the oldest generation (what the young generations held when a
generation-1 collection began, less what it collected). A full collection comes once those exceed a quarter of the
oldest generation, and it costs 0.2-0.4 s in a process that has imported torch, DeepSpeed and transformers: in five
Llama GA 8 records on H200s stronghold's fourth timed step had one in four of them, plain DeepSpeed's none. With STRONGHOLD_BENCH_GC_TYPES=1 each step also names the ten commonest
types among those objects (`gc_promoted_types`; off by default, as it names every young object at each such
collection).

Phases (`phase_gpu_s`, `phase_host_s`): the loop calls `mark(name)` as it enters forward, backward and step() of each
micro-batch: `first_forward` (it waits for the updated weights), `forward`, `backward`, `last_backward` (it starts the
updates), `step`, and `update` (the last micro-batch's step()). Each mark records an event on the current CUDA stream
and the host clock. After the step (which synchronizes) each phase's seconds are summed over the micro-batches, on the
GPU timeline (from the event before it to the event after it: the stream's kernels and idle gaps alike) and on the
host. No event is waited for inside the step.

With STRONGHOLD_BENCH_CPU_VARIANTS set, the timed steps alternate how the CPU optimizer runs (cpu_variants.py, a
probe) and each per_step entry names its `variant`; with STRONGHOLD_BENCH_TIMELINE the chosen steps carry the CPU
optimizer's jobs and the launching thread's waits on one clock (cpu_timeline.py)."""
from __future__ import annotations

import collections
import gc
import os
import time
from typing import Any, Optional

from . import cpu_timeline, cpu_variants

TYPES_ENV = "STRONGHOLD_BENCH_GC_TYPES"


class StepProbes:
    def __init__(self, engine: Any):
        self.engine = engine
        self.runtime = getattr(engine, "stronghold_runtime", None)
        self.gc_s = [0.0, 0.0, 0.0]
        self.gc_runs = [0, 0, 0]
        self.promoted = 0
        self.types: Optional[collections.Counter] = collections.Counter() if os.environ.get(TYPES_ENV) == "1" else None
        self._young = 0
        self._gc_start: Optional[float] = None
        self._before: dict[str, float] = {}
        self._marks: list[tuple[str, Any, float]] = []
        import torch

        self._cuda = torch.cuda if torch.cuda.is_available() else None
        self.variants = cpu_variants.from_env(engine)
        self.timeline = cpu_timeline.from_env(engine)
        self._variant: Optional[str] = None
        gc.callbacks.append(self._on_gc)

    def mark(self, phase: str) -> None:
        """`phase` begins now (the previous one ends); "end" closes the last."""
        event = None
        if self._cuda is not None:
            event = self._cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((phase, event, time.perf_counter()))
        if self.timeline is not None:
            self.timeline.mark(phase)

    def _phases(self) -> dict[str, dict[str, float]]:
        gpu: dict[str, float] = collections.defaultdict(float)
        host: dict[str, float] = collections.defaultdict(float)
        for (phase, start, t0), (_, stop, t1) in zip(self._marks, self._marks[1:]):
            host[phase] += t1 - t0
            if start is not None:  # events exist for every mark or none
                gpu[phase] += start.elapsed_time(stop) / 1e3
        self._marks = []
        return {"phase_gpu_s": {k: round(v, 6) for k, v in gpu.items()},
                "phase_host_s": {k: round(v, 6) for k, v in host.items()}}

    def close(self) -> None:
        if self.variants is not None:
            self.variants.close()
        if self.timeline is not None:
            self.timeline.close()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        generation = min(int(info.get("generation", 0)), 2)
        if phase == "start":
            self._gc_start = time.perf_counter()
            if generation == 1:
                young = (gc.get_objects(0), gc.get_objects(1))
                self._young = sum(map(len, young))
                if self.types is not None:
                    self.types.update(type(obj).__name__ for objs in young for obj in objs)
        elif self._gc_start is not None:
            self.gc_s[generation] += time.perf_counter() - self._gc_start
            self.gc_runs[generation] += 1
            if generation == 1:
                self.promoted += max(0, self._young - int(info.get("collected", 0)))
            self._gc_start = None

    def _counters(self) -> dict[str, float]:
        out = {f"gc{g}_s": self.gc_s[g] for g in range(3)}
        out.update({f"gc{g}_runs": float(self.gc_runs[g]) for g in range(3)})
        out["gc_promoted"] = float(self.promoted)
        runtime = self.runtime
        if runtime is not None and runtime.window is not None:
            cpu = runtime.cpu.stats
            out.update(wait_cpu_update_s=runtime.window.stats.wait_cpu_s, cpu_busy_s=cpu.busy_s,
                       cpu_kernel_s=cpu.kernel_s,
                       cpu_wait_landed_s=cpu.landed_wait_s, grad_buffer_wait_s=cpu.grad_buffer_wait_s,
                       host_hook_s=sum(runtime.hooks.host_s.values()), weights_first_blocks=cpu.weights_first_blocks,
                       deferred_blocks=cpu.deferred_blocks, claimed_blocks=cpu.claimed_blocks)
        return out

    def before(self, timed: bool = True) -> None:
        """A step begins (`timed`: one of the timed steps, which a CPU variant probe alternates over)."""
        if self.variants is not None and timed:
            self._variant = self.variants.apply()
        if self.timeline is not None:
            self.timeline.before(timed)
        self._before = self._counters()
        self._marks = []
        if self.types is not None:
            self.types.clear()

    def after(self) -> dict[str, float]:
        """The counters' growth since `before` (the engine's statistics objects are replaced by a report's reset,
        which happens between steps, never inside one), and the step's global gradient norm: against the clipping
        limit it says why updates were deferred (speculation.py)."""
        now = self._counters()
        out = {key: round(now[key] - self._before.get(key, 0.0), 6) for key in now}
        if self.types is not None:
            out["gc_promoted_types"] = dict(self.types.most_common(10))
            self.types.clear()
        if self._marks:
            out.update(self._phases())
        if self._variant is not None:
            out["variant"] = self._variant
        rows = self.timeline.after() if self.timeline is not None else None
        if rows is not None:
            out["timeline"] = rows
        norm = self._grad_norm()
        if norm is not None:
            out["grad_norm"] = norm
        return out

    def _grad_norm(self) -> Optional[float]:
        try:
            norm = self.runtime.grad_norm() if self.runtime is not None else self.engine.get_global_grad_norm()
        except (AttributeError, RuntimeError):
            return None  # an engine that does not keep it
        return None if norm is None else round(float(norm), 6)
