"""examples/bench/scaling.py: issue 14's report from data-parallel configuration lines (synthetic ones here)."""
import json

from examples.bench import scaling


def _line(system, world, sps, commit="abc", layers=100, error=None, peak=50.0):
    return {"kind": "config", "role": "measure", "system": system, "world_size": world, "samples_per_s": sps,
            "step_s": world * 16 / sps if sps else None, "commit": commit, "layers": layers, "gpu_cap_GB": 32, "error": error,
            "params_B": 5.14, "node": {"peak_used_GB": peak, "steady_used_GB": peak - 2}}


def test_efficiency_and_ratios_come_from_one_commit_and_shape():
    records = [
        _line("stronghold", 1, 4.0, commit="old"),  # another commit: left out
        _line("stronghold", 1, 3.8), _line("stronghold", 2, 7.4), _line("stronghold", 8, 27.36, peak=60.0),
        _line("stronghold", 4, 0.0, error="timeout"),  # a failure: left out
        _line("zero_offload", 2, 3.1), _line("zero_offload", 8, 9.12),
        {"kind": "summary"},
    ]
    report = scaling.scaling(records)
    rows = {row["world_size"]: row for row in report["systems"]["stronghold"]}
    assert sorted(rows) == [1, 2, 8] and rows[1]["samples_per_s"] == 3.8
    assert abs(rows[8]["efficiency"] - 27.36 / (8 * 3.8)) < 1e-12 and rows[8]["node_peak_used_GB"] == 60.0
    assert report["efficiency_at_8"] == rows[8]["efficiency"] and report["efficiency_at_8_met"] is True
    assert report["systems"]["zero_offload"][0]["efficiency"] is None, "no 1-GPU ZeRO-Offload line to scale by"
    assert abs(report["stronghold_over_zero_offload"][8] - 3.0) < 1e-12
    assert report["commit"] == "abc" and report["layers"] == 100


def test_no_success_reports_nothing(tmp_path, capsys):
    assert scaling.scaling([_line("stronghold", 1, 0.0, error="oom")])["systems"] == {}
    path = tmp_path / "dp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [_line("stronghold", 1, 3.8), _line("stronghold", 2, 7.2)]))
    assert scaling.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    assert "stronghold:2: 7.200 samples/s, efficiency 0.947" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["efficiency_at_8"] is None
    assert scaling.main([str(tmp_path / "missing.jsonl")]) == 2
