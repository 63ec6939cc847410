"""allocator_view.reserved_by_stream on a snapshot in torch.cuda.memory_snapshot()'s format."""
from stronghold.memory.allocator_view import reserved_by_stream

MIB = 2 ** 20


def _segment(stream: int, total: int, blocks: list[tuple[int, str]]) -> dict:
    return {"device": 0, "stream": stream, "total_size": total * MIB,
            "allocated_size": sum(size for size, state in blocks if state == "active_allocated") * MIB,
            "blocks": [{"size": size * MIB, "state": state} for size, state in blocks]}


def test_segments_are_summed_per_named_stream_with_the_blocks_waiting_for_another_stream():
    snapshot = [_segment(7, 20, [(12, "active_allocated"), (8, "inactive")]),
                _segment(7, 2, [(2, "active_pending_free")]),
                _segment(9, 6, [(4, "active_pending_free"), (2, "active_allocated")]),
                _segment(11, 4, [(4, "inactive")])]
    view = reserved_by_stream(snapshot, {7: "compute", 9: "d2h"})
    assert view == {"compute": {"reserved": 22 * MIB, "allocated": 12 * MIB, "pending_free": 2 * MIB},
                    "d2h": {"reserved": 6 * MIB, "allocated": 2 * MIB, "pending_free": 4 * MIB},
                    "11": {"reserved": 4 * MIB, "allocated": 0, "pending_free": 0}}
    assert reserved_by_stream([], {7: "compute"}) == {}
