"""The parent/child runner: outcome classification on real child processes (simulated failures),
and one real tiny point per DeepSpeed system on the CPU (several seconds each; the first ZeRO-Offload
run JIT-builds DeepSpeedCPUAdam, ~45 s on a fresh machine)."""
import signal

import pytest
from bench_fakes import TINY

from examples.bench.harness import RunnerConfig, classify, parse_child_output, run_point
from examples.bench.point import Point
from examples.bench.run_one import classify_exception
from examples.bench.store import Provenance

PROV = Provenance(commit="test", dirty=False)
TINY_POINT = Point(system="no_offload", layers=2, gpu_cap_GB=None, warmup_steps=1, timed_steps=2, **TINY)


def test_classify_outcomes():
    assert classify({"error": None}, 0, False) is None
    assert classify({"error": "oom_gpu"}, 1, False) == "oom_gpu"
    assert classify({"error": None}, -signal.SIGKILL, True) is None, "a result line wins over a late kill"
    assert classify(None, -signal.SIGKILL, True) == "timeout"
    assert classify(None, -signal.SIGKILL, False) == "oom_host"
    assert classify(None, 137, False) == "oom_host"
    assert classify(None, 1, False) == "error"


def test_classify_exceptions():
    import torch

    assert classify_exception(torch.OutOfMemoryError("CUDA out of memory")) == "oom_gpu"
    assert classify_exception(RuntimeError("CUDA error: out of memory")) == "oom_gpu"
    assert classify_exception(MemoryError()) == "oom_host"
    # stronghold's planner refuses a placement before allocating anything: the GPU's capacity, not the host's
    assert classify_exception(MemoryError("stronghold's placement does not fit the GPU: resident_blocks=12")) == "oom_gpu"
    assert classify_exception(MemoryError("stronghold's placement does not fit host memory: 20 streamed")) == "oom_host"
    assert classify_exception(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")) == "oom_host"
    assert classify_exception(ValueError("bad")) == "error"
    try:
        try:
            raise MemoryError()
        except MemoryError as worker_error:
            raise RuntimeError("stronghold's CPU optimizer failed") from worker_error
    except RuntimeError as wrapped:
        assert classify_exception(wrapped) == "oom_host"


def test_child_output_is_found_among_log_lines():
    out = '[INFO] {not json\n{"event": "start", "device": "d"}\nnoise\n{"event": "result", "error": null}\n'
    start, result = parse_child_output(out)
    assert start["device"] == "d" and result == {"event": "result", "error": None}
    assert parse_child_output("crashed\n") == ({}, None)


@pytest.mark.parametrize("simulate, error, timeout_s", [
    ("oom_gpu", "oom_gpu", 120),
    ("oom_host", "oom_host", 120),
    ("timeout", "timeout", 8),
    ("crash", "error", 120),
    ("silent_exit", "error", 120),
])
def test_simulated_failures_become_outcomes(tmp_path, simulate, error, timeout_s):
    config = RunnerConfig(log_dir=tmp_path, simulate=simulate)
    r = run_point(TINY_POINT, timeout_s, config, PROV)
    assert r["error"] == error
    assert r["commit"] == "test" and r["system"] == "no_offload" and r["layers"] == 2
    assert r["device"].startswith("cpu"), "the start line survives the failure"
    assert r["peak_host_GB"] > 0.05, "wait4 reports the child's RSS, killed or not"
    if simulate == "timeout":
        assert r["wall_s"] < timeout_s + 10
    if simulate == "crash":
        assert "simulated crash" in r["error_detail"]
    if simulate == "silent_exit":
        assert r["returncode"] == 3 and "without a result line" in r["error_detail"]


REQUIRED = ("system", "hidden", "layers", "heads", "seq", "batch", "params_B", "gpu_cap_GB", "samples_per_s",
            "tokens_per_s", "peak_host_GB", "device", "commit", "date", "tflops", "mfu", "step_s", "build_s",
            "engine_init_s", "loss_first")


@pytest.mark.parametrize("system", ["no_offload", pytest.param("zero_offload", marks=pytest.mark.slow),
                                    pytest.param("zero_infinity", marks=pytest.mark.slow)])
def test_real_tiny_point_on_cpu(tmp_path, system):
    """Each DeepSpeed system trains the tiny model (stronghold: test_bench_cli.py)."""
    point = TINY_POINT.with_(system=system)
    r = run_point(point, 300, RunnerConfig(log_dir=tmp_path), PROV)
    assert r["error"] is None, r.get("error_detail") or (tmp_path / f"{point.label()}.err").read_text()[-3000:]
    missing = [k for k in REQUIRED if r.get(k) is None and k != "gpu_cap_GB"]
    assert not missing
    assert len(r["step_s_all"]) == 2 and r["samples_per_s"] == pytest.approx(2 / r["step_s"])
    assert 9 < r["loss_first"] < 12


@pytest.mark.slow
def test_profile_flag_reaches_the_child(tmp_path):
    """`--profile` is passed on and accepted; on a CPU there is no GPU step to profile, so no `profile` field."""
    r = run_point(TINY_POINT.with_(system="no_offload"), 300, RunnerConfig(log_dir=tmp_path, profile=True), PROV)
    assert r["error"] is None, r.get("error_detail")
    assert "profile" not in r
