"""examples/bench/first_step.sh and its summary: each run's first step against its steady one, labelled per run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fakes import ROOT

from examples.bench.first_step_summary import label, render, summarize

TINY = ("--arch llama --hidden 64 --layers 2 --heads 4 --kv-heads 2 --seq 64 --batch 2 --accumulation 2 --vocab 300 "
        "--steps 4 --warmup-steps 2")


def _record(**fields) -> dict:
    return {"stronghold": True, "trained": True, "commit": "abc", "step_s_all": [3.0, 2.0, 1.0, 1.0], "step_s": 1.0,
            "setup_s": 50.0, "trainer_setup_s": 14.0, **fields}


def test_rows_have_the_ratio_the_phases_of_the_first_step_and_the_compile_parts(tmp_path):
    engine = {"first_step": {"phases_s": [
        {"step": 1, "phase": "forward", "seconds": 1.5}, {"step": 1, "phase": "backward", "seconds": 0.25},
        {"step": 1, "phase": "forward", "seconds": 0.5}, {"step": 2, "phase": "forward", "seconds": 9.0}]},
        "compile": {"compile_s": 1.2, "parts_s": {"bytecode_tracing": 0.5, "gc": 0.01}}}
    records = [_record(run="warm1", engine=engine), _record(run="base1", step_s_all=[4.0, 1.0], step_s=0.5),
               _record(run="plain", stronghold=False, step_s_all=[9.0, 1.0])]
    (tmp_path / "first_step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(tmp_path)
    warm, base, plain = summary["rows"]
    assert warm["first_over_steady"] == pytest.approx(3.0) and warm["second_step_s"] == 2.0
    assert warm["phases_s"] == {"forward": 2.0, "backward": 0.25}  # the first step's micro-steps summed, step 2 left out
    assert warm["compile_parts_s"]["bytecode_tracing"] == 0.5
    assert base["first_over_steady"] == pytest.approx(8.0)
    assert summary["worst_first_over_steady"] == pytest.approx(8.0)  # the plain Trainer's 9.0 is not the line's
    text = render(summary)
    assert "bytecode_tracing 0.50" in text and "forward 2.00, backward 0.25" in text and "8.00 (target <= 3)" in text


def test_label_sets_the_fields_and_refuses_a_field_without_a_value(tmp_path):
    source, dest = tmp_path / "run.jsonl", tmp_path / "all.jsonl"
    source.write_text(json.dumps(_record(commit="from-git")) + "\n")
    assert label(source, dest, ["run=base1", "commit=a6d1f0e", "same_call=x=y"]) == 1
    written = json.loads(dest.read_text())
    assert (written["run"], written["commit"], written["same_call"]) == ("base1", "a6d1f0e", "x=y")
    assert label(tmp_path / "missing.jsonl", dest, ["run=cold"]) == 0  # a run that died first leaves no record
    with pytest.raises(ValueError, match="KEY=VALUE"):
        label(source, dest, ["run"])


@pytest.mark.slow
def test_script_runs_cold_plain_base_and_warm_in_order_and_labels_each(tmp_path):
    """The whole script on the CPU, this tree as its own base: four tiny HF Trainer runs."""
    pytest.importorskip("stronghold.engine.engine")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT", "STRONGHOLD_COMMIT", "BENCH_COMMIT")}
    env.update(POINT=TINY, PAIRS="1", BASE_COMMIT="basetree", SAME_CALL="test-call", STRONGHOLD_COMMIT="thistree",
               HEAD_ENV="PYTHONHASHSEED=7 PYTHONDONTWRITEBYTECODE=1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # the script's python3: this one
    run = subprocess.run(["bash", "examples/bench/first_step.sh", str(tmp_path / "out"), str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "first_step.jsonl").read_text().splitlines()]
    assert [(r["run"], r["commit"], r["stronghold"]) for r in records] == [
        ("cold", "thistree", True), ("plain", "thistree", False), ("base1", "basetree", True),
        ("warm1", "thistree", True)]
    assert all(r["same_call"] == "test-call" and r["trained"] for r in records)
    head_env = "PYTHONHASHSEED=7 PYTHONDONTWRITEBYTECODE=1"
    assert [r.get("head_env") for r in records] == [head_env, head_env, None, head_env], "this tree's runs only"
    summary = json.loads((tmp_path / "out" / "first_step_summary.json").read_text())
    assert [row["run"] for row in summary["rows"]] == ["cold", "plain", "base1", "warm1"]
    assert "The one line's largest first / steady" in run.stdout
    assert f"warm1 ({head_env})" in run.stdout
