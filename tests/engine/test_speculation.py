"""When the CPU optimizer updates a block early (speculation.py): the rule on its own, and in training,
where both choices must give torch AdamW's result (1e-5, the equivalence tests' bar) and the rule
decides only how much work overlaps backward (counted by `CpuStats`)."""
import copy
import math
import threading

import pytest

import stronghold
from stronghold.optim.speculation import SPECULATE_FRACTION, Forecast

from .helpers import batches, caught_up, ds_config, relative_error, tiny_llama, train_reference

LIMIT_SQ = 1.0  # max_norm 1
BOUND = SPECULATE_FRACTION ** 2


def _decide(forecast: Forecast, blocks: list[tuple[int, float]]) -> list[bool]:
    """Decisions for blocks in backward order, `blocks` = (index, sum of squares)."""
    forecast.end_step()
    running, out = 0.0, []
    for index, sq in blocks:
        out.append(forecast.speculate(index, running, sq, LIMIT_SQ))
        running += sq
    return out


def test_without_a_forecast_the_running_sum_decides():
    assert _decide(Forecast(), [(3, 0.3), (2, 0.3), (1, 0.3)]) == [True, True, False]  # 0.9 > 0.81


def test_a_steady_norm_below_the_bound_speculates_every_block():
    last = Forecast()
    last.record({3: 0.2, 2: 0.2, 1: 0.2}, total_sq=0.7)  # norm 0.84 of max: the old 0.8 rule deferred all
    assert last.other_sq == pytest.approx(0.1)
    assert _decide(last, [(3, 0.2), (2, 0.2), (1, 0.2)]) == [True, True, True]


def test_a_norm_above_the_bound_defers_from_the_first_block():
    last = Forecast()
    last.record({3: 0.3, 2: 0.3, 1: 0.3}, total_sq=1.2)
    assert _decide(last, [(3, 0.01), (2, 0.3), (1, 0.3)]) == [False, False, False]


def test_the_forecast_gives_way_to_what_the_step_produces():
    """Last step clipped because of block 3 (1.5 of 1.8); this step's block 3 replaces that forecast with
    its own 0.1 as soon as it is seen, so it and the rest speculate (0.1 + 0.2 + 0.1 others = 0.4)."""
    last = Forecast()
    last.record({3: 1.5, 2: 0.1, 1: 0.1}, total_sq=1.8)
    assert _decide(last, [(3, 0.1), (2, 0.1), (1, 0.1)]) == [True, True, True]
    assert _decide(last, [(3, 0.1), (2, 0.9), (1, 0.1)]) == [True, False, False]  # block 2 comes in large


def test_a_spike_is_never_updated_early():
    last = Forecast()
    last.record({3: 0.01, 2: 0.01, 1: 0.01}, total_sq=0.05)
    assert _decide(last, [(3, 0.01), (2, 50.0), (1, 0.01)]) == [True, False, False]


def test_a_skipped_step_leaves_the_forecast_alone():
    last = Forecast()
    last.record({3: 0.2}, total_sq=0.3)
    last.record({3: math.inf}, total_sq=math.inf)
    assert last.block_sq == {3: 0.2}


def test_checkpoint_state_round_trips_and_old_flags_map_onto_it():
    last = Forecast()
    last.record({3: 0.2, 5: 0.4}, total_sq=0.7)
    assert Forecast.from_state_dict(last.state_dict()) == last
    assert _decide(Forecast.from_state_dict(True), [(3, 0.0), (2, 0.0)]) == [False, False]
    assert Forecast.from_state_dict(False) == Forecast() == Forecast.from_state_dict(None)


def _train(model, data, clip: float):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=3e-3, clip=clip))
    norms = []
    for batch in data:
        engine.backward(engine(**batch).loss)
        caught_up(engine)
        engine.step()
        norms.append(engine.stronghold_runtime.grad_norm())
    engine.synchronize_host()
    return engine, norms


@pytest.fixture(scope="module")
def unclipped():
    """The run's global norms when nothing clips (max_norm far above them)."""
    model, data = tiny_llama(4), batches(6)
    return model, data, _train(model, data, clip=1e9)[1]


def test_a_norm_steadily_near_the_limit_overlaps_every_update(unclipped):
    """Every step's norm is at most 0.85 of max_norm, and steps before the last reach 0.8 of it (the old
    rule deferred every update of the step after such a norm): each streamed block is updated during
    backward, nothing is redone or deferred."""
    model, data, norms = unclipped
    clip = max(norms) / 0.85
    assert any(norm >= 0.8 * clip for norm in norms[:-1])
    engine, _ = _train(model, data, clip)
    stats = engine.stronghold_runtime.cpu.stats
    assert (stats.deferred_blocks, stats.redo_blocks) == (0, 0)
    assert relative_error(engine.module, train_reference(model, data, lr=3e-3, clip=clip)[0]) <= 1e-5


def test_clipping_every_step_defers_instead_of_redoing(unclipped):
    """Half the smallest norm as max_norm: every step clips. The first step has no forecast and updates
    its first blocks early (then redoes them); every later step defers all 3 streamed blocks."""
    model, data, norms = unclipped
    clip = min(norms) / 2
    engine, _ = _train(model, data, clip)
    stats = engine.stronghold_runtime.cpu.stats
    streamed = 3
    assert stats.redo_blocks <= streamed and stats.deferred_blocks >= streamed * (len(data) - 1)
    assert relative_error(engine.module, train_reference(model, data, lr=3e-3, clip=clip)[0]) <= 1e-5


def test_step_does_not_wait_for_an_early_update_that_stands(unclipped):
    """Clipping configured and not reached: step() confirms an early update still running on the worker and
    returns; the worker, as it finishes, marks the block updated; the run still ends at torch's result. The first
    update job is held inside its kernel until step() has returned (step() claims the blocks queued behind it); step()
    is called once that job is inside its kernel."""
    model, data, norms = unclipped
    clip = 2 * max(norms)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=3e-3, clip=clip))
    runtime = engine.stronghold_runtime
    kernel, entered, gate, held = runtime.cpu.kernel, threading.Event(), threading.Event(), []
    real_step = kernel.step

    def gated(p, *args, **kwargs):
        if not held:
            held.append(p.data_ptr())
            entered.set()
            assert gate.wait(10), "step() did not return while the early update was held"
        return real_step(p, *args, **kwargs)

    kernel.step = gated  # this engine's kernel object only
    engine.backward(engine(**data[0]).loss)
    assert entered.wait(60), "the worker never began an early update"
    engine.step()
    blocked = [i for i, store in runtime.stores.items() if store.master.data_ptr() == held[0]]
    assert blocked and not runtime.stores[blocked[0]].life.updated.is_set()
    gate.set()
    runtime.cpu.drain()
    assert runtime.stores[blocked[0]].life.updated.is_set()
    del kernel.step
    for batch in data[1:]:
        engine.backward(engine(**batch).loss)
        engine.step()
    engine.synchronize_host()
    assert relative_error(engine.module, train_reference(model, data, lr=3e-3, clip=clip)[0]) <= 1e-5
