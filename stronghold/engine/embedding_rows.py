"""The input embedding table's gradient in the blockwise backward's walk (blockwise_walk.py), as the rows of the
window's tokens alone.

Why: a table's gradient is nonzero only in the rows of the tokens the window saw (a window of 8 x 2048 tokens touches at
most a ninth of a 152k vocabulary), yet the embedding's own backward writes the whole table in the compute dtype each
micro-batch, and the walk sums it into a whole fp32 table: 6 bytes a table parameter on the GPU at once (3.3 GB for a
152k x 3584 table, the walk's largest transient at such a vocabulary) and 4 of D2H. Here the walk sums only the
window's rows, and the host keeps them as they landed: the table's store has no whole-table gradient buffer (4 host
bytes a table parameter, 2.0 GiB for a 128256 x 4096 table), and the CPU AdamW updates the whole table as before
(every row's moments decay each step), its gradient made run by run of rows from the landed ones (`pieces`,
optim/grad_pieces.py).

The same sums: each micro-batch's rows come from the embedding's own backward kernel run over the window's distinct
tokens in place of the vocabulary (`aten.embedding_dense_backward` with the token ids renumbered in the same order), so
each row is the compute-dtype gradient the whole table would hold, added to its fp32 sum in micro-batch order as the
whole table's would be (the padding token renumbered too: the kernel skips its positions).

Where it applies: a cached input part whose one trainable parameter is a plain, untied table (discovery.row_table),
and a first block input computed from the table's output with no other parameter on the way (checked on the graph
each micro-batch; with ops between, such as a scale, the gradient at the table's output comes from `autograd.grad`).
Anything else takes the whole-table sum, into a whole-table buffer made then (`whole_table_buffer`: host memory the plan
did not count, said once in the log).
"""
from __future__ import annotations

import logging
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from stronghold.integrations import discovery
from stronghold.optim.cpu_records import Segment
from stronghold.planning.plan_types import ROW_PIECE_BYTES

logger = logging.getLogger(__name__)

PIECE_BYTES = ROW_PIECE_BYTES
"""The planner's piece size (plan_types.ROW_PIECE_BYTES), read here at each update."""


class EmbeddingRows:
    """The host side of one table's row sums: where they land (pinned on a GPU) and which rows the gradient buffer
    holds, so the next sum clears those rows alone."""

    def __init__(self, table: nn.Embedding, entry, pin: bool):
        self.table = table
        self.entry = entry
        """The table's ParamEntry (store.py): where its gradient lies in the unit's buffers."""
        self.param = entry.param
        self.pin = pin
        self.width = table.embedding_dim
        self._rows: Optional[torch.Tensor] = None
        self._ids: Optional[torch.Tensor] = None
        """Host landing buffers, grown to the largest window seen."""
        self._written: Optional[torch.Tensor] = None
        """The rows the gradient buffer holds nonzero; None before the first write (the buffer's contents unknown)."""
        self._piece: Optional[torch.Tensor] = None
        """The buffer each piece of dense gradient is made in (`pieces`): zeros but while a piece is read."""
        self.landed_rows = 0
        """Rows of the last landing that the next update reads (`write`)."""
        self.walks = 0
        self.whole_table = 0
        """Walks whose graph did not allow rows (the whole-table sum ran)."""
        self.last_rows = 0

    def sum_rows(self, inputs: list, grads: list) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(the window's distinct token ids, their rows' fp32 gradient sums) from each micro-batch's first block input
        (`inputs`, with the embedding's graph) and its gradient (`grads`); None where a graph does not fit (the caller
        sums the whole table)."""
        found = []
        for hidden, grad in zip(inputs, grads):
            if hidden is None or grad is None:
                continue
            node = self._table_node(hidden)
            if node is None:
                # The whole sum fills the whole buffer: the next rows clear it all. (The last write is done: this
                # step's forward waited for the table's update, which follows it.)
                self._written = None
                self.whole_table += 1
                if self.whole_table == 1:
                    logger.warning("stronghold: the input embedding's graph has more than the table on it; the "
                                   "blockwise walk sums its whole gradient (more GPU memory than planned)")
                return None
            found.append((hidden, grad, node))
        if not found:
            return None
        ids = [node._saved_indices for _, _, node in found]
        distinct, renumbered = torch.unique(torch.cat([i.reshape(-1) for i in ids]), return_inverse=True)
        total = torch.zeros(len(distinct), self.width, dtype=torch.float32, device=distinct.device)
        padding = self._padding(distinct)
        start = 0
        for (hidden, grad, node), i in zip(found, ids):
            local = renumbered[start:start + i.numel()].view_as(i)
            start += i.numel()
            if node is not hidden.grad_fn:  # ops between the table and the block (a scale): their gradient
                grad = torch.autograd.grad(hidden, [GradientEdge(node, 0)], grad, retain_graph=True)[0]
            rows = torch.ops.aten.embedding_dense_backward(grad, local, len(distinct), padding, False)
            total.add_(rows)
            del rows
        self.walks += 1
        self.last_rows = len(distinct)
        return distinct, total

    def _padding(self, distinct: torch.Tensor) -> int:
        """The padding token's number among the window's distinct tokens, -1 where it is not among them (or there is
        none): the kernel skips its positions, as over the whole table."""
        padding = self.table.padding_idx
        if padding is None:
            return -1
        at = int(torch.searchsorted(distinct, padding))
        return at if at < len(distinct) and int(distinct[at]) == padding else -1

    def _table_node(self, hidden: torch.Tensor):
        """The table's backward node on `hidden`'s graph where the table is the only parameter on it, else None."""
        table, seen, stack = None, set(), [hidden.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and variable is not self.param:
                return None
            if type(node).__name__ == "EmbeddingBackward0":
                if table is not None or not any(getattr(n, "variable", None) is self.param
                                                for n, _ in node.next_functions):
                    return None
                table = node
                continue
            stack.extend(n for n, _ in node.next_functions)
        return table

    def landing(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers for `rows` rows and their ids (grown, never shrunk: a window's distinct tokens vary)."""
        if self._rows is None or self._rows.shape[0] < rows:
            self._rows = torch.empty(rows, self.width, dtype=torch.float32, pin_memory=self.pin)
            self._ids = torch.empty(rows, dtype=torch.int64, pin_memory=self.pin)
        return self._rows[:rows], self._ids[:rows]

    def write(self, grad: Optional[torch.Tensor], rows: int) -> None:
        """On the CPU optimizer's thread, before the update reads the gradient: without a whole-table buffer (`grad`
        None) the update reads the `rows` landed rows (`pieces`); else they go into the table's flat fp32 gradient
        buffer `grad`, the rows the last write left cleared first, the whole buffer the first time."""
        self.landed_rows = rows
        if grad is None:
            return
        table = self.entry.host_view(grad)
        if self._written is None:
            table.zero_()
        else:
            table.index_fill_(0, self._written, 0.0)
        ids = self._ids[:rows]
        table.index_copy_(0, ids, self._rows[:rows])
        self._written = ids.clone()

    def pieces(self, segments: Sequence[Segment]) -> Iterator[tuple[int, slice, torch.Tensor]]:
        """grad_pieces's pieces of the table's gradient (segments in store coordinates, each whole rows of the table:
        its store has no other trainable parameter): runs of rows, each one's dense fp32 gradient, zeros but for the
        landed rows (their ids ascending, as `torch.unique` gave them), in one buffer reused for the next run."""
        width, offset = self.width, self.entry.offset
        ids, sums = self._ids[:self.landed_rows], self._rows[:self.landed_rows]
        per = max(1, min(PIECE_BYTES // (4 * width), self.table.num_embeddings))
        if self._piece is None or self._piece.numel() != per * width:
            self._piece = torch.zeros(per, width, dtype=torch.float32)
        for i, seg in enumerate(segments):
            first, last = divmod(seg.start - offset, width), divmod(seg.stop - offset, width)
            if first[1] or last[1]:
                raise AssertionError(f"a table's update segment {seg.start}-{seg.stop} cuts a row of {width}")
            starts = list(range(first[0], last[0], per))
            bounds = torch.searchsorted(ids, torch.tensor([*starts, last[0]], dtype=ids.dtype)).tolist()
            for k, row in enumerate(starts):
                count, lo, hi = min(per, last[0] - row), bounds[k], bounds[k + 1]
                # The buffer is all zeros between pieces: only the landed rows go in, and come out after, so no
                # pass writes the whole table's worth of zeros.
                local = ids[lo:hi] - row
                self._piece.index_copy_(0, local, sums[lo:hi])
                try:
                    yield i, slice(offset + row * width, offset + (row + count) * width), self._piece[:count].view(-1)
                finally:
                    self._piece.index_fill_(0, local, 0.0)

    def whole_table_buffer(self, store) -> None:
        """A walk takes the whole-table sum (its graph did not allow rows): the table's store gets the whole-table
        fp32 gradient buffer the rows spared it, for good."""
        if store.grad is not None:
            return
        store.grad = torch.zeros(store.trainable_numel, dtype=torch.float32, pin_memory=self.pin)
        store.row_grads = None
        self._written = None
        logger.warning(f"stronghold: the input table's gradient is summed whole from now on: "
                       f"{store.grad.numel() * 4 / 2 ** 30:.2f} GiB more host memory than planned")

    def report(self) -> dict:
        return {"walks": self.walks, "whole_table_walks": self.whole_table, "last_rows": self.last_rows}


def rows_for(model: nn.Module, unit, blocks: list[nn.Module], pin: bool) -> Optional[EmbeddingRows]:
    """The row sums for a cached input part (`unit`, cached.py) where its table allows them (discovery.row_table)."""
    if unit is None:
        return None
    entries = list(unit.store.trainable)
    table = discovery.row_table(model, [entry.param for entry in entries], blocks)
    if table is None:
        return None
    rows = EmbeddingRows(table, entries[0], pin)
    store = unit.store
    if not store.sharded and store.grad is not None and store.accum is None and store.pool is None:
        # Its whole-table buffer goes: the update reads the landed rows (`pieces`).
        store.grad, store.row_grads = None, rows
    return rows
