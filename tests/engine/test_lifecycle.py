"""A block's lifecycle (stronghold/streaming/lifecycle.py) driven directly: its transitions and what they guard."""
import re
from pathlib import Path

import pytest
import torch

import stronghold
from stronghold.streaming.lifecycle import BlockLife, Residency
from stronghold.streaming.schedule import Phase

from .helpers import cpu_window


def test_a_new_block_is_on_the_host_readable_with_its_gradient_buffer_free():
    life = BlockLife()
    assert (life.version, life.residency, life.slot, life.held, life.gathered) == (0, Residency.HOST, None, None, None)
    assert life.updated.is_set() and life.grad_free.is_set()


def test_an_update_makes_the_weights_unreadable_until_done_and_bumps_the_version_once():
    life = BlockLife()
    life.update_begins()
    assert life.version == 1 and not life.updated.is_set()
    assert life.grad_free.is_set(), "the update leaves the gradient buffer to its own transitions"
    assert not life.updated.wait(timeout=0)
    life.update_done()
    assert life.version == 1 and life.updated.is_set()


def test_replaced_weights_stay_readable_with_a_new_version():
    life = BlockLife()
    life.weights_replaced()
    life.weights_replaced()
    assert life.version == 2 and life.updated.is_set()


def test_the_gradient_buffer_is_claimed_and_released():
    life = BlockLife()
    life.grads_claimed()
    assert not life.grad_free.is_set() and life.updated.is_set()
    life.grads_released()
    assert life.grad_free.is_set()


def test_settled_is_idempotent_and_ends_an_update_and_a_claim():
    life = BlockLife()
    life.update_begins()
    life.grads_claimed()
    life.settled()
    assert life.updated.is_set() and life.grad_free.is_set() and life.version == 1
    life.settled()  # the abort path settles every block of the micro-step, wherever each one stopped
    assert life.updated.is_set() and life.grad_free.is_set() and life.version == 1


def test_held_gradients_are_taken_once_and_dropped_only_by_their_own_micro_step():
    life, micro, other = BlockLife(), object(), object()
    life.hold(micro)
    life.drop_held(other)
    assert life.held is micro
    assert life.take_held() is micro and life.held is None
    assert life.take_held() is None
    life.hold(micro)
    life.drop_held(micro)
    assert life.held is None
    life.drop_held(micro)  # already gone: nothing to do
    assert life.held is None


def test_the_gpu_copy_goes_host_in_flight_resident_host():
    life = BlockLife()
    life.loading(2)
    assert (life.residency, life.slot) == (Residency.IN_FLIGHT, 2)
    life.arrived()
    assert (life.residency, life.slot) == (Residency.RESIDENT, 2)
    life.loading(0)  # a resident block loaded into another slot (its first slot's copy went stale)
    assert (life.residency, life.slot) == (Residency.IN_FLIGHT, 0)
    life.evicted()
    assert (life.residency, life.slot) == (Residency.HOST, None)


def test_illegal_gpu_copy_transitions_fail_loudly():
    life = BlockLife()
    with pytest.raises(AssertionError, match="in flight"):
        life.arrived()
    with pytest.raises(AssertionError, match="in a slot"):
        life.evicted()
    life.loading(1)
    life.arrived()
    with pytest.raises(AssertionError, match="in flight"):
        life.arrived()
    assert (life.residency, life.slot) == (Residency.RESIDENT, 1), "a refused transition changes nothing"


def test_gathered_states_are_held_and_released():
    life, states = BlockLife(), {0: (torch.zeros(2), torch.zeros(2), torch.zeros(2))}
    life.gather(states)
    assert life.gathered is states
    life.release_gathered()
    assert life.gathered is None


def test_a_version_bump_makes_the_slot_copy_stale_and_the_window_loads_again():
    window = cpu_window(2, 2)
    window.begin(Phase.FORWARD, training=False)
    window.enter(0)
    store = window.stores[0]
    assert store.life.residency is Residency.RESIDENT and store.life.slot is not None
    loads = window.stats.loads
    window.enter(0)
    assert window.stats.loads == loads, "a current slot copy is used as it is"
    store.working.fill_(7.0)
    store.life.weights_replaced()
    window.enter(0)
    assert window.stats.loads == loads + 1
    assert torch.equal(store.entries[0].param.data, torch.full((4,), 7.0))


def test_only_the_lifecycle_module_sets_or_clears_the_block_flags():
    """The ownership test sees attribute writes; a flag's set() and clear() are calls, so they are looked for here."""
    package = Path(stronghold.__file__).parent
    call = re.compile(r"\.(updated|grad_free)\.(set|clear)\(")
    found = [f"{path.relative_to(package)}:{n}" for path in package.rglob("*.py") if path.name != "lifecycle.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if call.search(line)]
    assert found == []
