"""Where the launching thread's time in stronghold's hooks goes, without a profiler (issue 9's Llama gap).

    PROBE_HOOKS_OUT=hooks.json python3 -m examples.probe_hooks --system stronghold --arch llama ... (run_one's flags)

Runs one benchmark point through `examples.bench.run_one` (its JSON lines on stdout as usual) with wall-clock timers
around the engine's per-block host calls, then writes per kind: calls and seconds, over the whole run (warm-up and
set-up steps included, so read the split, not the totals). The timers wrap this process's own classes only, the
way a profiler would; the report's `overlap.host_hook_s_per_step` is the unwrapped figure to compare with.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time

from stronghold.optim.cpu_adam import NativeAdamW
from stronghold.optim.cpu_optim import CpuOptimizer
from stronghold.engine.runtime import StrongholdRuntime
from stronghold.streaming.streams import Transfers
from stronghold.streaming.window import Window

from .bench import run_one

TIMED = {
    "runtime.grad_arrived": (StrongholdRuntime, "grad_arrived"),
    "runtime._offload": (StrongholdRuntime, "_offload"),
    "cpu.take_grad_buffer": (CpuOptimizer, "take_grad_buffer"),
    "cpu.submit_grads": (CpuOptimizer, "submit_grads"),
    "transfers.offload": (Transfers, "offload"),
    "transfers.load": (Transfers, "load"),
    "window.enter": (Window, "enter"),
    "window.release": (Window, "release"),
}


def _wrap(totals: dict, name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals.setdefault((name, threading.current_thread().name), [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    return timed


def _accumulate_threads(threads: int) -> None:
    """PROBE_ACCUMULATE_THREADS: the native kernel sums the micro-steps' gradients with this many threads (its
    updates and previews keep the default): does the accumulation's host-DRAM traffic slow the launches?"""
    accumulate = NativeAdamW.accumulate

    def fewer(self, acc, g, first):
        default, self.threads = self.threads, min(threads, self.threads)
        try:
            return accumulate(self, acc, g, first)
        finally:
            self.threads = default

    NativeAdamW.accumulate = fewer


def main(argv: list[str]) -> int:
    totals: dict = {}
    for name, (cls, attr) in TIMED.items():
        setattr(cls, attr, _wrap(totals, name, getattr(cls, attr)))
    if os.environ.get("PROBE_ACCUMULATE_THREADS"):
        _accumulate_threads(int(os.environ["PROBE_ACCUMULATE_THREADS"]))
    try:
        return run_one.main(argv)
    finally:
        rows = [{"kind": kind, "thread": thread, "calls": calls, "s": round(seconds, 6),
                 "us_per_call": round(1e6 * seconds / calls, 2)} for (kind, thread), (calls, seconds) in sorted(totals.items())]
        path = os.environ.get("PROBE_HOOKS_OUT")
        text = json.dumps({"argv": argv, "timers": rows}, indent=1)
        if path:
            with open(path, "w") as handle:
                handle.write(text)
        print(text, file=sys.stderr)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as run_one: skip the interpreter teardown that has been seen to hang
