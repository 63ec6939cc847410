"""examples/bench/step_probes.py's count of objects a step moves into Python's oldest generation, on a step that
keeps objects alive across a generation-1 collection (forced here; in training the allocations trigger it)."""
import gc
from types import SimpleNamespace

from examples.bench import step_probes


class _Kept:
    """A container object of this test's own type, so the type count can name it."""


def _step(probes, kept):
    probes.before()
    kept.extend(_Kept() for _ in range(500))
    gc.collect(1)  # the young generations' survivors, these 500 among them, move to the oldest
    return probes.after()


def test_a_step_counts_what_it_promotes_and_optionally_its_types(monkeypatch):
    engine = SimpleNamespace()  # no stronghold runtime, no gradient norm: the collector's counters only
    kept = []
    probes = step_probes.StepProbes(engine)
    try:
        step = _step(probes, kept)
    finally:
        probes.close()
    assert step["gc1_runs"] >= 1 and step["gc_promoted"] >= 500 and "gc_promoted_types" not in step
    monkeypatch.setenv(step_probes.TYPES_ENV, "1")
    probes = step_probes.StepProbes(engine)
    try:
        step = _step(probes, kept)
    finally:
        probes.close()
    assert step["gc_promoted_types"]["_Kept"] >= 500 and len(step["gc_promoted_types"]) <= 10
