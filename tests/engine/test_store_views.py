"""The views a block store makes once (store.py): re-pointing parameters and the gradients' D2H destinations.

They are made once because slicing them anew on every re-point cost 59-89 us a Llama block on the launching thread
(against 2-4 us to assign made ones, H200). What must hold: the made views are the same memory as fresh slices, and
a buffer the store swaps for another (device_accum.py swaps `grad`) is not kept alive by them.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from stronghold.streaming.store import build_block_store, order_entries
from stronghold.streaming.streams import Slot
from stronghold.streaming.window import Window


def _store(dtype: torch.dtype = torch.float32):
    block = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
    named = list(block.named_parameters())
    group_of = {id(p): 0 for _, p in named[:-1]}  # the norm's bias frozen: entries past the trainable range
    return block, build_block_store(3, order_entries(named, group_of), dtype, False, True)


def _same_memory(tensor: torch.Tensor, buffer: torch.Tensor, offset: int) -> bool:
    return tensor.data_ptr() == buffer.data_ptr() + offset * buffer.element_size()


def test_parameters_follow_the_buffer_they_are_pointed_at():
    block, store = _store()
    slot_buffer = torch.zeros(store.numel)
    slot = Slot(0, slot_buffer, None, None)
    for _ in range(2):  # the second round uses the views made in the first
        Window._point_at(store, slot)
        for entry in store.entries:
            assert _same_memory(entry.param.data, slot_buffer, entry.offset) and entry.param.shape == entry.shape
        store.point_params_at(store.working)
        for entry in store.entries:
            assert _same_memory(entry.param.data, store.working, entry.offset)
    assert list(slot.views) == [3]
    # Through the made views the parameters read the buffer's values (what the model computes with).
    store.working.copy_(torch.arange(store.numel, dtype=torch.float32))
    weight = block[0].weight
    assert torch.equal(weight.reshape(-1), torch.arange(weight.numel(), dtype=torch.float32)
                       + next(e.offset for e in store.entries if e.param is weight))


def test_gradient_destinations_are_the_buffer_and_follow_a_swap():
    _, store = _store()
    destinations = store.grad_destinations()
    assert sorted(destinations) == sorted(e.offset for e in store.trainable)
    for entry in store.trainable:
        assert _same_memory(destinations[entry.offset], store.grad, entry.offset)
        assert destinations[entry.offset].shape == entry.shape
    old = weakref.ref(store.grad)
    store.grad = torch.empty(store.trainable_numel)  # as device_accum.py's switch to GPU accumulation does
    del destinations
    assert old() is None, "the made views kept the replaced gradient buffer alive"
    for entry in store.trainable:
        assert _same_memory(store.grad_destinations()[entry.offset], store.grad, entry.offset)


def test_trading_places_with_the_spare_buffer_keeps_both_buffers_views():
    """Host accumulation swaps `grad` and `grad_spare` every other micro-step (cpu_optim.py): each buffer's views are
    made once and handed out again when it comes back."""
    _, store = _store()
    first = store.grad_destinations()
    store.grad, store.grad_spare = store.grad_spare, store.grad
    second = store.grad_destinations()
    for entry in store.trainable:
        assert _same_memory(second[entry.offset], store.grad, entry.offset)
    store.grad, store.grad_spare = store.grad_spare, store.grad
    assert store.grad_destinations() is first
    store.grad, store.grad_spare = store.grad_spare, store.grad
    assert store.grad_destinations() is second


def test_a_replaced_working_copy_is_not_kept_by_its_views():
    _, store = _store(torch.bfloat16)  # in fp32 the master is the working copy's view, holding it
    store.point_params_at(store.working)
    replacement = store.working.clone()
    old = weakref.ref(store.working)
    store.working = replacement
    store.point_params_at(store.working)  # the parameters let go of the old copy's memory too
    assert old() is None
    for entry in store.entries:
        assert _same_memory(entry.param.data, replacement, entry.offset)
