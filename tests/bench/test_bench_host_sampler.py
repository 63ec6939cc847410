"""host_sampler: the sampled stacks name where a thread spends its time, by thread, in seconds."""
import threading
import time

import pytest

from examples.bench.host_sampler import HostSampler, sample_host_one_step


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sleep_in_helper(seconds: float) -> None:
    time.sleep(seconds)


def _step() -> float:
    start = time.perf_counter()
    _spin(0.15)
    helper = threading.Thread(target=_sleep_in_helper, args=(0.1,), name="helper")
    helper.start()
    helper.join()
    return time.perf_counter() - start


def test_the_busy_function_leads_and_threads_are_apart():
    out = sample_host_one_step(_step, interval_s=0.002)
    assert out["samples"] > 20 and out["period_s"] >= 0.002
    main = out["threads"]["MainThread"]
    spin = next(s for where, s in main["top_leaf_s"].items() if where.startswith("_spin "))
    # The spin is 0.15 s of the ~0.25 s step. The spinning thread holds the GIL, so samples land at its switch
    # interval (5 ms) and each is weighted by the time it stands for: the share errs by about one such interval at
    # each end of the spin, and on a loaded machine by however long the sampler waits for a core. The bounds are
    # shares and wide: they catch samples that are counted, not weighted, or charged to the wrong function.
    assert spin == max(main["top_leaf_s"].values())
    assert 0.3 < spin / out["step_s"] < 0.95
    assert 0.7 < main["sampled_s"] / out["step_s"] < 1.5
    assert any(where.startswith("_step ") for where in main["top_inside_s"])
    helper = out["threads"]["helper"]
    assert any(where.startswith("_sleep_in_helper ") for where in helper["top_leaf_s"])
    assert "host-sampler" not in out["threads"]


def test_rejects_a_nonpositive_interval():
    with pytest.raises(ValueError, match="interval_s"):
        HostSampler(0.0)
