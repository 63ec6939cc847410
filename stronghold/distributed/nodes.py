"""Data parallel across nodes: which ranks share a node, and how a node's shared working copy receives the
shards that the other nodes' ranks update.

Every rank holds its shard of each streamed block's fp32 master and moments, sharded over the whole world
(`shared_host.shard_range(T, rank, world)`), and gradients are reduce-scattered over the world, so the
optimizer's arithmetic is the one-node arithmetic with more ranks. What is per node is the compute-dtype working
copy every rank streams from: one node-shared mapping per node (shared_host.py), which must hold every rank's
updated shard before the next forward reads it. A node's own ranks write theirs into it; the others' arrive by
`NodeExchange.exchange`: the ranks with the same local rank on every node (a "column") all-gather their shards of
the block and write them into their own node's copy, so after every column's exchange each node's copy is whole.

Where it runs: in each rank's CPU-optimizer worker, in the publication job of each block (data_parallel.publish),
after the step's updates and before the block is marked ready for its node; the columns' groups are used by those
jobs only, and every rank submits them in the same block order, so the collectives pair up. The exchange of
block i comes after block i's reduce-scatter over the world, which needs every rank's backward of block i (the
last read of its weights in that step), so it never overwrites weights another node still reads.

A node is a host (`socket.gethostname()`) and, where the launcher numbers nodes, that number (GROUP_RANK:
torchrun's agent, CROSS_RANK: DeepSpeed's launcher): two launcher agents on one host are two nodes, each with
its own copy, which is how the tests simulate two hosts on one machine. Every node must run as many ranks.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

NODE_RANK_VARIABLES = ("GROUP_RANK", "CROSS_RANK")
"""The node number a launcher sets: torchrun's agent rank, DeepSpeed's launcher's node rank."""


def node_identity(env: Mapping[str, str] = os.environ) -> str:
    """This process's node: its host, with the launcher's node number where it sets one."""
    number = next((env[key] for key in NODE_RANK_VARIABLES if env.get(key)), "")
    return f"{socket.gethostname()}#{number}" if number else socket.gethostname()


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of each node, in the order of their lowest rank; within a node by rank (local rank = index)."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def local_world(self) -> int:
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        return next(index for index, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def column(self, local_rank: int) -> tuple[int, ...]:
        """The ranks with this local rank, one per node, in node order."""
        return tuple(ranks[local_rank] for ranks in self.nodes)


def layout_of(identities: Sequence[str]) -> NodeLayout:
    """The layout from every rank's `node_identity` (indexed by rank). ValueError when the nodes run different
    numbers of ranks (each column must have a rank on every node)."""
    order: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        order.setdefault(identity, []).append(rank)
    nodes = tuple(tuple(ranks) for ranks in order.values())
    sizes = {identity: len(ranks) for identity, ranks in order.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"stronghold's data parallel needs as many ranks on every node, got {sizes}; launch the same "
                         "number of processes per node (torchrun --nproc_per_node, deepspeed --num_gpus)")
    return NodeLayout(nodes)


class NodeExchange:
    """This rank's place in the node layout and the process groups of the cross-node exchange (gloo: the shards
    are host memory). Build on every rank (a collective: every rank creates every group, in the same order)."""

    def __init__(self, layout: NodeLayout, rank: int, timeout_s: float):
        self.layout, self.rank = layout, rank
        self.node, self.local_rank = layout.node_of(rank), layout.local_rank(rank)
        timeout = timedelta(seconds=timeout_s)
        self.node_group = None
        for ranks in layout.nodes:
            group = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
            if self.node == layout.node_of(ranks[0]):
                self.node_group = group
        self.column_group = None
        for local in range(layout.local_world):
            group = dist.new_group(list(layout.column(local)), backend="gloo", timeout=timeout)
            if local == self.local_rank:
                self.column_group = group
        self.column = layout.column(self.local_rank)

    @property
    def nodes(self) -> int:
        return len(self.layout.nodes)

    def gather_on_node(self, value):
        """all_gather_object over this node's ranks."""
        gathered = [None] * self.layout.local_world
        dist.all_gather_object(gathered, value, group=self.node_group)
        return gathered

    def broadcast_from_first_node(self, tensor: torch.Tensor) -> None:
        """The column's first node's `tensor` on every node (a collective of the column)."""
        dist.broadcast(tensor, self.column[0], group=self.column_group)

    @torch.no_grad()
    def exchange(self, working: torch.Tensor, trainable_numel: int, world: int) -> None:
        """All-gather the column's shards of a block's trainable working copy (`working[:trainable_numel]`, sharded
        as `shard_range(trainable_numel, rank, world)`) into this node's copy."""
        size = math.ceil(trainable_numel / world) if trainable_numel else 0
        if size == 0:
            return
        starts = [min(rank * size, trainable_numel) for rank in self.column]
        mine = self.column.index(self.rank)
        send = working.new_zeros(size)
        piece = working[starts[mine]:min(starts[mine] + size, trainable_numel)]
        send[:piece.numel()].copy_(piece)
        received = working.new_empty(size * len(self.column))
        dist.all_gather_into_tensor(received, send, group=self.column_group)
        for index, start in enumerate(starts):
            if index == mine:
                continue
            stop = min(start + size, trainable_numel)
            working[start:stop].copy_(received[index * size:index * size + stop - start])


def exchange_for(layout: NodeLayout, rank: int, timeout_s: float) -> Optional[NodeExchange]:
    """The exchange where there are several nodes; None on one node (nothing to exchange)."""
    if len(layout.nodes) == 1:
        return None
    return NodeExchange(layout, rank, timeout_s)
