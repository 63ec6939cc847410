"""compile_summary pairs each shape's compiled point with its eager one (examples/bench/compile_ab.sh)."""
import json

import pytest

from examples.bench.compile_summary import summarize
from examples.hf_trainer import parse_args


def test_ratio_is_eager_over_compiled_per_shape(tmp_path):
    gpt2 = {"arch": "gpt2", "hidden": 2048, "layers": 32, "batch": 4}
    (tmp_path / "bench").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "bench" / "compile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {**gpt2, "stronghold_knobs": {"compile": False}, "step_s": 0.20, "warmup_step_s": [9.0, 0.3]},
        {**gpt2, "stronghold_knobs": {"compile": True}, "step_s": 0.16, "warmup_step_s": [70.0, 0.2],
         "stronghold": {"compile": {"compile_s": 60.0, "graphs": 1, "fallback": None}}},
    ]))
    (tmp_path / "hf" / "llama.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"stronghold": False, "model": "llama-2560x32", "accumulation": 8, "step_s": 1.0, "trained": True},
        {"stronghold": True, "model": "llama-2560x32", "accumulation": 8, "config": {"compile": False},
         "step_s": 3.0, "step_s_all": [5.0, 3.0], "trained": True},
        {"stronghold": True, "model": "llama-2560x32", "accumulation": 8, "config": {"compile": True},
         "step_s": 2.5, "step_s_all": [50.0, 2.5], "trained": True},
    ]))
    summary = summarize(tmp_path)
    ratios = summary["speedup_eager_over_compiled"]
    assert ratios == {"gpt2-h2048-l32-b4": pytest.approx(0.20 / 0.16), "llama-2560x32-ga8-hf": pytest.approx(3.0 / 2.5)}
    compiled = [row for row in summary["rows"] if row["compile"] is True]
    assert [row["first_step_s"] for row in compiled] == [70.0, 50.0]
    assert len(summary["rows"]) == 4  # the plain Trainer's line is not a stronghold point


def test_hf_trainer_passes_stronghold_keys(capsys):
    assert parse_args(["--stronghold-config", '{"compile": false}']).stronghold_config == {"compile": False}
    with pytest.raises(SystemExit):
        parse_args(["--stronghold-config", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err
