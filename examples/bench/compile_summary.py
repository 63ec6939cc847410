"""Summary of examples/bench/compile_ab.sh: each shape's step with the blocks compiled against eager, from one run.

    python3 -m examples.bench.compile_summary OUT_DIR   (prints a table; writes OUT_DIR/summary.json)

Per point: the "compile" setting, the engine's compile report (compile_s: seconds in the calls that compiled;
graphs; fallback: why it ran eager), the first step, the steady step (the median of the timed steps for the bench,
the mean past the warm-up for the HF Trainer) and, per shape, steady eager / steady compiled (> 1: compiling won).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _bench_row(record: dict) -> dict:
    engine = record.get("stronghold") or {}
    first = (record.get("warmup_step_s") or record.get("step_s_all") or [None])[0]
    shape = f"{record.get('arch', 'gpt2')}-h{record.get('hidden')}-l{record.get('layers')}-b{record.get('batch')}"
    return {"shape": shape, "compile": (record.get("stronghold_knobs") or {}).get("compile", "auto"),
            "error": record.get("error"), "compile_report": engine.get("compile"), "first_step_s": first,
            "steady_step_s": record.get("step_s"), "samples_per_s": record.get("samples_per_s"),
            "peak_gpu_reserved_GB": record.get("peak_gpu_reserved_GB"), "commit": record.get("commit"),
            "device": record.get("device")}


def _hf_row(record: dict) -> dict:
    engine = record.get("engine") or {}
    steps = record.get("step_s_all") or [None]
    return {"shape": f"{record.get('model')}-ga{record.get('accumulation')}-hf",
            "compile": (record.get("config") or {}).get("compile", "auto"),
            "error": None if record.get("trained") else "oom" if record.get("oom") else "not trained",
            "compile_report": engine.get("compile"), "first_step_s": steps[0], "steady_step_s": record.get("step_s"),
            "samples_per_s": record.get("samples_per_s"), "peak_gpu_reserved_GB": record.get("peak_gpu_reserved_GB"),
            "commit": record.get("commit"), "device": record.get("device")}


def _ratio(rows: list[dict], shape: str) -> Optional[float]:
    steady = {row["compile"]: row["steady_step_s"] for row in rows if row["shape"] == shape and row["steady_step_s"]}
    eager, compiled = steady.get(False), steady.get(True, steady.get("auto"))
    return eager / compiled if eager and compiled else None


def summarize(out: Path) -> dict:
    rows = [_bench_row(r) for r in _lines(out / "bench" / "compile.jsonl")]
    rows += [_hf_row(r) for r in _lines(out / "hf" / "llama.jsonl") if r.get("stronghold")]
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    return {"rows": rows, "speedup_eager_over_compiled": {shape: _ratio(rows, shape) for shape in shapes}}


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else sys.exit("usage: python3 -m examples.bench.compile_summary OUT_DIR")
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print("shape | compile | compile_s | graphs | fallback | first step s | steady step s | samples/s | error")
    for row in summary["rows"]:
        report = row["compile_report"] or {}
        print(" | ".join(_cell(v) for v in (row["shape"], row["compile"], report.get("compile_s"), report.get("graphs"),
                                             report.get("fallback"), row["first_step_s"], row["steady_step_s"],
                                             row["samples_per_s"], row["error"])))
    for shape, ratio in summary["speedup_eager_over_compiled"].items():
        print(f"{shape}: steady step eager / compiled = {_cell(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
