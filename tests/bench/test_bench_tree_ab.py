"""examples/bench/tree_ab.sh and its summary: two trees alternated at the same points in one call."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.bench import tree_ab_summary

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--arch llama --hidden 64 --intermediate 128 --layers 2 --heads 4 --kv-heads 2 --vocab 256 --seq 32 --batch 2 "
        "--accumulation 2 --gpu-cap-gb none")


def _record(commit, pair, step_s, resident=1, window=12, error=None, hidden=4096):
    return {"arch": "llama", "hidden": hidden, "layers": 32, "seq": 2048, "batch": 1, "accumulation": 8,
            "gpu_cap_GB": 24.0, "commit": commit, "repeat": pair, "step_s": step_s, "error": error,
            "peak_gpu_GB": 21.4, "peak_host_GB": 116.7,
            "stronghold": {"resident_blocks": resident, "window_size": window, "blockwise_backward": True}}


def _write(out: Path, records) -> None:
    (out / "bench").mkdir(parents=True)
    (out / "bench" / "tree_ab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_summary_takes_each_commits_median_and_the_head_over_the_base_that_ran_first(tmp_path):
    _write(tmp_path, [_record("base", 1, 4.744, 2, 2), _record("head", 1, 4.220), _record("base", 2, 4.695, 2, 2),
                      _record("head", 2, 4.338), _record("base", 3, None, error="oom_gpu"),
                      _record("base", 1, 1.6, 16, 12, hidden=2560)])
    summary = tree_ab_summary.summarize(tmp_path)
    eight, small = summary["points"]
    assert eight["base"] == "base" and eight["head"] == "head"
    assert eight["medians_s"] == pytest.approx({"base": (4.744 + 4.695) / 2, "head": (4.220 + 4.338) / 2})
    assert eight["runs"] == {"base": 2, "head": 2}, "a run that failed has no step"
    assert eight["head_over_base"] == pytest.approx((4.220 + 4.338) / (4.744 + 4.695))
    assert small["head"] is None and small["head_over_base"] is None, "one tree only: no ratio"
    assert summary["rows"][0]["placement"] == "R2 W2 blockwise" and summary["rows"][4]["error"] == "oom_gpu"
    assert json.loads((tmp_path / "tree_ab_summary.json").read_text()) == summary


def test_the_records_go_to_a_results_file_with_their_call(tmp_path, capsys):
    _write(tmp_path, [_record("base", 1, 4.7), _record("head", 1, 4.2)])
    dest = tmp_path / "e2e.jsonl"
    dest.write_text('{"earlier": true}\n')
    assert tree_ab_summary.main([str(tmp_path), "--same-call", "a-call", "--out", str(dest)]) == 0
    lines = [json.loads(line) for line in dest.read_text().splitlines()]
    assert lines[0] == {"earlier": True}, "appended, nothing already there lost"
    assert [(r["commit"], r["same_call"]) for r in lines[1:]] == [("base", "a-call"), ("head", "a-call")]
    assert "head over base: 0.894" in capsys.readouterr().out


def test_the_summary_names_what_is_missing(tmp_path, capsys):
    assert tree_ab_summary.main([str(tmp_path)]) == 1
    assert "no records at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tree_ab_summary.main([str(tmp_path), "--same-call", "a-call"])
    assert "go together" in capsys.readouterr().err


def test_run_refuses_a_folder_that_is_not_a_prepared_tree(tmp_path):
    run = subprocess.run(["bash", "examples/bench/tree_ab.sh", "run", str(tmp_path / "out"), str(tmp_path),
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "is not a prepared tree" in run.stdout


@pytest.mark.slow
def test_two_prepared_trees_alternate_on_a_tiny_point(tmp_path):
    """The whole script on the CPU: this commit exported twice (as base and head), one pair of a tiny Llama."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("needs the repo's git history")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT", "STRONGHOLD_COMMIT", "BENCH_COMMIT")}
    env.update(DS_ACCELERATOR="cpu", TRITON_INTERPRET="1", POINT=TINY, PAIRS="1", WARMUP_STEPS="1", TIMED_STEPS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # the script's python3: this one
    for name in ("base", "head"):
        prepared = subprocess.run(["bash", "examples/bench/tree_ab.sh", "prepare", str(tmp_path / name), "HEAD"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert prepared.returncode == 0, prepared.stderr + prepared.stdout
    (tmp_path / "head" / ".commit").write_text("headtree\n")  # the same code under another name: which ran is seen
    run = subprocess.run(["bash", "examples/bench/tree_ab.sh", "run", str(tmp_path / "out"), str(tmp_path / "base"),
                          str(tmp_path / "head"), "custom"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "bench" / "tree_ab.jsonl").read_text().splitlines()]
    base_commit = (tmp_path / "base" / ".commit").read_text().strip()
    assert [(r["commit"], r["repeat"], r["error"]) for r in records] == [(base_commit, 1, None),
                                                                         ("headtree", 1, None)]
    assert all(r["step_s"] > 0 for r in records)
    assert f"headtree over {base_commit}" in run.stdout
