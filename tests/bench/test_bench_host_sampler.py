"""host_sampler: the sampled stacks name where a thread spends its time, by thread, in seconds. No verdict here rests
on how long anything took: the threads wait for the sampler's count, and the weights are checked where they are set."""
import threading
import time

import pytest

from examples.bench.host_sampler import HostSampler, sample_host_one_step


def _wait_for_samples(sampler: HostSampler, more: int) -> None:
    """Spin in Python until the sampler has taken `more` samples after this call began: each of them finds the
    calling thread inside this function."""
    target = sampler.samples + more
    while sampler.samples < target:
        pass


def _wait_in_helper(sampler: HostSampler, more: int) -> None:
    target = sampler.samples + more
    while sampler.samples < target:
        time.sleep(0.0005)


def _park(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()


def _sample_here(sampler: HostSampler, weight: float) -> None:
    sampler.take(weight)


def test_a_sample_charges_its_weight_to_each_thread_where_it_is_and_to_what_it_is_inside():
    sampler = HostSampler(0.001)  # not started: the test takes each sample itself, with the weight it chooses
    started, release = threading.Event(), threading.Event()
    parked = threading.Thread(target=_park, args=(started, release), name="parked")
    parked.start()
    started.wait()
    try:
        _sample_here(sampler, 0.25)
        _sample_here(sampler, 0.5)
    finally:
        release.set()
        parked.join()
    out = sampler.summary()
    assert out["samples"] == 2
    main, helper = out["threads"]["MainThread"], out["threads"]["parked"]
    for thread in (main, helper):
        assert thread["sampled_s"] == pytest.approx(0.75)
        assert sum(thread["top_leaf_s"].values()) == pytest.approx(0.75), "every sample's weight goes to one leaf"
    (leaf,) = main["top_leaf_s"]
    assert leaf.startswith("take "), "the main thread was in the sampler's own call both times"
    inside = {where.split(" ")[0]: s for where, s in main["top_inside_s"].items()}
    assert inside["_sample_here"] == pytest.approx(0.75) and inside["take"] == pytest.approx(0.75)
    assert any(where.startswith("_park ") and s == pytest.approx(0.75) for where, s in helper["top_inside_s"].items())
    assert not any(where.startswith("_park ") for where in helper["top_leaf_s"]), "it waits inside Event.wait"


def test_the_running_sampler_follows_each_thread_and_leaves_itself_out():
    with HostSampler(0.001) as sampler:
        _wait_for_samples(sampler, 5)
        helper = threading.Thread(target=_wait_in_helper, args=(sampler, 5), name="helper")
        helper.start()
        helper.join()
    out = sampler.summary()
    assert out["samples"] >= 10 and out["period_s"] > 0
    main = out["threads"]["MainThread"]
    assert any(where.startswith("_wait_for_samples ") for where in main["top_inside_s"])
    assert any(where.startswith("_wait_in_helper ") for where in out["threads"]["helper"]["top_inside_s"])
    # One weight a sample to every thread present: the helper was there for fewer of them than the main thread.
    assert out["threads"]["helper"]["sampled_s"] <= main["sampled_s"]
    assert "host-sampler" not in out["threads"]


def test_one_step_reports_the_step_beside_its_samples():
    out = sample_host_one_step(lambda: 1.5, interval_s=0.001)
    assert out["step_s"] == 1.5 and out["samples"] >= 0 and "threads" in out


def test_rejects_a_nonpositive_interval():
    with pytest.raises(ValueError, match="interval_s"):
        HostSampler(0.0)
