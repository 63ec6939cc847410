"""examples/bench/cpu_probe_spread.py on the CPU: one round per condition, its record's shape and both clocks."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_spread_records_both_clocks_for_every_condition(tmp_path):
    out = tmp_path / "spread.jsonl"
    run = subprocess.run([sys.executable, "-m", "examples.bench.cpu_probe_spread", "--rounds", "1", "--gap-s", "0",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["bench"] == "cpu_probe_spread" and record["probe_numel"] == 16 * 2 ** 20
    assert set(record["conditions"]) == {"alone", "beside_python_spin", "beside_hash", "beside_memory_copy",
                                         "alone_after"}
    for result in record["conditions"].values():
        (row,) = result["rounds"]
        assert len(row["wall_G"]) == 3 and all(rate > 0 for rate in row["wall_G"])
        if record["kernel"] == "NativeAdamW":  # the eager reference keeps no clock of its own
            assert len(row["kernel_G"]) == 3
            assert all(k >= w for k, w in zip(row["kernel_G"], row["wall_G"])), "bounded by the wall's rate"
        assert result["wall_clock"]["min"] <= result["wall_clock"]["median"] <= result["wall_clock"]["max"]


def test_bad_rounds_are_refused():
    run = subprocess.run([sys.executable, "-m", "examples.bench.cpu_probe_spread", "--rounds", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--rounds must be at least 1" in run.stderr

