"""The step-time floor of the blockwise backward (engine/blockwise.py) at a placement, in the terms plan_floor.py
gives host accumulation's, so that the two schedules can be weighed against each other. Pure.

What the schedule changes, per optimizer step of P micro-batches over S streamed blocks in a window of W slots:
- The forwards run first, every block under no_grad (a quarter of a checkpointed pass, FORWARD_SHARE), then the
  boundary's walk runs each block's recompute and backward for every micro-batch in turn (the other three quarters).
  The GPU work is a checkpointed run's.
- Loads: the forward after an update loads every streamed block; each later forward S - W + 2, the window keeping
  the first W - 2 blocks for it (streaming/schedule.py, `later_forward_blocks`; where at most 2 are left out, 2(S - W));
  the walk the S - W the last forward left out.
- A streamed block's gradient goes down once a step as an fp32 sum, and the CPU runs no accumulation pass for it.
  A cached input part is summed the same way, an embedding table as the rows of the window's tokens alone
  (PartSpec.row_gradients; the CPU still updates every row); a cached output part (the LM head) still sums on the
  host every micro-step.
- The blocks' inputs (`kept_bytes` a step) go down as the forwards make them and come back during the walk.
- With clipping the updates wait for the walk's end (the global norm); the next step's first forward waits for them
  in forward order, and the later forwards each start after the one before has ended (the trainer's micro-steps run in
  turn), so the step is at least max(first forward, deferred updates) + the later forwards + walk. The phases measured
  at the Llama-3-8B shape under 24 GiB (docs/results.md) are that chain: the CPU's updates, then the later forwards
  bound by their loads, then the walk bound by the GPU.
"""
from __future__ import annotations

import dataclasses

from stronghold.planning import plan_rest
from stronghold.planning.plan_floor import FORWARD_SHARE
from stronghold.planning.plan_result import FloorTerms
from stronghold.planning.plan_types import ADAM_HOST_BYTES, FP32_BYTES, ModelSpec, Rates
from stronghold.streaming.schedule import later_forward_blocks


def floor_terms(model: ModelSpec, rates: Rates, resident: int, window: int, cached: frozenset[str] = frozenset(),
                kept_bytes: int = 0, block_input_bytes: int = 0, ahead: bool = False) -> tuple[FloorTerms, int, int]:
    """(terms, H2D bytes, D2H bytes) a step. `cached`: the parts outside the blocks in the cached tier; `kept_bytes`:
    the blocks' inputs kept a step, each way (0 where they stay on the GPU); `block_input_bytes`: one block's input of
    a micro-batch (0: not known, and an embedding table's sum is counted whole); `ahead`: the window's forwards run
    block by block at its first (engine/block_major.py): the blocks load once for all of them, and the later forwards
    run only what is outside the blocks."""
    cb, passes, n = model.compute_bytes, model.accumulation_steps, len(model.blocks)
    streamed = model.blocks[resident:]
    s = len(streamed)
    nbytes = lambda blocks: cb * sum(b.numel for b in blocks)  # noqa: E731
    left_out = nbytes(streamed[:max(0, s - window)])
    first = nbytes(streamed)
    later = 0 if ahead else nbytes(streamed[:later_forward_blocks(s, window)])
    loads = (first + (passes - 1) * later + left_out) if s else 0
    summed = cached & plan_rest.BLOCKWISE_SUMMED
    rest = plan_rest.cached_terms(model, rates, cached - summed)
    summed_parts = plan_rest.split(model, summed)[1]
    summed_numel = sum(p.numel for p in summed_parts)
    summed_trainable = sum(p.trainable_numel for p in summed_parts)
    # A window's rows: its tokens x the hidden size, the window's block inputs over the compute dtype's bytes (the
    # rows' ids, 8 bytes a row beside 4 x hidden, are left out).
    rows = passes * block_input_bytes // cb if block_input_bytes else None
    summed_sent = sum(min(p.trainable_numel, rows) if p.row_gradients and rows is not None else p.trainable_numel
                      for p in summed_parts)
    h2d_bytes = loads + kept_bytes + rest.h2d_bytes + summed_numel * cb
    trainable = sum(b.trainable_numel for b in streamed)
    d2h_bytes = FP32_BYTES * (trainable + summed_sent) + kept_bytes + rest.d2h_bytes

    on_gpu = (sum(p.trainable_numel for p in plan_rest.split(model, cached)[0])
              + sum(b.trainable_numel for b in model.blocks[:resident]))
    gpu_adam_s = on_gpu / rates.gpu_adam_params_per_s if rates.gpu_adam_params_per_s else 0.0
    forward = FORWARD_SHARE * rates.gpu_s_per_block
    h2d = rates.h2d_bytes_per_s
    ran = passes if ahead else 1  # the forwards of blocks that the first runs
    first_s = rates.gpu_s_fixed + max(ran * n * forward, first / h2d)
    later_s = (passes - 1) * (rates.gpu_s_fixed + (0.0 if ahead else max(n * forward, later / h2d)))
    forwards_s = first_s + later_s
    walk_s = max(passes * n * (rates.gpu_s_per_block - forward), (left_out + kept_bytes) / h2d)
    gpu_s = passes * (rates.gpu_s_fixed + n * rates.gpu_s_per_block) + gpu_adam_s

    updated = trainable + summed_trainable
    cpu_s = (updated + rest.cpu_params) / rates.cpu_adam_params_per_s
    host_memory_s = 0.0
    if rates.host_memory_bytes_per_s is not None:
        # ADAM_HOST_BYTES counts a bf16 gradient read; the fp32 sums are 2 bytes more.
        cpu_bytes = updated * (ADAM_HOST_BYTES + FP32_BYTES - cb) + rest.host_memory_bytes
        host_memory_s = (h2d_bytes + d2h_bytes + cpu_bytes) / rates.host_memory_bytes_per_s
    terms = FloorTerms(gpu_s=gpu_s, h2d_s=h2d_bytes / h2d, d2h_s=d2h_bytes / rates.d2h_bytes_per_s, cpu_adam_s=cpu_s,
                       cpu_tail_s=0.0, host_memory_s=host_memory_s,
                       walk_s=forwards_s + walk_s + rest.h2d_s + gpu_adam_s)
    # The input part's sum is the walk's last: its D2H follows it. The deferred updates (a share of every update,
    # rates.deferred_share) wait for the walk's end and the next step's first forward waits for them; the later
    # forwards follow that one, and the other updates run during the walk.
    tail = summed_sent * FP32_BYTES / rates.d2h_bytes_per_s
    deferred = rates.deferred_share * cpu_s
    serial = max(first_s, deferred) + later_s + max(walk_s, cpu_s - deferred) + tail + rest.h2d_s + gpu_adam_s
    return dataclasses.replace(terms, cpu_tail_s=max(0.0, serial - terms.step_s)), h2d_bytes, d2h_bytes
