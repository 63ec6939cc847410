"""examples/bench/compile_cold.py: one decoder layer's first call against its steady call, a fresh process a variant."""
import json

import pytest

from examples.bench import compile_cold

TINY = ["--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2", "--seq", "16", "--batch", "2",
        "--iters", "2", "--device", "cpu"]


def test_an_eager_variant_records_its_first_and_steady_call(tmp_path, monkeypatch):
    out = tmp_path / "compile.jsonl"
    monkeypatch.setattr("sys.argv", ["compile_cold", "--variants", "eager", "--json", str(out), *TINY])
    compile_cold.main()
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["variant"] == "eager" and "error" not in record, record.get("error")
    assert record["first_s"] > 0 and record["steady_s"] > 0 and record["shape"]["hidden"] == 32
    assert record["commit"] and record["device"]


def test_an_unknown_variant_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr("sys.argv", ["compile_cold", "--variants", "eager,fastest", *TINY])
    with pytest.raises(ValueError, match="unknown variants \\['fastest'\\]"):
        compile_cold.main()
