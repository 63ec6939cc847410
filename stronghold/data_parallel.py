"""Data parallel over ranks (DeepSpeed's launcher and torch.distributed: NCCL on GPUs, gloo on the CPU).

Every rank holds a full replica: its resident part on its GPU and the streamed blocks' host state
(fp32 master, moments, working copy) in host memory. Each rank runs forward and backward on its share
of the global batch, and the gradients are combined as DeepSpeed's stage 0 combines them
(`DeepSpeedEngine.allreduce_bucket`, see `Averaging`), so every rank's optimizers see the same averaged
gradients and take the same step:
- a streamed block's gradients, as soon as backward produced them: packed into one flat buffer in the
  block's host layout (store.grad) and all-reduced asynchronously on the device; the D2H copy waits for
  the reduction in the copy stream's order, so the compute stream never waits for the network. Each
  micro-step's gradients leave the device (the slot is reused), so with gradient accumulation a
  streamed block is reduced once per micro-step (the sum is linear, so averaging each micro-step's
  gradients equals averaging their sum);
- resident blocks and the rest of the model: reduced in place once per accumulation window, at the
  boundary, on the window's sum (what makes accumulation cheap);
- the squared global gradient norm: agreed by a max over ranks at the step. The averaged gradients are
  identical on every rank, but host sums of squares depend on the CPU optimizer's thread count (which
  may differ per rank); the max makes the clip coefficient and the non-finite skip identical anyway.
Every rank must reach the same parameters in backward (as DDP without find_unused_parameters): the
collectives are issued per block in backward order and must pair up across ranks.

Sharding (the next step of issue 11) replaces the replica of the host state by a 1/world shard: the flat
buffer of `reduce_block` already has the block's host layout, so `all_reduce` becomes
`reduce_scatter_tensor` into the rank's slice of store.grad, each rank's CPU AdamW updates its slice of
master / exp_avg / exp_avg_sq, and an all-gather of the updated working copies (or one node-shared pinned
copy that every local rank writes its slice into) replaces the per-rank working copy.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .cpu_records import contiguous_ranges
from .param_state import rest
from .store import ParamEntry

T = TypeVar("T")

STAGE_NUMEL = 1 << 24
"""Elements per piece when a host buffer is broadcast through the device (NCCL cannot read host memory):
bounds the temporary device memory of the initial broadcast to 64 MiB of fp32."""

Finish = Callable[[], tuple[list[tuple[torch.Tensor, int]], torch.Tensor]]
"""Completes a block's reduction: returns the (gradient piece, offset into store.grad) list and the
averaged gradients' sum of squares (a 0-d fp32 tensor), as `Transfers.offload_after` wants them."""


@dataclass(frozen=True, kw_only=True)
class Averaging:
    """DeepSpeed's stage-0 gradient averaging (`allreduce_bucket`) as a scale before and after the sum."""

    world_size: int
    average: bool = True
    """DeepSpeed's `gradient_average` (always True for data parallel): divide the sum by the world size."""
    predivide: float = 1.0
    """`gradient_predivide_factor`: the sum is divided by this before and by world / predivide after."""
    prescale: bool = False
    """`prescale_gradients`: divide by the world size before the sum (then predivide is ignored)."""

    @property
    def before(self) -> float:
        if not self.average:
            return 1.0
        return 1.0 / self.world_size if self.prescale else 1.0 / self.predivide

    @property
    def after(self) -> float:
        if not self.average or self.prescale:
            return 1.0
        return self.predivide / self.world_size


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    group: Any
    """The torch.distributed process group of the replicas (DeepSpeed's data-parallel group)."""
    rank: int
    """This process's rank in `group`."""
    averaging: Averaging
    device: torch.device
    """Where collectives run: the engine's device (NCCL needs CUDA tensors; gloo takes CPU ones)."""
    comm_dtype: Optional[torch.dtype] = None
    """ds.json `communication_data_type`; None reduces each tensor in its own dtype (DeepSpeed's default
    is the compute dtype, which is the streamed gradients' dtype; resident accumulators stay fp32)."""

    @property
    def world_size(self) -> int:
        return self.averaging.world_size


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


class DataParallel:
    def __init__(self, config: DataParallelConfig):
        self.config = config
        self._resident: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        """In-flight resident reductions: (work, buffer reduced, gradient it belongs to)."""

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def _source(self) -> int:
        """Global rank of the group's rank 0 (torch's collectives take global ranks)."""
        return dist.get_global_rank(self.config.group, 0)

    # Gradients -------------------------------------------------------------------------------------
    def _start(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Scale and launch the all-reduce of `tensor` (in place unless a cast or a copy is needed)."""
        dtype = self.config.comm_dtype or tensor.dtype
        buffer = tensor
        if tensor.dtype != dtype or not tensor.is_contiguous():
            buffer = tensor.to(dtype, memory_format=torch.contiguous_format)
        _scale(buffer, self.config.averaging.before)
        return dist.all_reduce(buffer, group=self.config.group, async_op=True), buffer

    def _finish(self, work, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        """Wait for the reduction in the current stream's order (on the host for gloo) and scale it."""
        work.wait()
        if buffer.is_cuda:
            # Made on the compute stream, finished on the current one (the D2H stream for a block).
            buffer.record_stream(torch.cuda.current_stream(buffer.device))
        _scale(buffer, self.config.averaging.after)
        if buffer is not tensor:
            tensor.copy_(buffer)

    def reduce_block(self, trainable_numel: int, present: list[ParamEntry], grads: list[torch.Tensor]) -> Finish:
        """Launch the reduction of one streamed block's gradients (`grads` of the `present` entries); the
        returned function completes it. Called on the compute stream right after backward produced them."""
        if sum(e.numel for e in present) == trainable_numel:  # all present, in offset order: one cat
            flat = torch.cat([g.reshape(-1) for g in grads])
        else:
            flat = grads[0].new_zeros(trainable_numel)
            for entry, grad in zip(present, grads):
                flat[entry.offset:entry.offset + entry.numel].copy_(grad.reshape(-1))
        work, buffer = self._start(flat)
        ranges = contiguous_ranges(present)

        def finish():
            self._finish(work, buffer, flat)
            # Zeros where a parameter had no gradient, so this is the present gradients' sum of squares.
            sq = torch.linalg.vector_norm(flat, dtype=torch.float32).square()
            return [(flat[start:stop], start) for start, stop in ranges], sq

        return finish

    def start_resident(self, grads: list[torch.Tensor]) -> None:
        """Launch the in-place reductions of the resident gradients (the accumulation window's sums)."""
        assert not self._resident, "the previous window's resident reductions were not finished"
        self._resident = [(*self._start(grad), grad) for grad in grads]

    def finish_resident(self) -> None:
        for work, buffer, grad in self._resident:
            self._finish(work, buffer, grad)
        self._resident = []

    def drop_pending(self) -> None:
        """A backward failed: forget the resident reductions (the work objects keep their tensors alive)."""
        self._resident = []

    def agree_sq(self, sq: float) -> float:
        """The largest of the ranks' squared global norms; any non-finite one makes it inf everywhere."""
        value = torch.tensor([sq if math.isfinite(sq) else math.inf], dtype=torch.float64, device=self.config.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.config.group)
        return float(value)

    # Replica -------------------------------------------------------------------------------------
    def _broadcast_host(self, tensor: torch.Tensor) -> None:
        """Broadcast a flat host buffer from rank 0, through the device when the backend needs it."""
        if self.config.device.type == "cpu":
            dist.broadcast(tensor, self._source(), group=self.config.group)
            return
        stage = torch.empty(min(tensor.numel(), STAGE_NUMEL), dtype=tensor.dtype, device=self.config.device)
        for start in range(0, tensor.numel(), STAGE_NUMEL):
            piece = tensor[start:start + STAGE_NUMEL]
            view = stage[:piece.numel()]
            if self.rank == 0:
                view.copy_(piece)
            dist.broadcast(view, self._source(), group=self.config.group)
            if self.rank != 0:
                piece.copy_(view)

    @torch.no_grad()
    def broadcast_replica(self, runtime) -> None:
        """Make every rank start from rank 0's parameters (streamed blocks' host copies included), as
        DeepSpeed's `_broadcast_model` does for a model that lives on the device. Buffers are not sent
        (DeepSpeed does not either): models build them deterministically."""
        for store in runtime.stores.values():
            self._broadcast_host(store.working)
            if store.master.data_ptr() != store.working.data_ptr():
                self._broadcast_host(store.master)
            store.version += 1
        for chunk in runtime.resident.chunks:
            for param, master in zip(chunk.params, chunk.masters):
                dist.broadcast(master, self._source(), group=self.config.group)
                if master is not param:
                    param.data.copy_(master)
        for state in rest(runtime):
            dist.broadcast(state.value, self._source(), group=self.config.group)

    # Outcomes --------------------------------------------------------------------------------------
    def gather(self, value: T) -> list[T]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.config.group)
        return gathered

    def run_agreed(self, fn: Callable[[], T], *, rank0_only: bool) -> T:
        """Run `fn` on rank 0 only or on every rank, then share the outcome: if it failed anywhere, every
        rank raises. A barrier that never leaves the others waiting for a rank that failed."""
        result, failure = None, None
        if not rank0_only or self.rank == 0:
            try:
                result = fn()
            except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks were told
                failure = err
        outcomes = self.gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [f"rank {rank}: {message}" for rank, message in enumerate(outcomes) if message is not None]
        if failed:
            raise RuntimeError("stronghold: failed on another rank, so this one stops too; " + "; ".join(failed))
        return result


def check_same_settings(settings: dict[str, Any]) -> None:
    """Fail on every rank (no hang later) when the replicas were configured differently: `settings`
    (flat key -> JSON value) are gathered from all ranks of the default group and compared to rank 0's."""
    canonical = json.dumps(settings, sort_keys=True, default=str)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, canonical)
    if all(other == canonical for other in gathered):
        return
    first = json.loads(gathered[0])
    differences = []
    for rank, text in enumerate(gathered[1:], start=1):
        theirs = json.loads(text)
        for key in sorted(set(first) | set(theirs)):
            if first.get(key) != theirs.get(key):
                differences.append(f"rank {rank} has {key}={theirs.get(key)!r} where rank 0 has {first.get(key)!r}")
    raise ValueError("stronghold: the ranks of a data-parallel run must be configured alike (every rank holds a "
                     "replica and they exchange gradients block by block), but " + "; ".join(differences) +
                     ". Give every rank the same ds.json and model.")


def replica_settings(stronghold_section: dict, engine, model: nn.Module) -> dict[str, Any]:
    """What must agree across ranks: the stronghold section and the settings that decide which
    collectives run and how the step is taken."""
    settings = {f"stronghold.{key}": value for key, value in stronghold_section.items()}
    settings.update({
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "gradient_clipping": engine.gradient_clipping(),
        "bf16.enabled": engine.bfloat16_enabled(),
        "optimizer.params": engine.optimizer_params(),
        "model.parameters": sum(1 for _ in model.parameters()),
        "model.numel": sum(p.numel() for p in model.parameters()),
    })
    return settings


def data_parallel_for(engine, runtime) -> DataParallel:
    """The replicas' reducer for a DeepSpeed engine whose distributed groups are set up (after
    DeepSpeedEngine._configure_distributed_model), with DeepSpeed's averaging settings; the replicas
    start from rank 0's parameters."""
    world = dist.get_world_size()
    if engine.mpu is not None or engine.seq_dp_world_size != world:
        raise ValueError("stronghold's data parallel needs every rank in one data-parallel group: model, pipeline "
                         "and sequence parallelism are not supported (remove mpu= / sequence_parallel_size)")
    # The placement decides which collectives run (per streamed block in backward, resident at the step);
    # equal settings give equal placements unless something resolved per rank (e.g. from free memory).
    check_same_settings({"placement.resident_blocks": runtime.resident_count,
                         "placement.streamed_blocks": sorted(runtime.stores)})
    group = engine.seq_data_parallel_group
    averaging = Averaging(world_size=world, average=engine.gradient_average,
                          predivide=float(engine.gradient_predivide_factor()),
                          prescale=not engine.postscale_gradients())
    data_parallel = DataParallel(DataParallelConfig(group=group, rank=dist.get_rank(group), averaging=averaging,
                                                    device=torch.device(engine.device),
                                                    comm_dtype=engine._config.communication_data_type))
    data_parallel.broadcast_replica(runtime)
    return data_parallel
