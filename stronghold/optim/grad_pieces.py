"""The gradient an update reads, one piece at a time: a slice of the store's gradient buffer for each segment, or,
where the store's gradient came down as an input table's rows (engine/embedding_rows.py: no whole-table buffer on the
host), each segment cut into runs of rows whose dense fp32 gradient is made in one reused buffer.

Why: the blockwise backward's input table would otherwise hold an fp32 gradient buffer of the whole table on the
host (2.0 GiB for a 128256 x 4096 table) for the few rows a window touches, and the exact AdamW still updates every
row (every row's moments decay each step).
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

from stronghold.optim.cpu_records import Segment
from stronghold.streaming.store import BlockStore


def grad_pieces(store: BlockStore, grad: Optional[torch.Tensor],
                segments: Sequence[Segment]) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """(the segment's index, a slice of it in shard coordinates, the gradient of that slice) in order. A piece made
    from rows is valid until the next is asked for."""
    rows = store.row_grads
    if rows is None:
        for i, seg in enumerate(segments):
            s = slice(seg.start, seg.stop)
            yield i, s, grad[s]
        return
    yield from rows.pieces(segments)
