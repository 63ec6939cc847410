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


def test_phases_sum_each_name_over_the_micro_batches():
    """Host seconds per phase are the gaps between consecutive marks, summed by name; on the CPU there are no events,
    so no GPU phases. Sleeps of 20 ms are the phases: the sums are compared with >= (sleep never returns early) and a
    loose upper bound (a busy CI host may delay a thread by tens of ms)."""
    import time

    probes = step_probes.StepProbes(SimpleNamespace())
    probes._cuda = None  # the host clock alone, on any machine
    try:
        probes.before()
        for name in ("forward", "backward", "forward", "backward", "update"):
            probes.mark(name)
            time.sleep(0.02)
        probes.mark("end")
        step = probes.after()
    finally:
        probes.close()
    host = step["phase_host_s"]
    assert set(host) == {"forward", "backward", "update"} and step["phase_gpu_s"] == {}
    assert 0.04 <= host["forward"] < 1.0 and 0.04 <= host["backward"] < 1.0 and 0.02 <= host["update"] < 1.0
    assert "phase_host_s" not in _step(probes, []), "a step without marks records no phases"
