"""Where each Python thread's wall time goes in one step, by sampling stacks (`run_one --profile`: record
["host_samples"]).

cProfile charges every call it records (about a microsecond, which inflates a launch-bound step's host time), and
from Python 3.12 it mixes all threads together. A sampler costs nothing per call. Every `interval_s` it reads each
thread's current frame (`sys._current_frames`) and adds the time since its last sample, per thread name, to the
innermost function (where the thread is) and to every distinct function on the stack (what it is inside). The sampler
needs the GIL, so a thread running pure Python delays the next sample to its switch interval (5 ms): weighting each
sample by the time it stands for, not counting samples, keeps such a thread's share right.
A thread blocked in C code (a CUDA synchronize, autograd's engine) shows the Python frame that called it. Autograd's
device thread appears only while it runs Python hooks. The launching thread of the Llama step is MainThread (the
forward) and autograd's thread (the backward's hooks): compare their functions between plain DeepSpeed and
stronghold (~0.2 s a step of launch gaps lay outside the engine's own ranges there).
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Callable

TOP = 30


def _where(code) -> str:
    path = code.co_filename.rsplit("/site-packages/", 1)[-1].rsplit("/work/main/", 1)[-1]
    return f"{code.co_name} ({path}:{code.co_firstlineno})"


class HostSampler:
    def __init__(self, interval_s: float = 0.0005):
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.leaf: dict[str, Counter] = defaultdict(Counter)
        """Thread name -> function -> seconds."""
        self.inside: dict[str, Counter] = defaultdict(Counter)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self._elapsed = 0.0

    def _run(self) -> None:
        start = last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            weight, last = now - last, now
            self.take(weight)
        self._elapsed = time.perf_counter() - start

    def take(self, weight: float) -> None:
        """One sample: `weight` seconds to every thread's current function and to each function it is inside (the
        sampler's own thread left out)."""
        me = self._thread.ident
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, f"thread-{ident}")
            self.leaf[name][_where(frame.f_code)] += weight
            seen = set()
            while frame is not None:
                where = _where(frame.f_code)
                if where not in seen:
                    seen.add(where)
                    self.inside[name][where] += weight
                frame = frame.f_back
        self.samples += 1

    def __enter__(self) -> "HostSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, top: int = TOP) -> dict[str, Any]:
        threads = {}
        for name in sorted(self.leaf):
            threads[name] = {
                "sampled_s": round(sum(self.leaf[name].values()), 6),
                "top_leaf_s": {w: round(s, 6) for w, s in self.leaf[name].most_common(top)},
                "top_inside_s": {w: round(s, 6) for w, s in self.inside[name].most_common(top)},
            }
        period = self._elapsed / self.samples if self.samples else 0.0
        return {"samples": self.samples, "period_s": period, "threads": threads}


def sample_host_one_step(run: Callable[[], float], interval_s: float = 0.0005) -> dict[str, Any]:
    """Sample every thread's stack while `run` (one optimizer step, returning its wall seconds) runs."""
    with HostSampler(interval_s) as sampler:
        step_s = run()
    return {"step_s": step_s, **sampler.summary()}
