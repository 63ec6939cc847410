"""Throughput, FLOPs, memory, the overlap breakdown, and the step-time floor terms.

Floor of one step (docs/architecture.md): max(GPU compute, H2D bytes / bandwidth, D2H bytes / bandwidth,
CPU AdamW of the streamed blocks); the copy terms include the offloaded activations (activations.py). `floor_terms` measures each term separately on this machine:
pinned copy bandwidth with CUDA events, the CPU kernel on a large buffer, and the GPU compute from
fully resident shallow copies of the model (depth 2 and 4, extrapolated linearly to the real depth).
"""
from __future__ import annotations

import copy
import dataclasses
import resource
import statistics
import time
from typing import Callable, Optional

import psutil
import torch
from torch import nn

from stronghold.integrations.hf_compat import enable_checkpointing, is_checkpointing

GB = 1e9


def matmul_params(model: nn.Module, blocks: nn.Module) -> tuple[int, int]:
    """(parameters of the blocks, parameters of the output head): the weights that take part in
    matmuls for every token (embedding lookups do not)."""
    block_params = sum(p.numel() for p in blocks.parameters())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return block_params, head.weight.numel() if head is not None else 0


def peak_host_gb() -> float:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def host_rss_gb() -> float:
    return psutil.Process().memory_info().rss / GB


def _host_bytes(runtime, streamed) -> dict:
    """Host bytes of the streamed blocks' (and cached parts') state: this rank's own (fp32 states and gradient
    buffers, its shard with data parallel) and the working copies, which the node holds once when they are shared."""
    private = sum(s.private_bytes() for s in streamed)
    working = sum(s.working.numel() * s.working.element_size() for s in streamed)
    data_parallel = runtime.data_parallel
    shared = data_parallel is not None and data_parallel.shared is not None
    local_ranks = data_parallel.local_world if shared else 1
    return {"rank_state_bytes": private, "working_bytes": working, "working_shared": shared,
            "local_ranks": local_ranks,
            # Shards are equal up to the last one's padding, so the node holds about local_ranks of them.
            "node_bytes_estimate": private * local_ranks + working}


def _cores(runtime) -> dict:
    """The cores this rank runs on (engine/cores.py) and its CPU AdamW's."""
    from stronghold.engine.cores import applied
    plan = applied()
    cpu = runtime.cpu
    return {"cores": len(plan.cores) if plan is not None else None, "how": plan.how if plan is not None else None,
            "numa_nodes": list(plan.numa_nodes) if plan is not None else [],
            "cpu_adam_threads": cpu.kernel.threads if cpu is not None else 0,
            "cpu_adam_cores": len(runtime.worker_cores)}


def runtime_report(runtime, since_step: int = 0, reset: bool = False) -> dict:
    """Window, residency, transfer volume per step and where the host waited, since the last reset (at optimizer step
    `since_step`); `reset`: start the counts again (the caller keeps the step it reset at)."""
    steps = max(1, runtime.steps - since_step)
    streamed = list(runtime.stores.values())
    report = {
        "window_size": runtime.window_size,
        "resident_blocks": runtime.resident_count,
        "streamed_blocks": len(streamed),
        "lean_blocks": sum(s.lean for s in streamed),
        "gpu_accumulation": runtime.device_accum is not None,
        "gpu_accumulator_bytes": runtime.device_accum.nbytes if runtime.device_accum is not None else 0,
        "blockwise_backward": runtime.blockwise is not None,
        # The kept inputs' page-locked slots (kept_inputs.py): allocations since set-up and their bytes.
        "kept_input_slots": ({"allocations": runtime.blockwise.kept.slots.allocations,
                              "bytes": runtime.blockwise.kept.slots.allocated_bytes}
                             if runtime.blockwise is not None else None),
        # The input table's gradient as its rows in the walk (embedding_rows.py): walks so, and with the whole table.
        "embedding_rows": (runtime.blockwise.rows.report()
                           if runtime.blockwise is not None and runtime.blockwise.rows is not None else None),
        # Windows whose forwards ran block by block (block_major.py), and those run one by one after all, as a batch
        # differed from the one given.
        "block_major_forward": ({"windows": runtime.blockwise.major.runs, "dropped": runtime.blockwise.major.dropped}
                                if runtime.blockwise is not None else None),
        "streamed_params": sum(s.numel for s in streamed),
        "resident_params": sum(p.numel() for p in runtime.resident.params),
        # The parts outside the blocks in the cached tier (weights on the GPU, fp32 states on the host: cached.py).
        "cached_parts": sorted(runtime.cached_parts),
        "cached_params": sum(s.numel for s in runtime.cached.stores.values()),
        "steps": steps,
        "host": _host_bytes(runtime, runtime.host_stores()),
        "cores": _cores(runtime),
        "h2d_bytes_per_step": runtime.transfers.h2d_bytes / steps,
        "d2h_bytes_per_step": runtime.transfers.d2h_bytes / steps,
        "garbage_collection": dataclasses.asdict(runtime.collector.report),
        "first_step": runtime.first_step.report(),
        "set_up": dict(runtime.set_up, parts_s=dict(runtime.set_up["parts_s"]),
                       prefault=None if runtime.prefault is None else runtime.prefault.report()),
    }
    if runtime.promotion_fills or runtime.promotion_fill is not None:  # promotions' copies on a thread
        report["promotion_fills"] = [*runtime.promotion_fills] + (
            [runtime.promotion_fill.report()] if runtime.promotion_fill is not None else [])
    if runtime.releaser.errors:  # host buffers of promoted blocks that could not be given back (release.py)
        report["host_release_errors"] = list(runtime.releaser.errors)
    if runtime.cached.units:
        k = runtime.cached.stats
        report["cached"] = {"loads_per_step": k.loads / steps, "waits_per_step": k.waits / steps,
                            "wait_cpu_update_s_per_step": k.wait_cpu_s / steps}
    if runtime.cpu is not None:
        c = runtime.cpu.stats
        w = runtime.window.stats if runtime.window is not None else None
        report["overlap"] = {
            "loads_per_step": w.loads / steps if w else 0.0,
            "demand_loads_per_step": w.demand_loads / steps if w else 0.0,
            "reused_slots_per_step": w.reused / steps if w else 0.0,
            "wait_cpu_update_s_per_step": w.wait_cpu_s / steps if w else 0.0,
            "cpu_optim_busy_s_per_step": c.busy_s / steps,
            "cpu_optim_kernel_s_per_step": c.kernel_s / steps,
            "cpu_wait_landed_s_per_step": c.landed_wait_s / steps,
            "step_wait_cpu_s_per_step": c.wait_step_s / steps,
            "grad_buffer_wait_s_per_step": c.grad_buffer_wait_s / steps,
            "host_hook_s_per_step": {name: s / steps for name, s in sorted(runtime.hooks.host_s.items())},
            "redo_blocks_per_step": c.redo_blocks / steps,
            "deferred_blocks_per_step": c.deferred_blocks / steps,
            "claimed_blocks_per_step": c.claimed_blocks / steps,
            "weights_first_blocks_per_step": c.weights_first_blocks / steps,
        }
        report["cpu_kernel"] = type(runtime.cpu.kernel).__name__
        report["cpu_threads"] = runtime.cpu.kernel.threads
    if runtime.nvme is not None:  # the NVMe tier (nvme.py): measured beside the plan's floor term
        report["nvme"] = runtime.nvme.report(steps, reset=reset)
        if runtime.placement is not None:
            report["nvme"]["predicted_s_per_step"] = runtime.placement.plan.floor.nvme_s
    if runtime.activations is not None:
        # Activation offload (activations.py): its own copies, on the same streams as the weights'.
        report["activations"] = runtime.activations.report(steps)
    if getattr(runtime, "compiled", None) is not None:  # regional compilation (compile.py): compile time, graphs, any fallback
        report["compile"] = runtime.compiled.report()
    if getattr(runtime, "long_context", None) is not None:
        report["long_context"] = dict(runtime.long_context.decision)
    if runtime.placement is not None:
        # The plan (what it predicted) beside what this process measured since the last reset.
        report["placement"] = runtime.placement.report()
        report["placement"]["measured"]["gpu_peak_allocated_bytes_now"] = torch.cuda.max_memory_allocated(
            runtime.device)
        report["placement"]["measured"]["gpu_peak_reserved_bytes_now"] = torch.cuda.max_memory_reserved(
            runtime.device)
        report["placement"]["measured"]["host_peak_rss_bytes_now"] = int(peak_host_gb() * GB)
    if reset:
        runtime.transfers.reset_stats()
        if runtime.activations is not None:
            runtime.activations.reset_stats()
        if runtime.window is not None:
            runtime.window.reset_stats()
        if runtime.cpu is not None:
            runtime.cpu.reset_stats()
            runtime.hooks.host_s.clear()
        runtime.cached.reset_stats()
    return report


def copy_bandwidths(numel: int, repeats: int = 5) -> tuple[float, float]:
    """(H2D, D2H) bytes/s of `numel` bf16 elements between a pinned host buffer and the GPU: one pair of buffers for
    both directions (a pinned allocation costs more than the copies timed here)."""
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        rates.append(numel * 2 / statistics.median(times[1:]))
    return rates[0], rates[1]


def cpu_adam_params_per_s(kernel, numel: int = 64 * 2 ** 20, dtype: torch.dtype = torch.bfloat16,
                          repeats: int = 3) -> float:
    """Throughput of the engine's CPU AdamW as the engine calls it with compute dtype `dtype` (bf16 or
    fp16 grad in and copy out; fp32 grad in, no copy): the median of `cpu_adam_probe`'s repeats."""
    return statistics.median(cpu_adam_probe(kernel, numel, dtype, repeats).params_per_s)


@dataclasses.dataclass(frozen=True)
class CpuProbe:
    """Each repeat's parameters a second of the CPU AdamW: by the kernel's own clock where it keeps one, and by the
    calling thread's wall clock. The wall clock also counts the wait for the GIL after the kernel returns: a Python
    thread busy beside the probe holds it up to the switch interval (5 ms), longer than the whole call: such a thread
    halved the wall's rate and barely moved the kernel's own (examples/bench/cpu_probe_spread.py)."""

    kernel: Optional[list[float]]
    """None where the kernel keeps no clock (the eager reference)."""
    wall: list[float]

    @property
    def params_per_s(self) -> list[float]:
        """The rates the plans take: the kernel's own where it keeps them."""
        return self.kernel if self.kernel is not None else self.wall


def cpu_adam_probe(kernel, numel: int = 64 * 2 ** 20, dtype: torch.dtype = torch.bfloat16,
                   repeats: int = 3) -> CpuProbe:
    """The engine's CPU AdamW over `numel` parameters, `repeats` times after one untimed call."""
    from stronghold.optim.adamw_kernel import AdamWCoeffs
    # Constant values: the kernel's time does not depend on them, and random ones took longer to draw than the
    # probe takes to run (it runs while the engine is built).
    p, m, v = torch.full((numel,), 0.5), torch.full((numel,), 0.01), torch.full((numel,), 1e-4)
    g = torch.full((numel,), 1e-2, dtype=dtype)
    out = torch.empty(numel, dtype=dtype) if dtype != torch.float32 else None
    coeffs = AdamWCoeffs(1e-4, 0.9, 0.999, 1e-8, 0.01, 10)
    clock = getattr(kernel, "kernel_seconds", lambda: None)
    kernel.step(p, m, v, g, out, coeffs)
    walls, owns = [], []
    for _ in range(repeats):
        own, start = clock(), time.perf_counter()
        kernel.step(p, m, v, g, out, coeffs)
        wall, after = time.perf_counter() - start, clock()
        walls.append(wall)
        if own is not None and after is not None:
            # The clock counts every caller in the process: another caller at the same time can only add to it,
            # and the wall bounds this call's own.
            owns.append(min(wall, max(after - own, 1e-9)))
    return CpuProbe(kernel=[numel / t for t in owns] if len(owns) == repeats else None,
                    wall=[numel / t for t in walls])


def _fwd_bwd_seconds(model: nn.Module, batch: dict, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def gpu_compute_seconds(model_factory: Callable[[int], nn.Module], layers: int, batch: dict,
                        dtype: torch.dtype, checkpointing: bool) -> float:
    """Forward + backward time of the full depth, from resident models of depth 2 and 4 (linear in depth)."""
    measured = {}
    for depth in (2, 4):
        shallow = model_factory(depth).to("cuda", dtype)
        if checkpointing:
            enable_checkpointing(shallow)
        shallow.train()
        measured[depth] = _fwd_bwd_seconds(shallow, batch)
        del shallow
        torch.cuda.empty_cache()
    per_block = (measured[4] - measured[2]) / 2
    return measured[2] + per_block * (layers - 2)


def hf_depth_factory(model: nn.Module) -> Callable[[int], nn.Module]:
    """Shallow copies of an HF model's architecture (random weights) for `gpu_compute_seconds`."""
    def build(depth: int) -> nn.Module:
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = depth
        return type(model)(config)
    return build


def floor_terms(engine, batch: dict, model_factory: Optional[Callable[[int], nn.Module]] = None,
                layers: Optional[int] = None) -> dict:
    """The four floor terms of this engine's step, each measured on its own (seconds per step)."""
    runtime = engine.stronghold_runtime
    report = engine.stronghold_report()
    streamed = list(runtime.stores.values())
    trainable = sum(s.trainable_numel for s in streamed)
    kernel = runtime.cpu.kernel if runtime.cpu is not None else None
    terms: dict = {"streamed_trainable_params": trainable}
    if kernel is not None:
        rate = cpu_adam_params_per_s(kernel, dtype=runtime.compute_dtype)
        terms["cpu_adam_params_per_s"] = rate
        terms["cpu_optim_s"] = trainable / rate
    if torch.cuda.is_available() and streamed:
        largest = max(s.numel for s in streamed)
        h2d, d2h = copy_bandwidths(largest)
        # The activations' copies share the link in each direction with the weights' and gradients'.
        acts = report.get("activations", {})
        terms.update(h2d_GBps=h2d / GB, d2h_GBps=d2h / GB,
                     h2d_s=(report["h2d_bytes_per_step"] + acts.get("h2d_bytes_per_step", 0)) / h2d,
                     d2h_s=(report["d2h_bytes_per_step"] + acts.get("d2h_bytes_per_step", 0)) / d2h)
        if acts:
            terms.update(activation_h2d_s=acts["h2d_bytes_per_step"] / h2d,
                         activation_d2h_s=acts["d2h_bytes_per_step"] / d2h)
    if torch.cuda.is_available() and model_factory is not None and layers is not None:
        module = engine.module
        terms["gpu_compute_s"] = gpu_compute_seconds(model_factory, layers, batch, runtime.compute_dtype,
                                                     is_checkpointing(module))
    seconds = [terms[k] for k in ("gpu_compute_s", "h2d_s", "d2h_s", "cpu_optim_s") if k in terms]
    terms["floor_s"] = max(seconds) if seconds else None
    return terms
