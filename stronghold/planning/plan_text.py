"""What the planner (planner.py) tells people: the placement table printed at start-up and the
MemoryError messages that give the bytes by part and the knob to change. Text only: every number comes
in computed by the planner, so the accounting stays in one place."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from stronghold.planning.plan_result import GpuBytes, HostBytes, Plan
    from stronghold.planning.plan_types import Budgets, Drive

GIB = 2 ** 30


NVME_ADVICE = "set \"nvme_path\" (the NVMe tier keeps the states of the blocks that do not fit on a drive), "


def _gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def _spares_dropped(plan: Plan) -> bool:
    """Host accumulation for streamed blocks without their second gradient buffer (planner: `gradient_spares`)."""
    return (plan.host.accumulators > 0 and not plan.gpu_accumulation and not plan.blockwise_backward
            and not plan.gradient_spares and not plan.pooled_grads
            and plan.resident_blocks < len(plan.tiers))


OVER_GPU_BUDGET = (" (over the budget as counted: the measured activations include what the allocator held cached at "
                   "the peak; the placement runs as built)")


def table(plan: Plan) -> str:
    """Tier per block range and per part outside the blocks, GPU / host GiB by part, floor terms."""
    lines = [f"{'blocks':<10}{'tier':<10}", "-" * 20]
    start = 0
    for i in range(1, len(plan.tiers) + 1):
        if i == len(plan.tiers) or plan.tiers[i] is not plan.tiers[start]:
            lines.append(f"{f'{start}-{i - 1}':<10}{plan.tiers[start].value:<10}")
            start = i
    for name, tier in plan.rest_tiers:
        where = ("weights on the GPU, fp32 master and moments on the host" if tier.value == "cached"
                 else "weights and states on the GPU")
        lines.append(f"{name:<10}{tier.value:<10}({where})")
    g, h, f = plan.gpu, plan.host, plan.floor
    cut = f" (rule wanted {plan.window_wanted}; GPU memory)" if plan.window_wanted > plan.window_size else ""
    lines += [
        f"resident_blocks {plan.resident_blocks}, window_size {plan.window_size}{cut}, lean_blocks "
        f"{plan.lean_blocks}{', streamed gradients accumulated on the GPU' if plan.gpu_accumulation else ''}"
        f"{', backward block by block (fp32 sums a step)' if plan.blockwise_backward else ''}"
        f"{', one gradient buffer a streamed block (host memory)' if _spares_dropped(plan) else ''}"
        f"{', compact fp32 masters (host memory)' if plan.compact_master else ''}"
        f"{', pooled gradient buffers (host memory)' if plan.pooled_grads else ''}, "
        "activations of "
        f"{plan.activation_blocks} blocks offloaded ({plan.activation_bytes_per_step / GIB:.2f} GiB each way "
        "per step)",
        f"GPU  {g.peak / GIB:.2f} + margin {g.margin / GIB:.2f} of {plan.gpu_budget_bytes / GIB:.2f} GiB: "
        f"resident {g.resident / GIB:.2f}, rest {g.rest / GIB:.2f}, window {g.window / GIB:.2f}, "
        f"transients {g.transients / GIB:.2f}, activations {g.activations / GIB:.2f}, "
        f"streamed accumulators {g.accumulators / GIB:.2f}"
        f"{OVER_GPU_BUDGET if g.needed > plan.gpu_budget_bytes else ''}",
        f"host {h.total / GIB:.2f} + margin {h.margin / GIB:.2f} of {plan.host_budget_bytes / GIB:.2f} GiB: "
        f"master+moments {h.master_and_moments / GIB:.2f}, working {h.working / GIB:.2f}, "
        f"grads {h.grads / GIB:.2f}, accumulators {h.accumulators / GIB:.2f}; process peak RSS "
        f"{plan.host_rss_bytes / GIB:.2f}",
        f"floor s/step: gpu {f.gpu_s:.4f}, h2d {f.h2d_s:.4f}, d2h {f.d2h_s:.4f}, cpu adam {f.cpu_adam_s:.4f}, "
        f"host memory {f.host_memory_s:.4f}, activations h2d {f.activation_h2d_s:.4f} d2h "
        f"{f.activation_d2h_s:.4f}, nvme {f.nvme_s:.4f}, cpu tail {f.cpu_tail_s:.4f} -> predicted "
        f"{plan.predicted_step_s:.4f}",
    ]
    if plan.drive is not None:
        d = plan.drive
        lines.append(
            f"nvme {plan.nvme_blocks} blocks: {plan.nvme_bytes_per_step / 2 / GIB:.2f} GiB of states on the drive "
            f"({d.free_bytes / GIB:.2f} free), read and written once a step at {d.read_bytes_per_s / 1e9:.2f} / "
            f"{d.write_bytes_per_s / 1e9:.2f} GB/s measured, {min(d.slots, plan.nvme_blocks)} host staging buffers")
    return "\n".join(lines)


def drive_space_message(drive: Drive, blocks: int, nvme_bytes: int) -> str:
    return (f"stronghold's placement needs the states of {blocks} blocks on the NVMe drive (\"nvme_path\"), "
            f"{_gib(nvme_bytes)} GiB, but the drive has {_gib(drive.free_bytes)} GiB free. To fit: free space on the "
            "drive or point nvme_path at a larger one, or give the host more memory (\"host_memory_limit_gb\") so "
            "fewer blocks go there.")


def drive_speed_message(drive: Drive, blocks: int, nvme_bytes: int, seconds: float) -> str:
    return (f"stronghold's NVMe tier is too slow on this drive for the plan: the states of {blocks} blocks, "
            f"{_gib(nvme_bytes)} GiB, read and written once a step at the measured {drive.read_bytes_per_s / 1e6:.1f} "
            f"MB/s read and {drive.write_bytes_per_s / 1e6:.1f} MB/s write take {seconds:.0f} s a step, more than the "
            f"{drive.max_io_s:g} s \"stall_timeout_s\" that a wait for the step's last update may take. To fit: "
            "point \"nvme_path\" at a faster (local NVMe) drive, give the host more memory so fewer blocks go there, "
            "or raise \"stall_timeout_s\".")


HELD_NAMED_BYTES = 64 * 2 ** 20
"""What the process holds on the GPU outside the model is named in a refusal from this many bytes up (below it, the
CUDA context's and libraries' own allocations)."""


def _held(budgets: Budgets) -> str:
    """The part of a GPU refusal that names what the process already held beside the model, and how to free it."""
    if budgets.gpu_held_bytes < HELD_NAMED_BYTES:
        return ""
    return (f", after the {_gib(budgets.gpu_held_bytes)} GiB this process already holds on the GPU outside the model "
            "(its own tensors, or an engine built before and not destroyed: call engine.destroy() on it, or del the "
            "tensors, before building this one)")


def gpu_message(budgets: Budgets, resident: int, gpu: GpuBytes, overridden: bool, block_gpu_bytes: int,
                rest_on_gpu: bool = False) -> str:
    """No placement fits the GPU; `block_gpu_bytes`: what one more resident block needs there; `rest_on_gpu`: parts
    outside the blocks with trainable parameters were kept resident."""
    advice = (f"lower \"resident_blocks\" (each resident block needs about {_gib(block_gpu_bytes)} GiB) or "
              "\"window_size\", ") if overridden else ""
    if rest_on_gpu:
        advice += ("set \"rest_placement\" to \"auto\" or \"host\" (the fp32 master and AdamW moments of the "
                   "embeddings and head then live on the host), ")
    if gpu.accumulators:  # only a forced "gpu_accumulation": true gets here with accumulators (auto drops them first)
        advice += (f"set \"gpu_accumulation\" to false or \"auto\" (the streamed accumulators, {_gib(gpu.accumulators)} "
                   "GiB, are then summed in host memory), ")
    return (f"stronghold's placement does not fit the GPU: resident_blocks={resident} needs {_gib(gpu.needed)} GiB "
            f"(resident blocks {_gib(gpu.resident)}, rest of the model {_gib(gpu.rest)}, window {_gib(gpu.window)}, "
            f"transients {_gib(gpu.transients)}, activations {_gib(gpu.activations)}, streamed accumulators "
            f"{_gib(gpu.accumulators)}, margin {_gib(gpu.margin)}) "
            f"but the GPU budget is {_gib(budgets.gpu_bytes)} GiB{_held(budgets)}. To fit: {advice}use a smaller "
            "micro-batch or sequence length, turn on gradient checkpointing or \"offload_activations\" (activations), "
            "or raise the GPU cap (\"gpu_memory_limit_gb\") / use a larger GPU.")


def host_message(budgets: Budgets, resident: int, streamed_blocks: int, host: HostBytes, saved_bytes: int,
                 block_gpu_bytes: int, lean: int = 0, lean_possible: bool = False, nvme: int = 0,
                 compact: bool = False, pooled: bool = False) -> str:
    """No placement fits host memory; `saved_bytes`: the host one more resident block frees; `lean`: lean
    blocks counted (their gradients land in the working copy); `compact`: with compact masters; `pooled`: with pooled
    landing buffers."""
    lean_text = f", {lean} of them lean" if lean else ""
    lean_text += ", with compact fp32 masters" if compact else ""
    lean_text += ", with pooled gradient buffers" if pooled else ""
    lean_text += f", {nvme} of them with their states on the NVMe drive" if nvme else ""
    if not lean_possible:
        lean_text += (" (the lean tier, 2 bytes less per parameter, needs bf16/fp16 without gradient "
                      "accumulation on one rank)")
    return (f"stronghold's placement does not fit host memory: {streamed_blocks} streamed blocks{lean_text} "
            f"with resident_blocks={resident} need {_gib(host.needed)} GiB (fp32 master + Adam moments "
            f"{_gib(host.master_and_moments)}, working copies {_gib(host.working)}, gradient buffers "
            f"{_gib(host.grads)}, accumulators {_gib(host.accumulators)}, margin {_gib(host.margin)}) but the host "
            f"budget is {_gib(budgets.host_bytes)} GiB"
            f"{f' (host_memory_limit_gb={budgets.host_limit_gb:g})' if budgets.host_limit_gb is not None else ''}. "
            f"To fit: free or add host RAM (or raise the limit), {'' if budgets.drive else NVME_ADVICE}"
            "keep more blocks resident "
            f"(each saves about {_gib(saved_bytes)} GiB of host; the GPU must hold about {_gib(block_gpu_bytes)} GiB "
            "more each: raise the GPU cap or shrink activations), or train a smaller model.")


def over_budget(built: int, fitting: Optional[int], plan: Plan, configured: bool = False) -> str:
    """The first step measured more than the placement built at start-up leaves room for: `built` resident blocks,
    of which `fitting` would fit as measured (None: none found), `plan` the placement as it runs; `configured`: the
    config set resident_blocks."""
    if fitting is not None:
        fix = f"start it with \"resident_blocks\": {fitting} in the stronghold section, the most that fit as measured"
    else:
        lower = "lower \"resident_blocks\" in the stronghold section, " if configured else ""
        fix = lower + "use a smaller micro-batch or sequence length, or raise the GPU cap (\"gpu_memory_limit_gb\")"
    return (f"the first step measured more GPU memory than the start-up placement leaves: its {built} resident blocks "
            f"with {_gib(plan.gpu.activations)} GiB of activations (as measured, with the allocator's cache) need "
            f"{_gib(plan.gpu.needed)} GiB of the {_gib(plan.gpu_budget_bytes)} GiB budget. Resident blocks do not go "
            f"back to the host during a run, so it runs on as built and may run out of GPU memory; if it does, {fix}.")
