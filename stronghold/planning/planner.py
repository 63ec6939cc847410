"""Placement planner: how many leading blocks stay resident on the GPU and how many window slots the
streamed rest gets, chosen from the GPU and host budgets. Pure: plain numbers in, a frozen `Plan` out
(no torch, no device or psutil calls), so every rule is unit-tested without a GPU.

The byte accounting (plan_bytes.py) mirrors the engine as built; the parts outside the blocks, resident or cached,
are plan_rest.py's, the step-time floor that ranks placements plan_floor.py's. The inputs and the Plan are
plan_types.py's, the Plan plan_result.py's (both re-exported here, so `planner.Plan` etc. stay the one place to
import from).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from stronghold.planning import plan_rest, plan_text
from stronghold.planning.plan_bytes import block_gpu_bytes, drive_bytes, gpu_bytes, host_bytes
from stronghold.planning.plan_floor import FORWARD_SHARE, floor_terms as _floor
from stronghold.planning.plan_floor import wanted_window as _wanted_window
from stronghold.planning.plan_search import BLOCK_TIME_LOW, choose, largest_fitting_window
from stronghold.planning.plan_result import FloorTerms, GpuBytes, HostBytes, Plan
from stronghold.planning.plan_types import (ACTIVATION_PREFETCH_BLOCKS, ADAM_HOST_BYTES, COMPUTE_BYTES,
                                            DEFAULT_GPU_MARGIN_FRACTION, DEFAULT_GPU_MARGIN_MIN_BYTES,
                                            DEFAULT_HOST_MARGIN_FRACTION, FP32_BYTES, GIB, MAX_WINDOW, MIN_WINDOW,
                                            MOMENTS_BYTES, Activations, BlockSpec, Budgets, Drive, ModelSpec,
                                            PartSpec, Rates, Tier, _require)

__all__ = ["plan", "Activations", "BlockSpec", "Budgets", "Drive", "FloorTerms", "GpuBytes", "HostBytes", "ModelSpec",
           "PartSpec", "Plan", "Rates", "Tier", "ACTIVATION_PREFETCH_BLOCKS", "COMPUTE_BYTES",
           "DEFAULT_GPU_MARGIN_FRACTION", "DEFAULT_GPU_MARGIN_MIN_BYTES", "DEFAULT_HOST_MARGIN_FRACTION", "FP32_BYTES",
           "GIB", "MAX_WINDOW", "MIN_WINDOW", "MOMENTS_BYTES", "ADAM_HOST_BYTES", "FORWARD_SHARE"]


# The plan -----------------------------------------------------------------------------------------
def plan(model: ModelSpec, activations: Activations, budgets: Budgets, rates: Rates, *,
         resident_blocks: Optional[int] = None, window_size: Optional[int] = None,
         activation_blocks: Optional[int] = 0, lean_blocks: Optional[int] = 0,
         lean_until: Optional[int] = None, gpu_accumulation: Optional[bool] = False,
         rest_tiers: plan_rest.RestTiers = Tier.RESIDENT, gradient_spares: Optional[bool] = True,
         nvme_blocks: Optional[int] = None, nvme_from: Optional[int] = None, nvme_shrink: bool = False,
         compact_master: Optional[bool] = False, pooled_grads: Optional[bool] = False,
         blockwise: bool = False) -> Plan:
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

    `compact_master`: the streamed blocks in host memory keep compact masters (streaming/compact.py: 2 bytes a parameter
    less; a redo or undo merges and splits it, the update runs on its halves); None: only where nothing else fits (after
    the spares and lean blocks), where possible (bf16, no lean block).

    `pooled_grads`: with host accumulation, the streamed blocks share a few landing buffers, without spares
    (streaming/grad_pool.py: backward runs only a few blocks ahead of the CPU's sums); None: only where nothing else
    fits (after compact masters), where possible (accumulation, one process).

    `blockwise`: the blockwise backward (engine/blockwise.py) builds the stores: one fp32 gradient buffer a streamed
    block and for a cached input part, no host accumulator, no spare, no pooled buffer (plan_bytes.host_bytes). The
    floor stays host accumulation's (plan_blockwise.py has the schedule's own, not yet weighed here).

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
    _require(not (blockwise and gpu_accumulation), "stronghold.blockwise_backward needs gpu_accumulation off (the "
             "blockwise backward sums on the GPU block by block); set \"gpu_accumulation\" to false or \"auto\"")
    _require(not (blockwise and pooled_grads), "stronghold.blockwise_backward needs pooled_grads off (it sends each "
             "block's gradient once a step, with no pooled buffers); set \"pooled_grads\" to false or \"auto\"")
    _require(not gpu_accumulation or possible,
             f"gpu_accumulation needs gradient accumulation on one rank (here: accumulation "
             f"{model.accumulation_steps}, {budgets.local_ranks} ranks on the node); set \"gpu_accumulation\" to "
             "\"auto\" or false")
    _require(not nvme_blocks or budgets.drive is not None, f"nvme_blocks {nvme_blocks} needs a drive (nvme_path)")
    _require(not compact_master or compact_possible(model, budgets),
             f"compact_master needs a bf16 run (here: {model.compute_bytes}-byte compute dtype"
             f"{', fp16' if model.compute_bytes == 2 and not model.bf16 else ''}); set \"compact_master\" to \"auto\" "
             "or false")
    compact = (False, True) if compact_master is None and compact_possible(model, budgets) else (bool(compact_master),)
    if budgets.local_ranks > 1 and model.accumulation_steps > 1:
        gradient_spares = True  # sharded stores always have them (sharding.py)
    _require(not pooled_grads or pooled_possible(model, budgets),
             f"pooled_grads needs gradient accumulation in one process (here: accumulation {model.accumulation_steps}, "
             f"{budgets.local_ranks} ranks on the node); set \"pooled_grads\" to \"auto\" or false")
    pooled = ((False, True) if pooled_grads is None and pooled_possible(model, budgets) and not blockwise
              else (bool(pooled_grads),))
    lean = _LeanRule(lean_blocks, lean_until, lean_possible(model, budgets))
    nvme = _NvmeRule(nvme_blocks, nvme_from, budgets.drive is not None, nvme_shrink)
    counts = range(n + 1) if activation_blocks is None else (min(activation_blocks, n),)
    modes = (False, True) if gpu_accumulation is None and possible and not blockwise else (bool(gpu_accumulation),)
    options = plan_rest.tier_options(model, rest_tiers)
    # Only where the rest was kept resident by choice does the advice name "rest_placement".
    rest_advice = options == [frozenset()] and rest_tiers is not None
    best: list[Plan] = []
    errors: list[MemoryError] = []
    for cached in options:
        plans: list[Plan] = []
        error: Optional[MemoryError] = None
        for mode in modes:
            for offloaded in counts:
                try:
                    plans.append(_plan_at(model, activations, budgets, rates, resident_blocks, window_size, offloaded,
                                          lean, mode, cached, rest_advice, gradient_spares, nvme, compact,
                                          pooled, blockwise))
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


def compact_possible(model: ModelSpec, budgets: Budgets) -> bool:
    """A compact master's high half is the bf16 working copy (with data parallel: the rank's shard of the shared
    one)."""
    return model.compute_bytes == 2 and model.bf16


def pooled_possible(model: ModelSpec, budgets: Budgets) -> bool:
    """Pooled landing buffers serve host accumulation; data-parallel stores are not built pooled."""
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
             nvme: _NvmeRule = _NvmeRule(0, None, False), compact: tuple[bool, ...] = (False,),
             pooled: tuple[bool, ...] = (False,), blockwise: bool = False) -> Plan:
    """Without accumulation: the most resident blocks that fit, with the window rule's slots (or fewer).
    With accumulation and the window "auto": each residency's largest window that fits, and with the residency
    "auto" too, among them the most resident blocks whose predicted step is within SEARCH_TOLERANCE of the fastest.
    Slots are then a cache across the micro-steps (_walk): one costs 1/8 of a resident block (bf16) and saves two
    copies a pass."""
    n = len(model.blocks)
    candidates = range(n, -1, -1) if resident_blocks is None else (min(resident_blocks, n),)
    # With accumulation the slots are a cache across the micro-steps: take each residency's largest window that
    # fits, also where the residency is given (a re-plan keeps the residency the first forward built).
    cache = window_size is None and model.accumulation_steps > 1
    search = resident_blocks is None and cache
    tried: Optional[GpuBytes] = None
    found: list[Plan] = []
    for resident in candidates:
        streamed = n - resident
        wanted = _wanted_window(model, rates, resident)
        smallest = min(MIN_WINDOW, streamed)
        if window_size is not None:
            windows = [min(window_size, streamed)]
        elif cache:
            largest = largest_fitting_window(
                lambda w: gpu_bytes(model, activations, budgets, resident, w, offloaded, gpu_accumulation,
                                    cached).needed <= budgets.gpu_bytes, smallest, streamed)
            windows = [smallest if largest is None else largest]
        else:
            windows = range(wanted, smallest - 1, -1)
        for window in windows:
            gpu = gpu_bytes(model, activations, budgets, resident, window, offloaded, gpu_accumulation, cached)
            tried = gpu
            if gpu.needed > budgets.gpu_bytes:
                continue
            try:
                plan_ = dataclasses.replace(
                    _finish(model, budgets, rates, resident, window, wanted, gpu,
                            activations.per_block_bytes * offloaded * model.accumulation_steps, lean,
                            gpu_accumulation, cached, spares, nvme, compact, pooled, blockwise),
                    activation_blocks=offloaded)
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


def _drives(drive: Optional[Drive], on_drive: int) -> tuple[Optional[Drive], ...]:
    """The drive with each staging buffer count the plan may take for `on_drive` blocks (most first), as the plan
    records it (the most where no block goes there)."""
    if drive is None:
        return (drive,)
    choices = drive.slot_choices() if on_drive else drive.slot_choices()[:1]
    return tuple(dataclasses.replace(drive, slots=slots, fewer_slots=False) for slots in choices)


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
            nvme_rule: _NvmeRule = _NvmeRule(0, None, False), compact_choices: tuple[bool, ...] = (False,),
            pooled_choices: tuple[bool, ...] = (False,), blockwise: bool = False) -> Plan:
    n = len(model.blocks)
    spare_choices = (True, False) if spares is None else (spares,)

    def fitting():
        # The fewest NVMe blocks first (each costs drive traffic every step), then full masters, then each block's
        # own landing buffer, then the most staging buffers, then spares kept, then the fewest lean (a compact
        # master's store is never lean; pooled buffers serve host accumulation without spares).
        host = None
        for on_drive in nvme_rule.counts(resident, n - resident):
            for pool, compact in ((p, c) for p in pooled_choices for c in compact_choices):
                for drive in _drives(budgets.drive, on_drive):
                    with_drive = dataclasses.replace(budgets, drive=drive)
                    for spare in spare_choices:
                        for lean in lean_rule.counts(resident, n - resident):
                            if (compact and lean) or (pool and (spare or gpu_accumulation or blockwise)):
                                continue
                            host = host_bytes(model, with_drive, resident, lean, gpu_accumulation, cached, spare,
                                              on_drive, compact, pool, blockwise)
                            if host.needed <= budgets.host_bytes:
                                return host, spare, lean, on_drive, compact, pool, drive
        if host is None:  # a built layout's lean blocks below this residency, with its compact masters
            raise MemoryError(f"no placement keeps the built layout at {resident} resident blocks: the {lean} "
                              "streamed blocks after them would be lean, which rules out the compact masters it keeps; "
                              "keep more blocks resident")
        return host, spare, lean, on_drive, compact, pool, drive, None

    found = fitting()
    host, spare, lean, on_drive, compact, pool, drive = found[:7]
    if len(found) == 8:  # `host` as last tried: with `drive`'s staging buffers, which the saving is counted with too
        saved = host.total - host_bytes(model, dataclasses.replace(budgets, drive=drive), resident + 1, lean,
                                        gpu_accumulation, cached, spare, max(0, on_drive - 1), compact, pool,
                                        blockwise).total
        raise MemoryError(plan_text.host_message(budgets, resident, n - resident, host, saved,
                                                 block_gpu_bytes(model), lean, lean_rule.possible, on_drive, compact,
                                                 pool))
    nvme_bytes = drive_bytes(model, resident, on_drive, compact)
    nvme_s = 0.0
    if on_drive:
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
                gpu_accumulation=gpu_accumulation and resident < n, blockwise_backward=blockwise,
                compact_master=compact and resident < n,
                pooled_grads=pool and resident < n,
                gradient_spares=(spare and model.accumulation_steps > 1 and not gpu_accumulation and not blockwise
                                 and (resident < n or bool(cached))),
                rest_tiers=tuple((p.name, Tier.CACHED if p.name in cached else Tier.RESIDENT)
                                 for p in model.rest_parts),
                nvme_blocks=on_drive, nvme_bytes_per_step=2 * nvme_bytes, drive=drive)
