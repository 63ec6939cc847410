"""The parent/child runner: outcome classification on real child processes (simulated failures),
and one real tiny point per DeepSpeed system on the CPU (several seconds each; the first ZeRO-Offload
run JIT-builds DeepSpeedCPUAdam, ~45 s on a fresh machine)."""
import signal

import pytest
from bench_fakes import TINY

from examples.bench.harness import RunnerConfig, classify, failure_fields, parse_child_output, run_point
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
    assert classify_exception(MemoryError("stronghold's placement does not fit host memory: 20 streamed (That is with "
                                          "...; with them on the GPU: stronghold's placement does not fit the GPU: "
                                          "resident_blocks=0)")) == "oom_host", "the leading attempt binds"
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
    pytest.param("oom_gpu", "oom_gpu", 120, marks=pytest.mark.slow),
    pytest.param("oom_host", "oom_host", 120, marks=pytest.mark.slow),
    # The child must print its start line (it imports torch and DeepSpeed) before the deadline: seconds on a
    # loaded 2-core machine, so a minute.
    pytest.param("timeout", "timeout", 60, marks=pytest.mark.slow),
    ("crash", "error", 120),
    pytest.param("silent_exit", "error", 120, marks=pytest.mark.slow),
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


@pytest.mark.slow  # a child process per system, each importing torch and DeepSpeed
@pytest.mark.parametrize("system", ["no_offload", "zero_offload", "zero_infinity"])
def test_real_tiny_point_on_cpu(tmp_path, system, monkeypatch):
    """Each DeepSpeed system trains the tiny model (stronghold: test_bench_cli.py), also where this process has a
    rendezvous of its own that still listens (an engine built earlier in a test process): the child makes its own."""
    import torch.distributed

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    point = TINY_POINT.with_(system=system)
    r = run_point(point, 300, RunnerConfig(log_dir=tmp_path), PROV)
    assert r["error"] is None, r.get("error_detail") or (tmp_path / f"{point.label()}.err").read_text()[-3000:]
    missing = [k for k in REQUIRED if r.get(k) is None and k != "gpu_cap_GB"]
    assert not missing
    assert len(r["step_s_all"]) == 2 and r["samples_per_s"] == pytest.approx(2 / r["step_s"])
    assert 9 < r["loss_first"] < 12


def _stale_shm_lock(tmp_path, monkeypatch):
    """A lock file as a build of DeepSpeed's CPU shared-memory op leaves when it is killed midway."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    lock = tmp_path / "extensions" / _get_build_directory("deepspeed_shm_comm", False) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    return lock


def test_a_timeouts_detail_names_the_build_locks(tmp_path, monkeypatch):
    lock = _stale_shm_lock(tmp_path, monkeypatch)
    err = tmp_path / "child.err"
    err.write_text("importing\nbuilding\n")
    timed_out = failure_fields("timeout", err, None)
    assert timed_out["build_locks"] == [str(lock)] and str(lock) in timed_out["error_detail"]
    assert timed_out["error_detail"].endswith("building") and timed_out["stderr_tail"] == "importing\nbuilding"
    assert failure_fields("error", err, "ValueError: bad") == {"stderr_tail": "importing\nbuilding",
                                                              "error_detail": "ValueError: bad"}
    lock.unlink()
    assert "build_locks" not in failure_fields("timeout", err, None)


@pytest.mark.slow
def test_a_deepspeed_peer_does_not_wait_on_the_shm_ops_build(tmp_path, monkeypatch):
    """A rank killed while it JIT-builds DeepSpeed's CPU shared-memory op leaves the build's lock, and every later
    build waits on it: the peers skip that op (training never uses it), so a stale lock cannot hold them."""
    _stale_shm_lock(tmp_path, monkeypatch)
    r = run_point(TINY_POINT.with_(system="no_offload"), 120, RunnerConfig(log_dir=tmp_path), PROV)
    assert r["error"] is None, r.get("error_detail")


@pytest.mark.slow
def test_profile_flag_reaches_the_child(tmp_path):
    """`--profile` is passed on and accepted; on a CPU there is no GPU step to profile, so no `profile` field."""
    r = run_point(TINY_POINT.with_(system="no_offload"), 300, RunnerConfig(log_dir=tmp_path, profile=True), PROV)
    assert r["error"] is None, r.get("error_detail")
    assert "profile" not in r
