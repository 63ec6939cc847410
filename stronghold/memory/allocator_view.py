"""The device allocator's reserved memory by CUDA stream, from its snapshot (`torch.cuda.memory_snapshot()`).

The caching allocator keeps a pool per stream: memory freed on one stream is reused by that stream only, and a
tensor recorded on another stream (`record_stream`: the gradients the D2H stream copies) returns to its pool only
once that stream has passed the recorded point; until then its block is "active_pending_free", no longer counted
as allocated and not yet reusable. Either way the reserved memory can run far above the allocated peak while
nothing is fragmented. The first step's report keeps both views so that such a gap can be placed.
"""
from __future__ import annotations

from typing import Iterable


def reserved_by_stream(segments: Iterable[dict], names: dict[int, str]) -> dict[str, dict[str, int]]:
    """Per stream (named by `names`, keyed by the stream's handle; others by their handle): the reserved bytes of
    its segments, the bytes allocated in them, and those freed but waiting for another stream's use to pass."""
    out: dict[str, dict[str, int]] = {}
    for segment in segments:
        name = names.get(segment.get("stream", 0), str(segment.get("stream", 0)))
        view = out.setdefault(name, {"reserved": 0, "allocated": 0, "pending_free": 0})
        view["reserved"] += int(segment.get("total_size", 0))
        view["allocated"] += int(segment.get("allocated_size", 0))
        view["pending_free"] += sum(int(b.get("size", 0)) for b in segment.get("blocks", ())
                                    if b.get("state") == "active_pending_free")
    return out
