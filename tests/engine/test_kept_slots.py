"""The kept inputs' host slots (kept_inputs.py): one allocation per forward that misses, the same slots taken back in
later windows, sizes no longer asked for let go once their copies are done, and every kept input given back exactly
once, whether its window is walked or its micro-batch dropped."""

import pytest
import torch

from stronghold.engine.kept_inputs import ALIGN, SLACK, HostSlots, Kept, KeptInputs

from .helpers import batches, engine_for, run_steps, tiny_llama, train_through_a_failed_walk


def _slots():
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    return HostSlots(allocate), made


def test_a_miss_allocates_the_forwards_slots_at_once_and_they_do_not_overlap():
    slots, made = _slots()
    taken = [slots.take(100, ahead=3) for _ in range(3)]
    stride = -(-100 // ALIGN) * ALIGN
    assert made == [3 * stride] and slots.allocations == 1 and slots.allocated_bytes == 3 * stride
    assert all(stamp is None for _, stamp in taken)
    for value, (slot, _) in enumerate(taken, start=1):
        slot.fill_(value)
    assert [int(slot[0]) for slot, _ in taken] == [1, 2, 3]
    assert all(slot.numel() == stride for slot, _ in taken)
    slots.take(100, ahead=1)  # a fourth: none free, one more allocation
    assert slots.allocations == 2


def test_later_windows_take_the_same_slots_back_with_their_stamps():
    slots, made = _slots()
    first = [slots.take(4096, ahead=2)[0] for _ in range(2)]
    for i, slot in enumerate(first):
        slots.give(slot, f"stamp{i}")
    slots.trim(lambda stamp: pytest.fail("nothing to let go"))
    again = [slots.take(4096, ahead=2) for _ in range(2)]
    assert len(made) == 1
    assert {s.data_ptr() for s, _ in again} == {s.data_ptr() for s in first}
    assert sorted(stamp for _, stamp in again) == ["stamp0", "stamp1"]


def test_a_slot_serves_smaller_inputs_down_to_the_slack_and_unused_sizes_go_after_their_copies():
    slots, made = _slots()
    big = slots.take(SLACK * 1024, ahead=1)[0]
    slots.give(big, "big")
    slots.trim(lambda stamp: pytest.fail("taken this window"))
    assert slots.take(1024, ahead=1)[0].data_ptr() == big.data_ptr()  # within the slack: reused
    slots.give(big, "big")
    small = slots.take(1024 // SLACK - ALIGN, ahead=1)[0]  # below the slack: a slot of its own
    assert len(made) == 2 and small.data_ptr() != big.data_ptr()
    slots.give(small, "small")
    slots.trim(lambda stamp: pytest.fail("taken this window"))
    settled = []
    slots.take(1024 // SLACK - ALIGN, ahead=1)  # the next window takes only the small one
    slots.trim(settled.append)
    assert settled == ["big"] and slots.free_bytes == 0


class _Recording(KeptInputs):
    """Kept inputs on the CPU that carry a slot, to check that the blockwise backward gives each back once."""

    def __init__(self):
        super().__init__(torch.device("cpu"), to_host=False)
        self.out: dict[int, Kept] = {}
        self.aheads: list[int] = []
        self.recycled = 0

    def keep(self, tensor, ahead=1):
        kept = Kept(on_device=tensor, slot=torch.empty(1))
        self.out[id(kept)] = kept
        self.aheads.append(ahead)
        return kept

    def recycle(self, kept):
        for one in kept:
            if one.slot is None:
                continue
            assert self.out.pop(id(one)) is one
            one.slot = None
            self.recycled += 1


def test_every_kept_input_goes_back_once_walked_or_dropped():
    engine = engine_for(tiny_llama(4), lr=3e-3, gas=4, clip=1.0, blockwise_backward=True)
    runtime = engine.stronghold_runtime
    kept = runtime.blockwise.kept = _Recording()

    def failed(i):
        # The failed micro-batch's three inputs went back; the window's first three micro-batches' stay.
        assert i == 3 and (kept.recycled, len(kept.out)) == (3, 9)

    def stepped(i):
        assert i % 4 != 3 or not kept.out

    assert train_through_a_failed_walk(engine, batches(8), failed, stepped)
    assert kept.recycled == 3 + 2 * 4 * 3
    assert kept.aheads[:3] == [3, 2, 1]  # blocks 1-3 of each forward (block 0's input stays with its graph)


def test_without_a_gpu_nothing_is_allocated():
    engine = engine_for(tiny_llama(4), lr=3e-3, gas=4, blockwise_backward=True)
    run_steps(engine, batches(8))
    assert engine.stronghold_report()["kept_input_slots"] == {"allocations": 0, "bytes": 0}
