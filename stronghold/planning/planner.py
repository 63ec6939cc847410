"""Placement planner: how many leading blocks stay resident on the GPU and how many window slots the
streamed rest gets, chosen from the GPU and host budgets. Pure: plain numbers in, a frozen `Plan` out
(no torch, no device or psutil calls), so every rule is unit-tested without a GPU.

The byte accounting (plan_bytes.py) mirrors the engine as built; the parts outside the blocks, resident or cached,
are plan_rest.py's. Floor terms (docs/architecture.md): a step takes at least the slowest of GPU compute, H2D, D2H
and the CPU AdamW of the streamed blocks. The inputs and the Plan are plan_types.py's (re-exported here, so
`planner.Plan` etc. stay the one place to import from).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from stronghold.planning import plan_rest, plan_text
from stronghold.planning.plan_bytes import block_gpu_bytes, drive_bytes, gpu_bytes, host_bytes
from stronghold.planning.plan_search import BLOCK_TIME_LOW, cache_windows, choose
from stronghold.planning.plan_types import (ACCUMULATE_COST_VS_ADAM, ACCUMULATE_HOST_BYTES, ACTIVATION_PREFETCH_BLOCKS,
                         ADAM_HOST_BYTES, COMPUTE_BYTES, DEFAULT_GPU_MARGIN_FRACTION, DEFAULT_GPU_MARGIN_MIN_BYTES,
                         DEFAULT_HOST_MARGIN_FRACTION, FP32_BYTES, GIB, MAX_WINDOW, MIN_WINDOW, MOMENTS_BYTES,
                         Activations, BlockSpec, Budgets, Drive, FloorTerms, GpuBytes, HostBytes, ModelSpec, PartSpec, Plan,
                         Rates, Tier, _require)

__all__ = ["plan", "Activations", "BlockSpec", "Budgets", "Drive", "FloorTerms", "GpuBytes", "HostBytes", "ModelSpec",
           "PartSpec", "Plan", "Rates", "Tier", "ACTIVATION_PREFETCH_BLOCKS", "COMPUTE_BYTES",
           "DEFAULT_GPU_MARGIN_FRACTION", "DEFAULT_GPU_MARGIN_MIN_BYTES", "DEFAULT_HOST_MARGIN_FRACTION", "FP32_BYTES",
           "GIB", "MAX_WINDOW", "MIN_WINDOW", "MOMENTS_BYTES"]


FORWARD_SHARE = 0.25
"""The forward's share of a checkpointed pass (forward, recompute, backward at twice the forward)."""


def _wanted_window(model: ModelSpec, rates: Rates, resident: int) -> int:
    """The fewest slots that hide one block's H2D behind compute: when block i leaves, its slot takes
    block i+W, which has the compute of the W-1 blocks in between to land, so W-1 >= ceil(h2d / compute).

    The compute per block is the whole pass (gpu_s_per_block). The forward walk alone gives a block
    only its forward (~1/3 of that), but a window cannot fix a per-block deficit there: the copy stream
    is then the bottleneck whatever W is (the h2d floor term shows it), and extra slots only bank lead
    that the longer backward walk would give back anyway. No +1 for jitter: a slot costs 1/8 of a
    resident block (bf16), and resident blocks remove transfers outright."""
    streamed = model.blocks[resident:]
    if not streamed:
        return 0
    h2d_s = max(b.numel for b in streamed) * model.compute_bytes / rates.h2d_bytes_per_s
    # The tolerance keeps an exact ratio (2.0 computed as 2.0000000001) from asking for one more slot.
    ahead = math.ceil(h2d_s / rates.gpu_s_per_block * (1 - 1e-9))
    return min(len(streamed), max(MIN_WINDOW, min(MAX_WINDOW, 1 + ahead)))


def _walk(model: ModelSpec, rates: Rates, resident: int, window: int) -> tuple[float, int]:
    """GPU seconds of one optimizer step's walks with their weight copies, and the H2D bytes per step.

    schedule.keep_after_forward keeps the last W streamed blocks for backward, so backward loads the other
    S - W. Forward loads every streamed block in a pass that follows an update; its first W can land
    during the resident blocks' forward (the lead). In the later passes of accumulation the first W are
    still in their slots from the backward before (window.py takes them back without a copy), so forward
    loads S - W, with no lead: every slot is busy until the first streamed block is done. A walk over the
    streamed blocks takes its compute or its copies, whichever is longer: a forward is a quarter of a
    checkpointed pass (FORWARD_SHARE), so its copies are the likelier bound; more slots remove copies."""
    cb, passes, n = model.compute_bytes, model.accumulation_steps, len(model.blocks)
    streamed = model.blocks[resident:]
    s = len(streamed)
    if not s:
        return passes * (rates.gpu_s_fixed + n * rates.gpu_s_per_block), 0
    forward = FORWARD_SHARE * rates.gpu_s_per_block
    backward = rates.gpu_s_per_block - forward

    def nbytes(blocks) -> int:
        return cb * sum(b.numel for b in blocks)

    back_bytes = nbytes(streamed[:s - window])
    first_bytes, cached_bytes = nbytes(streamed), nbytes(streamed[window:])
    lead = min(resident * forward, nbytes(streamed[:window]) / rates.h2d_bytes_per_s)

    def one_pass(forward_bytes: int, lead_s: float) -> float:
        walk_forward = max(s * forward, forward_bytes / rates.h2d_bytes_per_s - lead_s)
        walk_backward = max(s * backward, back_bytes / rates.h2d_bytes_per_s)
        return rates.gpu_s_fixed + resident * rates.gpu_s_per_block + walk_forward + walk_backward

    walk_s = one_pass(first_bytes, lead) + (passes - 1) * one_pass(cached_bytes, 0.0)
    return walk_s, first_bytes + back_bytes + (passes - 1) * (cached_bytes + back_bytes)


def _floor(model: ModelSpec, rates: Rates, resident: int, window: int,
           activation_bytes: int = 0, lean: int = 0, gpu_accumulation: bool = False,
           cached: frozenset[str] = frozenset(), nvme_s: float = 0.0) -> tuple[FloorTerms, int, int]:
    """`activation_bytes`: offloaded activation bytes per step, each way; `lean`: lean blocks (their
    updates wait for step(), so their CPU time overlaps the next forward instead of backward);
    `gpu_accumulation`: the streamed gradients go down once per step, as fp32 sums, and the CPU does
    no accumulation pass; `cached`: the parts outside the blocks in the cached tier (plan_rest.cached_terms)."""
    cb, passes = model.compute_bytes, model.accumulation_steps
    streamed = model.blocks[resident:]
    walk_s, h2d_bytes = _walk(model, rates, resident, window)
    rest = plan_rest.cached_terms(model, rates, cached)
    walk_s += rest.h2d_s
    h2d_bytes += rest.h2d_bytes
    on_gpu = (sum(p.trainable_numel for p in plan_rest.split(model, cached)[0])
              + sum(b.trainable_numel for b in model.blocks[:resident]))
    gpu_adam_s = on_gpu / rates.gpu_adam_params_per_s if rates.gpu_adam_params_per_s else 0.0
    walk_s += gpu_adam_s
    trainable = sum(b.trainable_numel for b in streamed)
    # With accumulation on the GPU a streamed gradient goes down once per step as an fp32 sum; otherwise
    # every pass's goes down in the compute dtype and the CPU sums it into the fp32 accumulator
    # (cpu_optim.py), the boundary pass included, before the one AdamW pass.
    grad_bytes = FP32_BYTES if gpu_accumulation else cb
    d2h_bytes = grad_bytes * trainable * (1 if gpu_accumulation else passes) + rest.d2h_bytes
    host_accumulates = passes > 1 and not gpu_accumulation
    accumulate = ACCUMULATE_COST_VS_ADAM if host_accumulates else 0.0
    tail = 0.0
    if streamed:
        # Backward ends with the resident blocks, so the first streamed block's gradients are the last
        # to reach the CPU; its update and its H2D must finish before the next forward reaches it.
        # What covers that chain is the resident blocks' backward and their next forward (together
        # R x gpu_s_per_block). The embeddings are too short to count; the head and loss run at the
        # turn from forward to backward, before the chain starts.
        last = streamed[0]
        chain = (last.trainable_numel * grad_bytes / rates.d2h_bytes_per_s
                 + last.trainable_numel * (1 + accumulate) / rates.cpu_adam_params_per_s
                 + last.numel * cb / rates.h2d_bytes_per_s)
        tail = max(0.0, chain - resident * rates.gpu_s_per_block)
    tail = max(tail, rest.tail_s)
    host_memory_s = 0.0
    if rates.host_memory_bytes_per_s is not None:
        # ADAM_HOST_BYTES counts a bf16 gradient read; an fp32 window sum is 2 bytes more.
        cpu_bytes = trainable * (ADAM_HOST_BYTES + (passes * ACCUMULATE_HOST_BYTES if host_accumulates else 0)
                                 + grad_bytes - cb) + rest.host_memory_bytes
        moved = h2d_bytes + d2h_bytes + 2 * activation_bytes + cpu_bytes
        host_memory_s = moved / rates.host_memory_bytes_per_s
    terms = FloorTerms(
        gpu_s=passes * (rates.gpu_s_fixed + len(model.blocks) * rates.gpu_s_per_block) + gpu_adam_s,
        h2d_s=h2d_bytes / rates.h2d_bytes_per_s, d2h_s=d2h_bytes / rates.d2h_bytes_per_s,
        cpu_adam_s=(trainable * (1 + passes * accumulate) + rest.cpu_params) / rates.cpu_adam_params_per_s,
        cpu_tail_s=0.0,
        host_memory_s=host_memory_s, walk_s=walk_s, activation_h2d_s=activation_bytes / rates.h2d_bytes_per_s,
        activation_d2h_s=activation_bytes / rates.d2h_bytes_per_s, nvme_s=nvme_s)
    lean_numel = sum(b.trainable_numel for b in streamed[:lean])
    # The cached parts' updates are deferred by clipping as the blocks' are (cpu_optim.py treats them alike).
    trainable += sum(p.trainable_numel for p in plan_rest.split(model, cached)[1])
    deferred = max(lean_numel, rates.deferred_share * trainable)
    if deferred:
        # The CPU updates the other streamed blocks during backward and the deferred ones (lean blocks, and
        # those clipping holds back until the global norm is known, cpu_optim.py) after it, during the next
        # forward, in forward order, which waits for each: step ~ max(rest of the step, cpu other) +
        # max(one pass's forward, cpu deferred). The tail is what that adds to the overlapped terms.
        cpu_deferred = deferred / rates.cpu_adam_params_per_s
        cpu_other = (trainable / rates.cpu_adam_params_per_s) - cpu_deferred
        forward = FORWARD_SHARE * terms.gpu_s / passes
        serial = max(walk_s - forward, cpu_other) + max(forward, cpu_deferred)
        tail = max(tail, serial - terms.step_s)
    terms = dataclasses.replace(terms, cpu_tail_s=tail)
    return terms, h2d_bytes, d2h_bytes


# The plan -----------------------------------------------------------------------------------------
def plan(model: ModelSpec, activations: Activations, budgets: Budgets, rates: Rates, *,
         resident_blocks: Optional[int] = None, window_size: Optional[int] = None,
         activation_blocks: Optional[int] = 0, lean_blocks: Optional[int] = 0,
         lean_until: Optional[int] = None, gpu_accumulation: Optional[bool] = False,
         rest_tiers: plan_rest.RestTiers = Tier.RESIDENT, gradient_spares: Optional[bool] = True,
         nvme_blocks: Optional[int] = None, nvme_from: Optional[int] = None, nvme_shrink: bool = False) -> Plan:
    """The placement with the most resident blocks that fits both budgets.

    Residency first: every resident block removes its two H2D loads, its D2H and its CPU update, so
    the largest R whose GPU peak fits wins. The host need only grows as R falls, so if the host
    cannot hold the streamed blocks at that R, no plan fits. Within an R the window rule's W is
    shrunk (down to 2) before R is given up, because slots only hide latency while a resident block
    removes work. `resident_blocks` / `window_size` given as numbers are kept (clamped to the block
    and streamed counts as the runtime does) and only checked. Raises MemoryError with the numbers
    when nothing fits, ValueError for bad overrides.

    `activation_blocks`: leading blocks whose per-block activations go to the host (a number, kept);
    None: the fewest that let a plan fit, so a run that fits without offload keeps today's plan and
    offload only buys the sequence length that would not fit otherwise (each offloaded block adds
    its activations to both copy directions, which a resident block does not save).

    `lean_blocks`: leading streamed blocks in the lean tier (Tier.LEAN: no host gradient buffer, 2 bytes
    less per parameter; updates after backward); None: the fewest that make host memory fit, where the
    lean tier is possible (2-byte compute dtype, no accumulation, one rank per node). `lean_until`
    instead: blocks below this index are lean wherever they are streamed (a built runtime's layout).

    `gpu_accumulation`: with gradient accumulation, sum the streamed gradients on the GPU (device_accum.py:
    fp32 accumulators there, one fp32 D2H and no CPU accumulation pass per step); None: plan both ways and
    keep the faster predicted step (within SEARCH_TOLERANCE, the one with more resident blocks: the host way,
    which leaves more of the GPU to them; so on a tie too).

    `rest_tiers`: the tier of each part outside the blocks (ModelSpec.rest_parts), RESIDENT or CACHED (weights on the
    GPU, fp32 master and moments on the host: plan_rest.py); None, for every part or a part's entry: plan each
    combination and keep the best of each, then the fastest prediction, within SEARCH_TOLERANCE the one with the
    most of the rest resident (plan_rest.most_resident_rest). The default keeps the rest resident.

    `gradient_spares`: with host accumulation, a second gradient buffer per streamed block (store.py); None: kept
    where host memory holds them at a residency, dropped where it fits only without them (2 bytes a parameter less
    in bf16, before lean blocks, which accumulation rules out anyway).

    `nvme_blocks`: the last streamed blocks whose fp32 state goes to `budgets.drive` (Tier.NVME); None: the fewest
    that make host memory fit (none without a drive). `nvme_from` instead: blocks from this index on are on the
    drive wherever they are streamed (a built runtime's layout); with `nvme_shrink` the first of them may come back
    to host memory (the fewest left on the drive that fit: runtime.states_to_host), none may go to the drive. Raises
    MemoryError when the drive has not the space and ValueError when its rates would make one step's NVMe traffic
    longer than `Drive.max_io_s`.
    """
    n = len(model.blocks)
    _require(resident_blocks is None or resident_blocks >= 0, f"resident_blocks must be >= 0, got {resident_blocks}")
    _require(window_size is None or window_size >= MIN_WINDOW,
             f"window_size must be >= {MIN_WINDOW} (one slot computing, one loading), got {window_size}")
    _require(activation_blocks is None or activation_blocks >= 0,
             f"activation_blocks must be >= 0, got {activation_blocks}")
    _require(lean_blocks is None or lean_blocks >= 0, f"lean_blocks must be >= 0, got {lean_blocks}")
    _require(not lean_blocks or lean_possible(model, budgets),
             f"lean_blocks {lean_blocks} needs a bf16/fp16 run without gradient accumulation on one rank (here: "
             f"{model.compute_bytes}-byte compute dtype, accumulation {model.accumulation_steps}, "
             f"{budgets.local_ranks} ranks on the node); set \"lean_blocks\" to \"auto\" or 0")
    possible = gpu_accumulation_possible(model, budgets)
    _require(not gpu_accumulation or possible,
             f"gpu_accumulation needs gradient accumulation on one rank (here: accumulation "
             f"{model.accumulation_steps}, {budgets.local_ranks} ranks on the node); set \"gpu_accumulation\" to "
             "\"auto\" or false")
    _require(not nvme_blocks or budgets.drive is not None, f"nvme_blocks {nvme_blocks} needs a drive (nvme_path)")
    lean = _LeanRule(lean_blocks, lean_until, lean_possible(model, budgets))
    nvme = _NvmeRule(nvme_blocks, nvme_from, budgets.drive is not None, nvme_shrink)
    counts = range(n + 1) if activation_blocks is None else (min(activation_blocks, n),)
    modes = (False, True) if gpu_accumulation is None and possible else (bool(gpu_accumulation),)
    options = plan_rest.tier_options(model, rest_tiers, budgets.local_ranks)
    # Only where the rest was kept resident by choice does the advice name "rest_placement".
    rest_advice = options == [frozenset()] and rest_tiers is not None and budgets.local_ranks == 1
    best: list[Plan] = []
    errors: list[MemoryError] = []
    for cached in options:
        plans: list[Plan] = []
        error: Optional[MemoryError] = None
        for mode in modes:
            for offloaded in counts:
                try:
                    plans.append(_plan_at(model, activations, budgets, rates, resident_blocks, window_size, offloaded,
                                          lean, mode, cached, rest_advice, gradient_spares, nvme))
                    break
                except MemoryError as err:
                    error = error or err
        if plans:
            best.append(_most_resident_of_the_fastest(plans, model, rates))  # max keeps the first (host) of equals
        else:
            errors.append(error)
    if not best:
        if len(errors) == 1:
            raise errors[0]
        # The attempt that offloads the most leads: what it lacks is what binds (a user whose host is too small
        # must not read first that the parts kept on the GPU do not fit the card).
        raise MemoryError(f"{errors[-1]} (That is with the fp32 master and moments of the parts outside the blocks "
                          f"on the host, \"rest_placement\" \"host\"; with them on the GPU: {errors[0]})")
    return _most_resident_of_the_fastest(plan_rest.most_resident_rest(best, model), model, rates)


def gpu_accumulation_possible(model: ModelSpec, budgets: Budgets) -> bool:
    """Accumulation on the GPU needs accumulation, and one rank (data parallel reduces per micro-step)."""
    return model.accumulation_steps > 1 and budgets.local_ranks == 1


def lean_possible(model: ModelSpec, budgets: Budgets) -> bool:
    """The lean tier needs the working copy to be a separate 2-byte buffer (not the fp32 master), one
    gradient per step (an accumulator would need the gradients of each pass) and unsharded states."""
    return model.compute_bytes == 2 and model.accumulation_steps == 1 and budgets.local_ranks == 1


@dataclasses.dataclass(frozen=True)
class _LeanRule:
    blocks: Optional[int]
    until: Optional[int]
    possible: bool

    def counts(self, resident: int, streamed: int) -> range:
        """Lean counts to try at this residency, fewest first."""
        if self.until is not None:
            fixed = max(0, min(self.until - resident, streamed))
            return range(fixed, fixed + 1)
        if self.blocks is None:
            return range(0, streamed + 1 if self.possible else 1)
        return range(min(self.blocks, streamed), min(self.blocks, streamed) + 1)


@dataclasses.dataclass(frozen=True)
class _NvmeRule:
    blocks: Optional[int]
    start: Optional[int]
    possible: bool
    shrink: bool = False

    def counts(self, resident: int, streamed: int) -> range:
        """Counts of NVMe blocks (the last streamed ones) to try at this residency, fewest first."""
        if not self.possible:
            return range(0, 1)
        if self.start is not None:
            fixed = max(0, min(resident + streamed - max(self.start, resident), streamed))
            return range(0 if self.shrink else fixed, fixed + 1)
        if self.blocks is None:
            return range(0, streamed + 1)
        return range(min(self.blocks, streamed), min(self.blocks, streamed) + 1)


def _plan_at(model: ModelSpec, activations: Activations, budgets: Budgets, rates: Rates,
             resident_blocks: Optional[int], window_size: Optional[int], offloaded: int,
             lean: _LeanRule = _LeanRule(0, None, False), gpu_accumulation: bool = False,
             cached: frozenset[str] = frozenset(), rest_advice: bool = False, spares: Optional[bool] = True,
             nvme: _NvmeRule = _NvmeRule(0, None, False)) -> Plan:
    """Without accumulation: the most resident blocks that fit, with the window rule's slots (or fewer).
    With accumulation and both "auto": every residency's largest window that fits, and among them the most
    resident blocks whose predicted step is within SEARCH_TOLERANCE of the fastest. Slots are then a cache
    across the micro-steps (_walk): one costs 1/8 of a resident block (bf16) and saves two copies a pass."""
    n = len(model.blocks)
    candidates = range(n, -1, -1) if resident_blocks is None else (min(resident_blocks, n),)
    search = resident_blocks is None and window_size is None and model.accumulation_steps > 1
    tried: Optional[GpuBytes] = None
    found: list[Plan] = []
    for resident in candidates:
        streamed = n - resident
        wanted = _wanted_window(model, rates, resident)
        if window_size is not None:
            windows = [min(window_size, streamed)]
        else:
            windows = range(wanted, min(MIN_WINDOW, streamed) - 1, -1)
            if search:
                windows = sorted(set(windows) | cache_windows(wanted, streamed), reverse=True)
        for window in windows:
            gpu = gpu_bytes(model, activations, budgets, resident, window, offloaded, gpu_accumulation, cached)
            tried = gpu
            if gpu.needed > budgets.gpu_bytes:
                continue
            try:
                plan_ = dataclasses.replace(
                    _finish(model, budgets, rates, resident, window, wanted, gpu,
                            activations.per_block_bytes * offloaded * model.accumulation_steps, lean,
                            gpu_accumulation, cached, spares, nvme), activation_blocks=offloaded)
            except MemoryError:
                if not found:
                    raise
                return _most_resident_of_the_fastest(found, model, rates)  # fewer resident blocks need more host memory
            if not search:
                return plan_
            found.append(plan_)
            break  # at this residency, the largest window that fits is the fastest
    if found:
        return _most_resident_of_the_fastest(found, model, rates)
    rest_on_gpu = rest_advice and any(p.trainable_numel for p in plan_rest.split(model, cached)[0])
    raise MemoryError(plan_text.gpu_message(budgets, candidates[-1], tried, resident_blocks is not None,
                                            block_gpu_bytes(model), rest_on_gpu))


def _most_resident_of_the_fastest(plans: list[Plan], model: Optional[ModelSpec] = None,
                                  rates: Optional[Rates] = None) -> Plan:
    """plan_search.choose, ranking again with the blocks BLOCK_TIME_LOW as long where `model` and `rates` are given."""
    if model is None or rates is None:
        return choose(plans)
    low = dataclasses.replace(rates, gpu_s_per_block=rates.gpu_s_per_block * BLOCK_TIME_LOW,
                              gpu_s_fixed=rates.gpu_s_fixed * BLOCK_TIME_LOW)
    return choose(plans, lambda p: _floor(model, low, p.resident_blocks, p.window_size, p.activation_bytes_per_step,
                                          p.lean_blocks, p.gpu_accumulation, p.cached_parts, p.floor.nvme_s)[0].step_s)


def _finish(model: ModelSpec, budgets: Budgets, rates: Rates, resident: int, window: int, wanted: int,
            gpu: GpuBytes, activation_bytes: int, lean_rule: _LeanRule, gpu_accumulation: bool = False,
            cached: frozenset[str] = frozenset(), spares: Optional[bool] = True,
            nvme_rule: _NvmeRule = _NvmeRule(0, None, False)) -> Plan:
    n = len(model.blocks)
    spare_choices = (True, False) if spares is None else (spares,)

    def fitting():
        # The fewest NVMe blocks first (each costs drive traffic every step), then spares kept, then the fewest lean.
        for on_drive in nvme_rule.counts(resident, n - resident):
            for spare in spare_choices:
                for lean in lean_rule.counts(resident, n - resident):
                    host = host_bytes(model, budgets, resident, lean, gpu_accumulation, cached, spare, on_drive)
                    if host.needed <= budgets.host_bytes:
                        return host, spare, lean, on_drive
        return host, spare, lean, on_drive, None

    found = fitting()
    host, spare, lean, on_drive = found[:4]
    if len(found) == 5:
        saved = host.total - host_bytes(model, budgets, resident + 1, lean, gpu_accumulation, cached, spare,
                                        max(0, on_drive - 1)).total
        raise MemoryError(plan_text.host_message(budgets, resident, n - resident, host, saved,
                                                 block_gpu_bytes(model), lean, lean_rule.possible, on_drive))
    nvme_bytes = drive_bytes(model, resident, on_drive)
    nvme_s = 0.0
    if on_drive:
        drive = budgets.drive
        if nvme_bytes > drive.free_bytes:
            raise MemoryError(plan_text.drive_space_message(drive, on_drive, nvme_bytes))
        nvme_s = nvme_bytes / drive.read_bytes_per_s + nvme_bytes / drive.write_bytes_per_s
        if nvme_s > drive.max_io_s:
            raise ValueError(plan_text.drive_speed_message(drive, on_drive, nvme_bytes, nvme_s))
    floor, h2d_bytes, d2h_bytes = _floor(model, rates, resident, window, activation_bytes, lean, gpu_accumulation,
                                         cached, nvme_s)
    tiers = tuple(Tier.RESIDENT if i < resident else Tier.NVME if i >= n - on_drive else
                  Tier.LEAN if i < resident + lean else Tier.STREAMED for i in range(n))
    return Plan(resident_blocks=resident, window_size=window, window_wanted=wanted, tiers=tiers, gpu=gpu,
                host=host, floor=floor, h2d_bytes_per_step=h2d_bytes, d2h_bytes_per_step=d2h_bytes,
                gpu_budget_bytes=budgets.gpu_bytes, host_budget_bytes=budgets.host_bytes,
                host_process_bytes=budgets.host_process_bytes,
                activation_bytes_per_step=activation_bytes, lean_blocks=lean,
                gpu_accumulation=gpu_accumulation and resident < n,
                gradient_spares=(spare and model.accumulation_steps > 1 and not gpu_accumulation
                                 and (resident < n or bool(cached))),
                rest_tiers=tuple((p.name, Tier.CACHED if p.name in cached else Tier.RESIDENT)
                                 for p in model.rest_parts),
                nvme_blocks=on_drive, nvme_bytes_per_step=2 * nvme_bytes, drive=budgets.drive)
