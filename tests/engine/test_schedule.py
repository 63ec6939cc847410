"""The pure schedule, and the window driven through a whole training walk on the CPU."""
import pytest
import torch

from stronghold.streaming.schedule import Phase, WindowSchedule
from stronghold.streaming.window import Window

from .helpers import cpu_window


def test_lookahead_in_walk_order():
    s = WindowSchedule(tuple(range(2, 8)), window=3)
    assert s.lookahead(Phase.FORWARD, 2) == [3, 4]
    assert s.lookahead(Phase.FORWARD, 6) == [7]
    assert s.lookahead(Phase.FORWARD, 7) == []
    assert s.lookahead(Phase.BACKWARD, 7) == [6, 5]
    assert s.lookahead(Phase.BACKWARD, 3) == [2]
    assert s.start(Phase.FORWARD) == [2, 3, 4]
    assert s.start(Phase.BACKWARD) == [7, 6, 5]


def test_keep_only_the_last_window_for_backward():
    s = WindowSchedule(tuple(range(6)), window=2)
    assert [s.keep_after_forward(b, training=True) for b in range(6)] == [False] * 4 + [True] * 2
    assert not any(s.keep_after_forward(b, training=False) for b in range(6))


def test_victim_is_needed_furthest_in_the_future():
    s = WindowSchedule(tuple(range(6)), window=2)
    # Forward at block 2 of a training step: block 3 is next, 5 later, 0 only at the end of backward.
    assert s.victim(Phase.FORWARD, 2, [3, 5, 0], training=True) == 0
    # Without backward, a passed block is needed at the next forward, after 5.
    assert s.victim(Phase.FORWARD, 2, [3, 5, 0], training=False) == 0
    assert s.distance(Phase.FORWARD, 2, 5, False) < s.distance(Phase.FORWARD, 2, 0, False)
    # Backward at block 3: 2 is next, 5 (already done) is needed only in the next forward.
    assert s.victim(Phase.BACKWARD, 3, [2, 5], training=True) == 5
    assert s.victim(Phase.BACKWARD, 3, [], training=True) is None


def _training_walk(w: Window, n_blocks: int) -> None:
    w.begin(Phase.FORWARD, training=True)
    for b in range(n_blocks):
        w.enter(b)
        assert torch.equal(w.stores[b].entries[0].param.data, torch.full((4,), float(b)))
        w.exit_forward(b)
    w.begin(Phase.BACKWARD, training=True)
    for b in reversed(range(n_blocks)):
        w.enter(b)
        assert torch.equal(w.stores[b].entries[0].param.data, torch.full((4,), float(b)))
        w.release(b)


def test_training_walk_loads_each_block_once_per_direction_but_the_kept_ones():
    n, window = 6, 3
    w = cpu_window(n, window)
    _training_walk(w, n)
    assert w.stats.loads == 2 * n - window
    assert w.stats.demand_loads == 0, "the prefetcher issued every load before the block was needed"
    assert sum(slot.owner is not None for slot in w.slots) <= window


def test_stale_weights_are_reloaded_after_an_update():
    w = cpu_window(4, 2)
    _training_walk(w, 4)
    store = w.stores[1]
    store.working.fill_(41.0)
    store.life.update_begins()  # what the CPU optimizer does when it updates the block
    store.life.update_done()
    w.begin(Phase.FORWARD, training=False)
    w.enter(0)
    w.exit_forward(0)
    w.enter(1)
    assert torch.equal(store.entries[0].param.data, torch.full((4,), 41.0))


def test_a_block_not_in_the_window_is_loaded_on_demand():
    w = cpu_window(5, 2)
    w.begin(Phase.FORWARD, training=False)
    w.enter(4)  # out of order: nothing prefetched it
    assert w.stats.demand_loads == 1
    assert torch.equal(w.stores[4].entries[0].param.data, torch.full((4,), 4.0))


def _forward(w, n):
    w.begin(Phase.FORWARD, training=False)
    for b in range(n):
        w.enter(b)
        assert torch.equal(w.stores[b].entries[0].param.data, torch.full((4,), float(b)))
        w.exit_forward(b)


@pytest.mark.parametrize("n,window", [(8, 3), (8, 4), (8, 5), (8, 6), (8, 7), (5, 1)])
def test_forwards_one_after_another_load_what_the_planner_counts(n, window):
    """A forward with another after it (the blockwise backward's micro-steps, evaluation): one block ahead where more
    than two are left out, the first W - 2 kept (S - W + 2 loads); else W - 1 ahead, 2(S - W) loads."""
    from stronghold.streaming.schedule import later_forward_blocks
    w = cpu_window(n, window)
    _forward(w, n)
    assert w.stats.loads == n
    for _ in range(3):
        w.reset_stats()
        _forward(w, n)
        assert w.stats.loads == later_forward_blocks(n, window)
    assert later_forward_blocks(n, window) == {3: 7, 4: 6, 5: 5, 6: 4, 7: 2, 1: 5}[window]


def test_a_forward_with_another_after_it_looks_one_block_ahead_only_where_it_keeps_blocks():
    s = WindowSchedule(tuple(range(8)), window=4)
    assert s.depth(Phase.FORWARD, training=False) == 1
    assert s.depth(Phase.FORWARD, training=True) == 3  # backward follows: the last W are kept for it
    assert s.depth(Phase.BACKWARD, training=True) == 3
    assert WindowSchedule(tuple(range(8)), window=6).depth(Phase.FORWARD, training=False) == 5
