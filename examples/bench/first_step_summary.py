"""Summary of examples/bench/first_step.sh: each run's first optimizer step against its steady one.

    python3 -m examples.bench.first_step_summary OUT_DIR   (prints a table; writes OUT_DIR/first_step_summary.json)
    python3 -m examples.bench.first_step_summary --label SOURCE DEST KEY=VALUE...   (the script's labelling)

Per run (examples/hf_trainer.py's records in OUT_DIR/first_step.jsonl, labelled by `label`): the first
and second step, the steady step (the mean past the warm-up), first / steady (the issue's target is <= 3), set-up
against the plain Trainer's, and for the one line the first step's engine phases (`first_step` in the engine's
report, summed per phase) and its compile with the largest of the compiler's own parts (`parts_s`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from examples.bench.markdown import fmt, table
from examples.bench.store import read_jsonl

TOP_PARTS = 4
"""The compile parts a row shows (the summary file keeps them all)."""


def first_step_phases(engine: dict) -> dict[str, float]:
    """The engine's first optimizer step by phase, seconds summed over its micro-steps."""
    phases: dict[str, float] = {}
    for entry in (engine.get("first_step") or {}).get("phases_s", []):
        if entry.get("step") == 1:
            phases[entry["phase"]] = phases.get(entry["phase"], 0.0) + entry["seconds"]
    return phases


def row(record: dict) -> dict:
    steps = record.get("step_s_all") or []
    steady = record.get("step_s")
    first = steps[0] if steps else None
    engine = record.get("engine") or {}
    compile_report = engine.get("compile") or {}
    return {"run": record.get("run", "-"), "head_env": record.get("head_env"), "commit": record.get("commit"),
            "stronghold": record.get("stronghold"),
            "trained": record.get("trained"), "first_step_s": first,
            "second_step_s": steps[1] if len(steps) > 1 else None,
            "steady_step_s": steady, "first_over_steady": first / steady if first and steady else None,
            "setup_s": record.get("setup_s"), "trainer_setup_s": record.get("trainer_setup_s"),
            "compile_s": compile_report.get("compile_s"), "compile_parts_s": compile_report.get("parts_s") or {},
            "phases_s": first_step_phases(engine), "device": record.get("device")}


def summarize(out: Path) -> dict:
    rows = [row(record) for record in read_jsonl(out / "first_step.jsonl")]
    ratios = [r["first_over_steady"] for r in rows if r["stronghold"] and r["first_over_steady"] is not None]
    return {"rows": rows, "worst_first_over_steady": max(ratios) if ratios else None}


def _parts(parts: dict[str, float]) -> str:
    top = sorted(parts.items(), key=lambda item: -item[1])[:TOP_PARTS]
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in top) or "-"


def _phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items()) or "-"


def _run_name(row: dict) -> str:
    """The run's name, with the settings HEAD_ENV gave it (first_step.sh)."""
    return f"{row['run']} ({row['head_env']})" if row.get("head_env") else row["run"]


def render(summary: dict) -> str:
    header = ["run", "commit", "one line", "first step s", "second s", "steady s", "first / steady", "set-up s",
              "Trainer set-up s", "compile s", "compile's largest parts s", "first step's phases s"]
    cells = [[_run_name(r), r["commit"], r["stronghold"], fmt(r["first_step_s"]), fmt(r["second_step_s"]),
              fmt(r["steady_step_s"], 3), fmt(r["first_over_steady"]), fmt(r["setup_s"], 1),
              fmt(r["trainer_setup_s"], 1), fmt(r["compile_s"]), _parts(r["compile_parts_s"]), _phases(r["phases_s"])]
             for r in summary["rows"]]
    lines = [table(header, cells)]
    worst: Optional[float] = summary["worst_first_over_steady"]
    lines.append(f"\nThe one line's largest first / steady: {fmt(worst)} (target <= 3)")
    return "\n".join(lines)


def label(source: Path, dest: Path, fields: list[str]) -> int:
    """Append `source`'s records to `dest` with `fields` (KEY=VALUE) set: a run's name, its tree's commit (a copied
    tree's own git, if any, names another) and the call. Nothing to append (a run that died first) is not an error:
    the table shows the runs that left a record."""
    pairs = [field.partition("=") for field in fields]
    if any(not key or not eq for key, eq, _ in pairs):
        raise ValueError(f"--label fields {fields} must be KEY=VALUE")
    records = read_jsonl(source)
    with dest.open("a") as f:
        for record in records:
            f.write(json.dumps({**record, **{key: value for key, _, value in pairs}}, default=str) + "\n")
    return len(records)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--label"] and len(argv) >= 3:
        label(Path(argv[1]), Path(argv[2]), argv[3:])
        return 0
    out = Path(argv[0]) if argv else sys.exit("usage: python3 -m examples.bench.first_step_summary OUT_DIR "
                                               "| --label SOURCE DEST KEY=VALUE...")
    summary = summarize(out)
    (out / "first_step_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
