"""A probe, not a setting: change how stronghold's CPU optimizer runs from one timed step to the next, inside one
process, so that variants are compared on the same machine, model and placement, step by step.

Two records of the same configuration have differed by 15% in samples/s on one machine (6.68 against 5.70 for
a Llama GA 8 point on an H200), more than the effects the A/Bs look for; so a variant is alternated with the default inside one run, and
each step's phase times (step_probes.py) say what it changed. Set STRONGHOLD_BENCH_CPU_VARIANTS to a comma-separated
cycle of variant names; timed step i runs variant i mod len(cycle), and its per_step entry names it (`variant`).

- `default`: as the engine runs.
- `skip`: the host accumulation's kernel returns at once (numerics wrong): does the CPU's work in backward slow the
  thread that launches it?
- `idle`: the worker thread and the kernel threads it starts (they inherit it) run under SCHED_IDLE, so any thread
  that wakes (the launching thread, autograd's) takes a core at once.
- `threadsN`: the kernel runs on N threads.
- `accN`: the micro-steps' accumulation alone runs on N threads (previews and updates on the default): less host
  bandwidth at once beside the launch-bound backward, for sums that only need to finish by the next micro-step.
- `switchMS`: the interpreter's switch interval (sys.setswitchinterval) is MS milliseconds (default 5): how long a
  thread that wants the GIL waits before it makes the holder drop it. If the worker's short Python stretches between
  its C calls hold up the thread running backward's Python (checkpoint recomputes, hooks), the interval moves that.
- `nod2h`: the gradients of non-boundary micro-steps are not copied to the host (their D2H event is still recorded,
  so everything waits as before; numerics wrong): do the 21.6 GB a step of D2H slow the launch-bound backward?
- `nopair`: every micro-step's gradients are added on their own (the spare gradient buffers set aside), as before
  two micro-steps were summed in one pass (cpu_optim._accumulate).
- `stack8m`: the kernel's threads get the system's default stacks (8 MiB), as before csrc/adamw.c gave them 256 KiB:
  too many for glibc's cache of stacks, so each call maps and unmaps them.
The engine is changed only through its own objects (the runtime's kernel and worker), and only while the run lasts.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Optional

ENV = "STRONGHOLD_BENCH_CPU_VARIANTS"
STACK_BYTES = 256 * 1024
"""csrc/adamw.c's thread_stack_bytes."""


def from_env(engine: Any) -> Optional["CpuVariants"]:
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    runtime = getattr(engine, "stronghold_runtime", None)
    if not names or runtime is None or runtime.cpu is None:
        return None
    return CpuVariants(runtime, names)


class CpuVariants:
    def __init__(self, runtime: Any, names: list[str]):
        for name in names:
            if name not in ("default", "skip", "idle", "stack8m", "nod2h", "nopair") and not (name.startswith("threads") and name[7:].isdigit()) \
                    and not (name.startswith("acc") and name[3:].isdigit()) \
                    and not (name.startswith("switch") and name[6:].replace(".", "", 1).isdigit()):
                raise ValueError(f"{ENV}: unknown variant {name!r} (default, skip, idle, stack8m, nod2h, nopair, threadsN, accN, switchMS)")
        self.runtime = runtime
        self.cpu = runtime.cpu
        self.kernel = runtime.cpu.kernel
        self.names = names
        self.threads = self.kernel.threads
        self.count = 0
        self.policy = os.SCHED_OTHER
        self.switch = sys.getswitchinterval()
        self.spares: dict = {}

    def apply(self) -> str:
        """Set up the next timed step's variant; its name."""
        name = self.names[self.count % len(self.names)]
        self.count += 1
        kernel = self.kernel
        kernel.threads = int(name[7:]) if name.startswith("threads") else self.threads
        if name == "skip":
            kernel.accumulate = lambda acc, g, first: 0.0
        elif name.startswith("acc"):
            kernel.accumulate = self._accumulate_on(int(name[3:]))
        elif "accumulate" in vars(kernel):
            del kernel.accumulate  # the class's method again
        self._stack(0 if name == "stack8m" else STACK_BYTES)
        self._d2h(name != "nod2h")
        self._pairs(name != "nopair")
        sys.setswitchinterval(float(name[6:]) / 1e3 if name.startswith("switch") else self.switch)
        self._policy(os.SCHED_IDLE if name == "idle" else os.SCHED_OTHER)
        return name

    def _accumulate_on(self, threads: int):
        kernel, method = self.kernel, type(self.kernel).accumulate

        def accumulate(acc, g, first):
            kernel.threads = threads  # every kernel call comes from the one worker thread: no other reads it now
            try:
                return method(kernel, acc, g, first)
            finally:
                kernel.threads = self.threads

        return accumulate

    def _pairs(self, on: bool) -> None:
        """Between steps no micro-step's gradients are parked, so the spare buffers can come and go."""
        stores = getattr(self.runtime, "stores", None) or {}
        for index, store in stores.items():
            if on and store.grad_spare is None and index in self.spares:
                store.grad_spare = self.spares.pop(index)
            elif not on and store.grad_spare is not None:
                self.spares[index], store.grad_spare = store.grad_spare, None

    def _d2h(self, copy: bool) -> None:
        transfers = getattr(self.runtime, "transfers", None)
        if transfers is None:
            return
        if copy:
            if "offload" in vars(transfers):
                del transfers.offload
            return
        runtime, real = self.runtime, type(transfers).offload.__get__(transfers)

        def offload(pieces, sq, sq_destination, done):
            real(pieces if runtime.boundary else [], sq, sq_destination, done)

        transfers.offload = offload

    def _stack(self, nbytes: int) -> None:
        library = getattr(self.kernel, "lib", None)  # the native kernel's; the eager reference starts no threads
        if library is not None:
            library.sh_set_thread_stack(nbytes)

    def _policy(self, policy: int) -> None:
        """Set the worker thread's scheduling policy, on that thread (after the jobs already queued). Only on a
        change: it waits for the worker's backlog (the previous step's updates), which the engine would overlap."""
        if policy == self.policy:
            return
        self.policy = policy
        done = threading.Event()

        def job():
            os.sched_setscheduler(0, policy, os.sched_param(0))
            done.set()

        self.cpu.submit_after(job)
        self.cpu.wait(done, "the probe's scheduling-policy job")

    def close(self) -> None:
        self.count = 0
        self.kernel.threads = self.threads
        if "accumulate" in vars(self.kernel):
            del self.kernel.accumulate
        self._stack(STACK_BYTES)
        self._d2h(True)
        self._pairs(True)
        sys.setswitchinterval(self.switch)
        self._policy(os.SCHED_OTHER)
