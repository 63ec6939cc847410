"""`python -m examples.bench` end to end on the CPU: a real two-point stronghold sweep, resumed."""
import json
import subprocess
import sys

import pytest
from bench_fakes import ROOT

SWEEP = ["fig8b", "--layers", "2,3", "--caps", "none", "--hidden", "64", "--heads", "4", "--seq", "32",
         "--batch", "2", "--window-size", "2", "--warmup-steps", "1", "--timed-steps", "2"]


def bench(*argv, env=None):
    out = subprocess.run([sys.executable, "-m", "examples.bench", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_sweep_runs_then_resumes_from_the_store(tmp_path, monkeypatch):
    pytest.importorskip("stronghold.engine.engine")
    monkeypatch.setenv("BENCH_COMMIT", "cli-test")
    where = ["--results-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    starved = bench(*SWEEP, *where, "--budget-s", "1", "--min-start-s", "5")
    assert "fig8b: incomplete" in starved and not (tmp_path / "fig8b.jsonl").exists()

    first = bench(*SWEEP, *where)
    assert first.count("| new |") == 2 and "fig8b: complete" in first
    records = [json.loads(line) for line in (tmp_path / "fig8b.jsonl").read_text().splitlines()]
    assert [(r["layers"], r["error"], r["commit"]) for r in records] == [(2, None, "cli-test"), (3, None, "cli-test")]
    for r in records:
        assert r["stronghold_knobs"] == {"window_size": 2} and r["floor_s"] is not None
        report = r["stronghold"]
        assert report["streamed_blocks"] == r["layers"] - report["resident_blocks"] and "overlap" in report
        assert 9 < r["loss_first"] < 12 and r["peak_host_GB"] > 0.1
        # step_probes.py: one entry per timed step, the engine's counters grown within that step only (the report
        # reset after warm-up replaces the statistics between steps, never inside one).
        assert len(r["per_step"]) == 2
        for step in r["per_step"]:
            assert step["cpu_busy_s"] > 0 and step["host_hook_s"] > 0 and step["wait_cpu_update_s"] >= 0
            assert step["grad_norm"] > 0 and step["deferred_blocks"] >= 0
        busy = sum(step["cpu_busy_s"] for step in r["per_step"])
        assert busy == pytest.approx(report["overlap"]["cpu_optim_busy_s_per_step"] * 2, rel=1e-3, abs=1e-5)

    again = bench(*SWEEP, *where)
    assert again.count("| cached |") == 2 and "running" not in again

    bench("report", "--results-dir", str(tmp_path), "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2",
          "--window-size", "2")
    assert "| 0.003 B (3 layers) | ok |" in (tmp_path / "fig8b.md").read_text()
