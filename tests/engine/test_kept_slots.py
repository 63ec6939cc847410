"""The kept inputs' host slots (kept_inputs.py): one allocation per forward that misses, the same slots taken back in
later windows, sizes no longer asked for let go once their copies are done, every kept input given back exactly
once, whether its window is walked or its micro-batch dropped, and a miss the host cannot hold refused before it
allocates."""

import pytest
import torch

from stronghold.engine.kept_inputs import ALIGN, MARGIN_BYTES, SLACK, HostSlots, Kept, KeptInputs

from .helpers import (batches, engine_for, on_device, relative_error, run_steps, tiny_llama, train_reference,
                      train_through_a_failed_walk)


def _slots(room=None):
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    return HostSlots(allocate, room), made


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


def test_a_miss_the_host_cannot_hold_is_refused_before_it_allocates_and_a_hit_never_asks():
    asked = []

    def room():
        asked.append(True)
        return available

    stride = -(-1000 // ALIGN) * ALIGN
    available = 4 * stride + MARGIN_BYTES
    slots, made = _slots(room)
    first = [slots.take(1000, ahead=4)[0] for _ in range(4)]  # exactly what the host holds beside the margin
    assert made == [4 * stride] and len(asked) == 1
    for slot in first:
        slots.give(slot, None)
    assert [slots.take(1000, ahead=4)[1] for _ in range(4)] == [None] * 4 and len(asked) == 1  # hits: not asked
    available -= 1
    with pytest.raises(MemoryError) as refused:
        slots.take(3000, ahead=4)  # longer inputs: a miss one byte short
    assert made == [4 * stride] and slots.allocations == 1 and slots.free_bytes == 0
    message = str(refused.value)
    assert "Pad every micro-batch to one length" in message and '"blockwise_backward": false' in message
    assert f"4 blocks x {-(-3000 // ALIGN) * ALIGN / 2 ** 20:.1f} MiB" in message
    with pytest.raises(MemoryError, match="the host holds less than the plan counted on") as refused:
        slots.take(1000, ahead=4)  # more of a size already made (the first step's forwards): padding would not help
    assert "Pad every" not in str(refused.value) and '"blockwise_backward": false' in str(refused.value)
    assert made == [4 * stride]


class _OnSlots(KeptInputs):
    """Kept inputs on the CPU that take their slots from `HostSlots` as on a GPU (without the copies)."""

    def __init__(self, room):
        super().__init__(torch.device("cpu"), to_host=False)
        self.slots = HostSlots(lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8), room)

    def keep(self, tensor, ahead=1):
        return Kept(on_device=tensor, slot=self.slots.take(tensor.numel() * tensor.element_size(), ahead)[0])

    def recycle(self, kept):
        for one in kept:
            if one.slot is not None:
                self.slots.give(one.slot, None)
                one.slot = None

    def trim(self):
        self.slots.trim(lambda stamp: None)


def test_a_longer_micro_batch_whose_slots_the_host_cannot_hold_is_refused_and_the_run_goes_on():
    """The refused micro-batch leaves nothing behind: the same micro-batch at the planned length takes its place and
    the run ends where plain PyTorch's does on the planned batches."""
    model, data = tiny_llama(4), batches(8)
    reference, _ = train_reference(model, data, lr=3e-3, gas=4, clip=1.0)
    engine = engine_for(model, lr=3e-3, gas=4, clip=1.0, blockwise_backward=True)
    room = [2 ** 40]
    kept = engine.stronghold_runtime.blockwise.kept = _OnSlots(lambda: room[0])
    for i, batch in enumerate(on_device(engine, data)):
        if i == 6:  # the second window, after a walk: the refused micro-batch's slots would be its first
            held = kept.slots.allocated_bytes
            room[0] = MARGIN_BYTES
            longer = {name: torch.cat([value, value], dim=1) for name, value in batch.items()}
            with pytest.raises(MemoryError, match="Pad every micro-batch to one length"):
                engine(**longer)
            assert kept.slots.allocated_bytes == held
            room[0] = 2 ** 40
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    engine.synchronize_host()
    assert relative_error(engine.module, reference) <= 1e-5
