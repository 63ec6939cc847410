"""Python's full garbage collections at optimizer-step boundaries (engine/collector.py): with the collector managed,
every full collection during training is one the engine ran at a boundary; the interpreter's thresholds are put
back once the last engine is gone; "python" and a script's own `gc.disable()` are left alone. The two-rank agreement
is in test_data_parallel.py. Young-generation thresholds are set tiny here so that, left to itself, the interpreter
runs full collections inside a few tiny steps (the "python" run shows it does)."""
import gc
import signal

import pytest

import stronghold
from stronghold.engine import collector
from stronghold.engine.collector import NO_AUTOMATIC, StepCollector

from .helpers import batches, ds_config, run_steps, tiny_llama

pytestmark = pytest.mark.skipif(collector.INCREMENTAL, reason="Python 3.14+ collects the oldest generation "
                                                              "incrementally: \"auto\" leaves it alone")

EAGER = (10, 2, 2)
"""Thresholds under which the interpreter starts full collections every few hundred allocations."""


@pytest.fixture
def eager_collector(monkeypatch):
    """Tiny thresholds, and the thresholds' owners of this test alone: engines that other tests' fixtures keep alive
    keep the interpreter's full collections off meanwhile, which would hide what these tests look for."""
    saved, enabled = gc.get_threshold(), gc.isenabled()
    monkeypatch.setattr(collector, "_THRESHOLDS", collector._Thresholds())
    gc.collect()
    gc.set_threshold(*EAGER)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        (gc.enable if enabled else gc.disable)()


class FullCollections:
    """Each full collection's boundary count on `engine`'s collector (None: not inside one of its collections)."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def __enter__(self):
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start" and info["generation"] == 2:
            self.seen.append(self.engine.stronghold_runtime.collector.boundaries)


def _engine(setting=None, **cfg):
    config = ds_config(lr=1e-3, window=2, resident=1, **cfg)
    if setting is not None:
        config["stronghold"]["garbage_collection"] = setting
    engine, _, _, _ = stronghold.initialize(model=tiny_llama(4), config=config)
    return engine


def _survivors(engine, per_forward: int = 100_000) -> None:
    """A forward pre-hook whose list (alive as long as the hook) keeps objects that outlive the young collections, as
    a large model's step makes (activation checkpointing's holders): enough that the interpreter's rule for a full
    collection (the survivors since the last one exceed a quarter of all it tracks) is met within a few steps."""
    kept = []
    engine.module.register_forward_pre_hook(lambda module, args: kept.extend([] for _ in range(per_forward)))


@pytest.mark.parametrize("every,gas", [(2, 1), (1, 2)])
def test_full_collections_run_only_at_the_boundaries(eager_collector, every, gas):
    engine = _engine(every, gas=gas)
    assert gc.get_threshold() == (*EAGER[:2], NO_AUTOMATIC)
    steps = 6
    _survivors(engine)
    with FullCollections(engine) as full:
        run_steps(engine, batches(steps * gas))
    report = engine.stronghold_report()["garbage_collection"]
    assert full.seen == list(range(every, steps + 1, every)), "one at every boundary due, none anywhere else"
    assert report["collections"] == len(full.seen) and report["interval_steps"] == every
    engine.destroy()
    assert gc.get_threshold() == EAGER


def test_auto_times_one_collection_at_the_second_step_and_sets_the_interval(eager_collector, monkeypatch):
    engine = _engine()
    _survivors(engine)
    own = engine.stronghold_runtime.collector
    ran_at, collect = [], own._collect
    monkeypatch.setattr(own, "_collect", lambda: ran_at.append(own.boundaries) or collect())
    with FullCollections(engine) as full:
        run_steps(engine, batches(6))
    report = engine.stronghold_report()["garbage_collection"]
    assert report["mode"] == "steps" and report["interval_steps"] >= 1
    assert report["measured_collect_s"] > 0 and report["measured_step_s"] > 0
    assert ran_at[0] == collector.FIRST_BOUNDARY
    assert full.seen == ran_at, "every full collection is one the engine ran at a boundary"
    engine.destroy()
    assert gc.get_threshold() == EAGER


def test_python_leaves_the_interpreter_alone(eager_collector):
    engine = _engine("python")
    assert gc.get_threshold() == EAGER
    _survivors(engine)
    with FullCollections(engine) as full:
        run_steps(engine, batches(4))
    assert engine.stronghold_report()["garbage_collection"]["collections"] == 0
    assert full.seen, "the interpreter's own full collections ran (else the other tests show nothing)"
    engine.destroy()


def test_a_script_that_disabled_the_collector_is_left_alone(eager_collector):
    gc.disable()
    engine = _engine()
    assert gc.get_threshold() == EAGER
    run_steps(engine, batches(3))
    report = engine.stronghold_report()["garbage_collection"]
    assert report["mode"] == "python" and report["collections"] == 0 and not gc.isenabled()
    engine.destroy()


def test_thresholds_come_back_with_the_last_collector_closed_or_collected(eager_collector):
    first, second, third = StepCollector(None), StepCollector(3), StepCollector(None)
    assert gc.get_threshold()[2] == NO_AUTOMATIC
    first.close()
    second.close()
    assert gc.get_threshold()[2] == NO_AUTOMATIC, "the third still runs"
    del third  # dropped without close(): its finalizer gives the thresholds back
    gc.collect()
    assert gc.get_threshold() == EAGER


def test_thresholds_the_script_sets_while_an_engine_lives_are_the_ones_put_back(eager_collector):
    first = StepCollector(None)
    gc.set_threshold(20, 3, 5)  # the script's own, between two engines
    second = StepCollector(None)
    assert gc.get_threshold() == (20, 3, NO_AUTOMATIC)
    first.close()
    second.close()
    second.close()
    assert gc.get_threshold() == (20, 3, 5)


def test_interval_keeps_collections_to_a_share_of_the_step_and_a_bounded_gap(monkeypatch):
    """0.4 s collections: on a 0.85 s step the 1% share asks for 48 steps, the gap bound (30 s) allows 35; on a
    7 s step the share asks for 6 and the bound allows 4; a step longer than the bound collects every step."""
    intervals = []
    for step_s, expected in ((0.85, 35), (7.0, 4), (40.0, 1), (0.01, 40)):
        c = StepCollector("python")  # the arithmetic only: no thresholds taken
        monkeypatch.setattr(c, "_collect", lambda: 0.4 if step_s != 0.01 else 0.004)
        c._measure(step_s, c._collect())
        intervals.append(c.report.interval_steps)
        assert c.report.interval_steps == expected, (step_s, intervals)


def test_each_collection_sets_the_interval_again_from_the_median_step_since_the_one_before(eager_collector,
                                                                                          monkeypatch):
    """0.4 s collections; a 4 s second step (the first step's deferred updates, promotion), then 0.8 s steps with
    one 3 s step among them. Timed at the second step: the 1% share asks for 10 steps, the 30 s gap bound allows 7.
    The collection 7 steps later sets it from the median 0.8 s step: 50 asked, 37 allowed (as a 0.8 s step alone)."""
    clock = [0.0]
    monkeypatch.setattr(collector.time, "perf_counter", lambda: clock[0])
    c = StepCollector(None)
    ran_at = []
    monkeypatch.setattr(c, "_collect", lambda: ran_at.append(c.boundaries) or 0.4)
    steps = [1.0, 4.0] + [0.8] * 3 + [3.0] + [0.8] * 42
    intervals = []
    for step_s in steps:
        clock[0] += step_s
        c.after_step()
        intervals.append(c.report.interval_steps)
    assert ran_at == [2, 9, 46]
    assert intervals[1:3] == [7, 7] and intervals[8:10] == [37, 37]
    assert c.report.measured_step_s == pytest.approx(0.8, abs=1e-12)  # a sum of float clock readings
    c.close()


class _CtrlCWhenFreed:
    """Garbage in a reference cycle (only a full collection frees it) whose finalizer sends this process a SIGINT:
    its KeyboardInterrupt surfaces inside the finalizer, where the interpreter prints it and drops it unless the
    collector holds it."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


def _ctrl_c_in_the_next_collection() -> None:
    _CtrlCWhenFreed()


def test_a_ctrl_c_during_a_boundary_collection_is_raised_after_it(eager_collector):
    c = StepCollector(1)
    gc.disable()  # the young collections would free the cycle at some allocation of their choosing
    _ctrl_c_in_the_next_collection()
    with pytest.raises(KeyboardInterrupt):
        c.after_step()
    assert c.report.collections == 1
    c.after_step()
    assert c.report.collections == 2, "the collector goes on after an interrupt the script caught"
    c.close()


def test_a_ctrl_c_during_the_timed_collection_leaves_the_next_boundary_to_time_one(eager_collector):
    c = StepCollector(None)
    gc.disable()
    c.after_step()
    _ctrl_c_in_the_next_collection()
    with pytest.raises(KeyboardInterrupt):
        c.after_step()
    assert c.report.interval_steps is None and c.report.collections == 1
    c.after_step()
    assert c.report.interval_steps >= 1 and c.report.collections == 2
    c.close()


@pytest.mark.parametrize("value", [0, -1, "sometimes", 1.5])
def test_bad_settings_name_the_key(value):
    with pytest.raises(ValueError, match="stronghold.garbage_collection"):
        _engine(value)
