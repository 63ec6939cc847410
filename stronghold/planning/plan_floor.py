"""The step-time floor of a placement (docs/architecture.md): a step takes at least the slowest of GPU compute (with
each walk's weight copies), H2D, D2H, the CPU AdamW of the streamed blocks and the bytes through host memory, plus
the CPU tail that nothing overlaps. The planner ranks placements by it. Pure."""
from __future__ import annotations

import dataclasses
import math

from stronghold.planning import plan_rest
from stronghold.planning.plan_result import FloorTerms
from stronghold.planning.plan_types import (ACCUMULATE_COST_VS_ADAM, ACCUMULATE_HOST_BYTES, ADAM_HOST_BYTES,
                                            FP32_BYTES, MAX_WINDOW, MIN_WINDOW, ModelSpec, Rates)

FORWARD_SHARE = 0.25
"""The forward's share of a checkpointed pass (forward, recompute, backward at twice the forward)."""


def wanted_window(model: ModelSpec, rates: Rates, resident: int) -> int:
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


def walk(model: ModelSpec, rates: Rates, resident: int, window: int) -> tuple[float, int]:
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


def floor_terms(model: ModelSpec, rates: Rates, resident: int, window: int,
           activation_bytes: int = 0, lean: int = 0, gpu_accumulation: bool = False,
           cached: frozenset[str] = frozenset(), nvme_s: float = 0.0) -> tuple[FloorTerms, int, int]:
    """`activation_bytes`: offloaded activation bytes per step, each way; `lean`: lean blocks (their
    updates wait for step(), so their CPU time overlaps the next forward instead of backward);
    `gpu_accumulation`: the streamed gradients go down once per step, as fp32 sums, and the CPU does
    no accumulation pass; `cached`: the parts outside the blocks in the cached tier (plan_rest.cached_terms). Compact
    masters (streaming/compact.py) add no term: their update moves no more bytes than a full master's."""
    cb, passes = model.compute_bytes, model.accumulation_steps
    streamed = model.blocks[resident:]
    walk_s, h2d_bytes = walk(model, rates, resident, window)
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
