"""Data parallel over ranks (DeepSpeed's launcher and torch.distributed: NCCL on GPUs, gloo on the CPU),
with the streamed blocks' host state sharded over all ranks, on one node or several (nodes.py).

Who holds what: every rank holds its resident part on its GPU, and for each streamed block only its
shard (`shared_host.shard_range`: equal slices of the block's T trainable elements, the last ones shorter)
of the fp32 master, exp_avg, exp_avg_sq, gradient buffer and accumulator: 1/world of the states each.
The compute-dtype working copy every rank streams from is one node-shared mapping per node (shared_host.py):
each rank's CPU AdamW writes its shard of it, and with several nodes the other nodes' shards arrive by the
cross-node exchange (nodes.py) before a block is published. The reducer is made before the runtime, which builds the
stores sharded block by block from rank 0's values; saves gather one block at a time to rank 0
(sharding.py): no rank ever holds a full replica of the host states. The parts outside the blocks in the cached tier
(streaming/cached.py: weights and gradients on the GPU, states on the host) are sharded the same way: a unit is a
block here, reduced, updated, published and saved as one.

What is reduced where (DeepSpeed's stage-0 averaging, see `Averaging`):
- a streamed block's gradients, as soon as backward produced them: packed into one flat buffer in the
  block's host layout, padded to shard * world, and reduce-scattered asynchronously on the device
  (`reduce_scatter_tensor`, which gloo implements too, so the CPU runs the same code); the D2H copy of the
  rank's shard waits for it in the copy stream's order, so the compute stream never waits for the
  network. The shard's sum of squares is computed on the device and travels with it. Each micro-step's
  gradients leave the device (the slot is reused), so with accumulation a streamed block is reduced
  once per micro-step (the sum is linear: averaging each micro-step's gradients equals averaging the sum);
- resident blocks and the rest of the model: all-reduced in place once per accumulation window, on the
  window's sum, launched in the boundary backward as the gradients complete (resident_reduce.py);
- the squared global gradient norm: the ranks' streamed shard sums are gathered and added in rank
  order (exactly the same float on every rank), plus the resident part, which every rank has whole. So
  the clip coefficient and the non-finite skip are identical everywhere.

What waits on what: a rank's CPU optimizer updates its shard of block i (early or at the step, cpu_optim.py)
and writes its shard of the shared working copy; after the step's jobs for block i it publishes (block i,
epoch) in the shared segment. The next forward's load of block i waits for its own update (store.life.updated)
and for every local rank's publication (NodeSharedCopy.wait: fails naming a rank that exited or is late
past the timeout). Every other read of the shared copy (state_dict, master_params, checkpoints, promotion)
goes through `runtime.synchronize()`, which drains this rank's worker and then waits for every block's
publication too: draining finishes only this rank's shard, and another rank's worker may still be writing
its shard of the last step (reading then gave a replica whose other shards missed that step's update).
Writes of step t+1 cannot race with a read of step t+1: a rank updates block i only
after the reduce-scatter of block i, which needs every rank's backward of block i, the last read of its
trainable weights in that step.

Every rank must reach the same parameters in backward (as DDP without find_unused_parameters): the
collectives are issued per block in backward order and must pair up across ranks.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from stronghold.distributed.liveness import Liveness, liveness_for
from stronghold.distributed.nodes import NodeExchange, exchange_for, layout_of, node_identity
from stronghold.distributed.shared_host import NodeSharedCopy
from stronghold.optim.param_state import rest
from stronghold.streaming.store import BlockStore, ParamEntry

T = TypeVar("T")

Finish = Callable[[], tuple[list[tuple[torch.Tensor, int]], torch.Tensor]]
"""Completes a block's reduction: returns the (gradient piece, offset into store.grad) list and the sum of
squares of this rank's shard of the averaged gradients (a 0-d fp32 tensor), as `Transfers.offload_after`
wants them."""


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
    shared_timeout_s: float = 300.0
    """How long a load waits for another rank's shard of a block before failing, naming it."""

    @property
    def world_size(self) -> int:
        return self.averaging.world_size


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


class DataParallel:
    def __init__(self, config: DataParallelConfig, nodes: Optional[NodeExchange] = None):
        self.config = config
        self.nodes = nodes
        """The cross-node exchange with several nodes (nodes.py); None on one node."""
        self.liveness: Optional[Liveness] = None
        """Every rank's heartbeat (liveness.py): a rank that stops takes the job down, named."""
        self.shared: Optional[NodeSharedCopy] = None
        """The node-shared working copy of the streamed blocks (`share`, from sharding.build_sharded_stores)."""

    def connect_nodes(self, stall_timeout_s: float) -> None:
        """Find which ranks share a node (a collective): their cross-node exchange with several nodes, every rank's
        heartbeat started. Before the stores are built (the node-shared copy is per node)."""
        identities = self.gather(node_identity())
        self.nodes = exchange_for(layout_of(identities), dist.get_rank(), self.config.shared_timeout_s)
        self.liveness = liveness_for(dist.get_rank(), identities, stall_timeout_s)
        self.gather(None)  # every rank's counter exists before any rank reads it
        if self.liveness is not None:
            self.liveness.start()

    def share(self, shared: NodeSharedCopy) -> None:
        """The node-shared working copy the stores view; closed with this reducer (`close`)."""
        self.shared = shared

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def local_rank(self) -> int:
        """This rank's index among its node's ranks (the group's rank on one node)."""
        return self.nodes.local_rank if self.nodes is not None else self.rank

    @property
    def local_world(self) -> int:
        """Ranks on this node, which share its working copy."""
        return self.nodes.layout.local_world if self.nodes is not None else self.world_size

    def node_ranks(self) -> tuple[int, ...]:
        """Global ranks of this node's ranks, by local rank."""
        if self.nodes is not None:
            return self.nodes.layout.nodes[self.nodes.node]
        return tuple(dist.get_global_rank(self.config.group, r) for r in range(self.world_size))

    def gather_on_node(self, value: T) -> list[T]:
        """all_gather_object over this node's ranks."""
        return self.nodes.gather_on_node(value) if self.nodes is not None else self.gather(value)

    def source(self) -> int:
        """Global rank of the group's rank 0 (torch's collectives take global ranks)."""
        return dist.get_global_rank(self.config.group, 0)

    # Gradients -------------------------------------------------------------------------------------
    def start_all_reduce(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Scale and launch the all-reduce of `tensor` (in place unless a cast or a copy is needed)."""
        dtype = self.config.comm_dtype or tensor.dtype
        buffer = tensor
        if tensor.dtype != dtype or not tensor.is_contiguous():
            buffer = tensor.to(dtype, memory_format=torch.contiguous_format)
        _scale(buffer, self.config.averaging.before)
        return dist.all_reduce(buffer, group=self.config.group, async_op=True), buffer

    def _peer_failure(self, err: Exception) -> Exception:
        """A collective failed: name the ranks that exited (this node's, from the shared segment's pids) or
        stopped beating (any node's, liveness.py), where they can be told (a backend's own error names a socket
        or a timeout, not a rank)."""
        dead = [f"rank {rank}" for rank in (self.shared.dead_ranks() if self.shared is not None else [])]
        if self.liveness is not None:
            dead += [name for name in self.liveness.stopped() if name.split(" (")[0] not in dead]
        if not dead:
            return err
        return RuntimeError(f"stronghold: {', '.join(dead)} exited or stopped, so the collective this rank "
                            f"was in cannot finish ({type(err).__name__}: {err})")

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self._peer_failure(err) from err

    def finish_all_reduce(self, work, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        """Wait for the reduction in the current stream's order (on the host for gloo) and scale it."""
        self._wait(work)
        if buffer.is_cuda:
            # Made on the compute stream, finished on the current one (the D2H stream for a block).
            buffer.record_stream(torch.cuda.current_stream(buffer.device))
        _scale(buffer, self.config.averaging.after)
        if buffer is not tensor:
            tensor.copy_(buffer)

    def reduce_block(self, store: BlockStore, present: list[ParamEntry], grads: list[torch.Tensor]) -> Finish:
        """Launch the reduce-scatter of one streamed block's gradients (`grads` of the `present` entries)
        into this rank's shard; the returned function completes it. Called on the compute stream right
        after backward produced them."""
        total = store.trainable_numel
        shard = math.ceil(total / self.world_size)
        padded = shard * self.world_size
        dtype = self.config.comm_dtype or grads[0].dtype
        if sum(e.numel for e in present) == total and padded == total:  # all present, in offset order: one cat
            flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
        else:
            flat = grads[0].new_zeros(padded, dtype=dtype)
            for entry, grad in zip(present, grads):
                flat[entry.offset:entry.offset + entry.numel].copy_(grad.reshape(-1))
        _scale(flat, self.config.averaging.before)
        out = flat.new_empty(shard)
        # gloo implements reduce_scatter_tensor too (torch 2.13), so the CPU runs the GPU's code.
        work = dist.reduce_scatter_tensor(out, flat, group=self.config.group, async_op=True)
        length = store.shard_stop - store.shard_start

        def finish():
            self.finish_all_reduce(work, out, out)
            if flat.is_cuda:
                # The collective reads the input on its own stream: keep its memory from the compute
                # stream's allocator until the current (D2H) stream, now ordered after it, gets there.
                flat.record_stream(torch.cuda.current_stream(flat.device))
            # The padding and parameters without a gradient are zeros: this is the shard's sum of squares.
            sq = torch.linalg.vector_norm(out, dtype=torch.float32).square()
            return [(out[:length], 0)], sq

        return finish

    def agree_sq(self, streamed_sq: float, resident_sq: float) -> float:
        """The squared global norm: the ranks' streamed shard sums added in rank order (the same float on
        every rank; a non-finite one anywhere makes it non-finite everywhere), plus the resident part that
        every rank holds whole."""
        # An all-gather as a sum of one-hot vectors: x + 0 is exact, so every rank gets every value as sent.
        gathered = torch.zeros(self.world_size, dtype=torch.float64, device=self.config.device)
        gathered[self.rank] = streamed_sq
        self._wait(dist.all_reduce(gathered, group=self.config.group, async_op=True))
        return sum(gathered.tolist()) + resident_sq

    # Replica -------------------------------------------------------------------------------------
    @torch.no_grad()
    def broadcast_resident(self, runtime) -> None:
        """Make every rank's resident part rank 0's, as DeepSpeed's `_broadcast_model` does for a model that
        lives on the device (the streamed blocks were built from rank 0's values: sharding.py). Buffers are
        not sent (DeepSpeed does not either): models build them deterministically."""
        for chunk in runtime.resident.chunks:
            for param, master in zip(chunk.params, chunk.masters):
                dist.broadcast(master, self.source(), group=self.config.group)
                if master is not param:
                    param.data.copy_(master)
        for state in rest(runtime):
            dist.broadcast(state.value, self.source(), group=self.config.group)

    def publish(self, runtime) -> None:
        """A step (or a load) is agreed: each block is ready once every rank's jobs for it have run, and with
        several nodes once the other nodes' shards have arrived (nodes.py: every rank submits these jobs in the
        same block order, so the column's collectives pair up)."""
        shared = self.shared
        if shared is None:
            return
        epoch = shared.advance_epoch()

        def ready(index: int, working: torch.Tensor, numel: int) -> None:
            if self.nodes is not None:
                try:
                    self.nodes.exchange(working, numel, self.world_size)
                except RuntimeError as err:
                    raise self._peer_failure(err) from err
            shared.publish(index, epoch)

        # Each job holds the node-shared working copy, not the store: a block promoted before its job runs
        # (promotion.settle) gives its states back then.
        for store in runtime.host_stores():  # the cached units' too (cached.py)
            runtime.cpu.submit_after(lambda index=store.index, working=store.working, numel=store.trainable_numel:
                                     ready(index, working, numel))

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.close()
        if self.shared is not None:
            self.shared.close()

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
                     "shard of one model and they exchange gradients block by block), but " + "; ".join(differences) +
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


def data_parallel_for(engine, resident_blocks: int, n_blocks: int) -> DataParallel:
    """The replicas' reducer for a DeepSpeed engine, with DeepSpeed's averaging settings; made before the
    runtime, which builds its streamed stores sharded with it (sharding.py), so that no rank ever holds a
    full replica of the host states. DeepSpeed's engine has not set its groups yet (that is in the
    `_configure_distributed_model` that must run after the runtime took the streamed blocks out of the
    model): its `groups` module answers the same."""
    from deepspeed.utils import groups
    world = dist.get_world_size()
    if engine.mpu is not None or groups._get_sequence_data_parallel_world_size() != world:
        raise ValueError("stronghold's data parallel needs every rank in one data-parallel group: model, pipeline "
                         "and sequence parallelism are not supported (remove mpu= / sequence_parallel_size)")
    # The placement decides which collectives run (per streamed block at start-up and in backward, resident
    # at the step); equal settings give equal placements unless something resolved per rank (free memory).
    check_same_settings({"placement.resident_blocks": min(resident_blocks, n_blocks), "placement.blocks": n_blocks})
    group = groups._get_sequence_data_parallel_group()
    averaging = Averaging(world_size=world, average=engine.gradient_average,
                          predivide=float(engine.gradient_predivide_factor()),
                          prescale=not engine.postscale_gradients())
    data_parallel = DataParallel(DataParallelConfig(group=group, rank=dist.get_rank(group), averaging=averaging,
                                                    device=torch.device(engine.device),
                                                    comm_dtype=engine._config.communication_data_type))
    # Ranks on one node share its working copy; with several nodes each has its own (nodes.py).
    data_parallel.connect_nodes(engine._sh_settings.stall_timeout_s)
    return data_parallel
