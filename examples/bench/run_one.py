"""Child process: run one benchmark point and print it as JSON lines on stdout.

    python -m examples.bench.run_one --system no_offload --layers 32 [--gpu-cap-gb 32] ...

It prints a `{"event": "start", ...}` line (device, versions) as soon as it knows them, so that a
parent whose child is later killed (host OOM) still knows where it ran, then one
`{"event": "result", ...}` line: the measurement, or `"error"` for an exception it caught itself
(`oom_gpu`, `oom_host`, `error`). The parent (harness.py) adds what only it can see: SIGKILL,
timeouts and the peak RSS from wait4. Run it through the harness; alone it has no timeout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Callable

from .environment import (GiB, _prefer_oom_victim, allocator_counts, allocator_per_step, apply_gpu_cap,
                          environment_info, gpu_memory, pinned_allocator, setup_environment)
from .point import Point, add_point_args, point_from_args
from .step_probes import StepProbes

# bf16 dense 8192^3 matmul measured on an H200 (the source string is stored in every record); an H100 gave 798.
DEFAULT_PEAK_TFLOPS = 796.0
DEFAULT_PEAK_SOURCE = "H200 bf16 8192^3 matmul, peers-h200.md"
SMALL_PAGES_ENV = "STRONGHOLD_BENCH_SMALL_PAGES"
SIMULATIONS = ("oom_gpu", "oom_host", "timeout", "crash", "silent_exit")
# The terms of telemetry.floor_terms whose largest is the floor, seconds per optimizer step.
FLOOR_TERMS = ("gpu_compute_s", "h2d_s", "d2h_s", "cpu_optim_s")


def add_peak_args(parser: argparse.ArgumentParser) -> None:
    """The peak TFLOP/s that MFU is relative to, and where it came from (this runner and the sweeps)."""
    parser.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    parser.add_argument("--peak-tflops-source", default=DEFAULT_PEAK_SOURCE)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(_json_safe(record), sort_keys=True), flush=True)


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: store them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def classify_exception(exc: BaseException) -> str:
    """`oom_gpu`, `oom_host` or `error` for an exception the child caught, looking through the
    chain of causes (an engine may re-raise a worker thread's MemoryError as its own error)."""
    import torch

    if type(exc).__name__ == "PeerUnavailable":  # systems.py: the peer cannot run here; its reason is the detail
        return "unavailable"
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        # stronghold's planner, before allocating; a refusal that names several attempts leads with the binding one.
        if isinstance(seen, MemoryError) and text.startswith("stronghold's placement does not fit the GPU"):
            return "oom_gpu"
        if isinstance(seen, MemoryError) or "DefaultCPUAllocator: can't allocate" in text or "not enough memory" in text:
            return "oom_host"
        if isinstance(seen, torch.OutOfMemoryError) or "CUDA out of memory" in text or "CUDA error: out of memory" in text:
            return "oom_gpu"
        seen = seen.__cause__ or seen.__context__
    return "error"


def caught(exc: BaseException) -> dict[str, str]:
    """The record's fields for an exception the child caught (`classify_exception`, the message's last 2000
    characters); its traceback goes to stderr."""
    traceback.print_exc()
    return {"error": classify_exception(exc),
            "error_detail": "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]}


def _sync(has_cuda: bool) -> None:
    if has_cuda:
        import torch

        torch.cuda.synchronize()


def optimizer_steps(engine: Any, point: Point, batches: list[dict], sync: Callable[[], None],
                    after_warmup: Callable[[], None],
                    after_first: Callable[[], None] = lambda: None,
                    per_step: list[dict] | None = None, marker: Callable[[str], None] | None = None,
                    warmup_s: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Run `warmup_steps + timed_steps` optimizer steps: (seconds of each timed step, every micro-batch's loss).

    DeepSpeed wants forward, backward(loss) and step() on every micro-batch: step() counts them and
    updates only at the accumulation boundary (backward scales the loss by 1/accumulation). So one
    timed step runs from the first micro-batch's forward to the update after the last, all
    `accumulation` of them. Micro-batches cycle through `batches`, the same sequence for every system.
    `per_step`, if given, receives each timed step's StepProbes counters (step_probes.py); else `marker`, if given, is
    called as each phase begins (the profiled step's marker kernels, profile_phases.py); `warmup_s`, the warm-up steps'
    seconds."""
    step_s: list[float] = []
    losses = []
    micro = 0
    probes = StepProbes(engine) if per_step is not None else None
    mark = probes.mark if probes is not None else marker or (lambda phase: None)
    for i in range(point.warmup_steps + point.timed_steps):
        sync()
        if probes is not None:
            probes.before(timed=i >= point.warmup_steps)
        start = time.perf_counter()
        for m in range(point.accumulation):
            last = m == point.accumulation - 1
            mark("first_forward" if m == 0 else "forward")  # the first waits for the updated weights
            loss = engine(**batches[micro % len(batches)]).loss
            micro += 1
            mark("last_backward" if last else "backward")  # the last starts the updates
            engine.backward(loss)
            mark("update" if last else "step")
            engine.step()
            losses.append(loss.detach())  # read after the step is timed: float() would wait for the GPU
        mark("end")
        sync()
        elapsed = time.perf_counter() - start
        if i < point.warmup_steps and warmup_s is not None:
            warmup_s.append(elapsed)
        if i >= point.warmup_steps:
            step_s.append(elapsed)
            if probes is not None:
                per_step.append(probes.after())
        if i == 0:
            after_first()
        if i == point.warmup_steps - 1:
            after_warmup()
    if probes is not None:
        probes.close()
    return step_s, [float(loss.float()) for loss in losses]


def measure(point: Point, has_cuda: bool, peak_tflops: float, simulate: str | None,
            floor: bool = True, profile: bool = False) -> dict[str, Any]:
    """Build, warm up, time; the fields of the result line (without provenance)."""
    import torch

    from .flops import flops_per_step, tokens_per_step
    from .model import SEED, random_batches
    from .systems import build

    if simulate == "oom_gpu":
        raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 1.00 GiB")
    if simulate == "crash":
        raise RuntimeError("simulated crash")
    device = torch.device("cuda", 0) if has_cuda else torch.device("cpu")
    record: dict[str, Any] = {"gpu_cap_applied": apply_gpu_cap(point, has_cuda)}
    if os.environ.get(SMALL_PAGES_ENV) == "1":
        # A probe, not a setting: the host buffers on 4 KiB pages instead of huge ones (pinned.py), to compare the
        # two in one call; the record says which it measured.
        import stronghold.streaming.pinned

        stronghold.streaming.pinned._huge_pages = lambda mapping: None
        record["small_pages"] = True
    built = build(point, device)
    record.update(build_s=built.build_s, engine_init_s=built.engine_init_s, **built.record)
    engine = built.engine
    # Two batches (the seed runs' pair) or one per micro-batch of a step, whichever is more.
    batches = random_batches(point, max(2, point.accumulation), device)

    counts_at_warmup: dict[str, int] = {}

    def after_warmup() -> None:
        if has_cuda:
            counts_at_warmup.update(allocator_counts())
        if point.system == "stronghold":
            engine.stronghold_report(reset=True)  # the report covers the timed steps only

    def after_first() -> None:
        if has_cuda:
            record["pinned_allocator_first_step"] = pinned_allocator()
        if built.checkpoint_calls is None:
            return
        calls = built.checkpoint_calls()
        record["ds_checkpoint_calls_first_step"] = calls
        # Every block's forward of every micro-batch went through DeepSpeed's checkpoint, or the point
        # would measure torch's checkpointing under DeepSpeed's name.
        if calls < point.layers * point.accumulation:
            raise RuntimeError(f"deepspeed.checkpointing.checkpoint ran {calls} times in the first step, expected "
                               f"{point.layers * point.accumulation} (layers x micro-batches): cpu_checkpointing not in effect")

    # GPT-2 keeps its dropout (p=0.1), as the seed's Megatron runs did; seeding it here, after
    # the build (zero.Init draws from the global generator), gives every system the same masks.
    torch.manual_seed(SEED)
    per_step: list[dict] = []
    warmup_s: list[float] = []
    step_s, losses = optimizer_steps(engine, point, batches, lambda: _sync(has_cuda), after_warmup, after_first,
                                     per_step, warmup_s=warmup_s)
    record.update(per_step=per_step, warmup_step_s=warmup_s, first_step_s=(warmup_s or step_s)[0])

    median_s = statistics.median(step_s)
    hw_flops, model_flops = flops_per_step(point)
    record.update(
        step_s=median_s, step_s_all=step_s, loss_first=losses[0], loss_last=losses[-1],
        optimizer_steps=getattr(engine, "global_steps", None),
        samples_per_s=point.batch * point.accumulation / median_s, tokens_per_s=tokens_per_step(point) / median_s,
        tflops=hw_flops / median_s / 1e12, model_tflops=model_flops / median_s / 1e12,
        peak_tflops=peak_tflops,
    )
    record["hfu"] = record["tflops"] / peak_tflops
    record["mfu"] = record["model_tflops"] / peak_tflops
    if has_cuda:  # before floor_terms, whose probes allocate on their own
        record.update(gpu_memory())
        record["pinned_allocator"] = pinned_allocator()
        if counts_at_warmup:
            record["allocator_per_step"] = allocator_per_step(counts_at_warmup, len(step_s))
    if point.system == "stronghold":
        record.update(stronghold_telemetry(engine, batches[0], point, floor))
    if profile and has_cuda:  # more steps, after the timed ones, their memory peaks and the engine's report
        from .host_sampler import sample_host_one_step
        from .profile_step import profile_one_step, python_profile_one_step

        one = point.with_(warmup_steps=0, timed_steps=1)

        def one_step(marker=None) -> float:
            return optimizer_steps(engine, one, batches, lambda: _sync(has_cuda), lambda: None, marker=marker)[0][0]

        record["profile"] = profile_one_step(one_step)
        record["python_profile"] = python_profile_one_step(one_step)
        record["host_samples"] = sample_host_one_step(one_step)
    return record


def stronghold_telemetry(engine: Any, batch: dict, point: Point, floor_probe: bool = True) -> dict[str, Any]:
    """engine.stronghold_report() and telemetry.floor_terms() (its floor_s: the largest term).

    floor_terms measures each term on its own after the timed steps; its GPU-compute term needs a
    factory of shallow copies of the model, which telemetry.hf_depth_factory makes. That term is
    one micro-batch's forward and backward, while the copy terms are per optimizer step (the
    report's bytes per step) and the optimizer runs once a step: with accumulation the compute
    term is scaled to the step's micro-batches (the measured one kept as gpu_compute_micro_batch_s)."""
    from stronghold.engine import telemetry

    out: dict[str, Any] = {"stronghold": engine.stronghold_report(), "floor": None, "floor_s": None}
    if not floor_probe:  # --no-floor: sweeps that compare step times only skip the probes' seconds
        out["floor_skipped"] = True
        return out
    factory = telemetry.hf_depth_factory(engine.module)
    try:
        floor = telemetry.floor_terms(engine, batch, model_factory=factory, layers=point.layers)
    except Exception as e:  # the step was measured; a failing floor probe must not lose it
        out["floor_error"] = f"{type(e).__name__}: {e}"
        return out
    if point.accumulation > 1 and "gpu_compute_s" in floor:
        floor["gpu_compute_micro_batch_s"] = floor["gpu_compute_s"]
        floor["gpu_compute_s"] *= point.accumulation
        floor["floor_s"] = max(floor[k] for k in FLOOR_TERMS if k in floor)
    out.update(floor=floor, floor_s=floor["floor_s"])
    return out


def _simulate_early(simulate: str | None) -> None:
    """Test-only failures that happen outside Python's exception handling."""
    if simulate == "oom_host":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    if simulate == "timeout":
        time.sleep(3600)
    if simulate == "silent_exit":
        print("simulated failure without a result line", file=sys.stderr, flush=True)
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.bench.run_one", description=__doc__.split("\n")[0])
    add_point_args(parser)
    add_peak_args(parser)
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip telemetry.floor_terms after the timed steps (stronghold)")
    parser.add_argument("--profile", action="store_true",
                        help="GPU: profile one more step after the timed ones (record['profile'], profile_step.py), then "
                             "one under cProfile, then one with the stacks sampled (host_sampler.py)")
    parser.add_argument("--simulate", choices=SIMULATIONS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    point = point_from_args(args)
    _prefer_oom_victim()
    has_cuda = setup_environment()
    emit({"event": "start", **environment_info(has_cuda)})
    _simulate_early(args.simulate)

    result: dict[str, Any] = {"event": "result", "peak_tflops_source": args.peak_tflops_source}
    try:
        result.update(measure(point, has_cuda, args.peak_tflops, args.simulate, args.floor, args.profile))
        result["error"] = None
    except BaseException as exc:  # noqa: B036 - every failure becomes a recorded outcome
        result.update(caught(exc))
    if has_cuda and "peak_gpu_GB" not in result:  # after a failure: how far it got before the cap
        result.update(gpu_memory())
    result["peak_host_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    from stronghold.streaming.pinned import anon_huge_pages_bytes  # here: this module imports torch only where it runs

    huge = anon_huge_pages_bytes()
    result["host_huge_pages_GB"] = None if huge is None else huge / GiB
    emit(result)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is out; skip interpreter teardown, where DeepSpeed's process group and pinned
    # buffers have been seen to hang, which would turn a measured point into a timeout.
    os._exit(code)
