"""Summary of examples/bench/tree_ab.sh: two trees alternated at the same points in one call.

    python3 -m examples.bench.tree_ab_summary OUT_DIR [--same-call NAME --out FILE]

Per point (the records in OUT_DIR/bench/tree_ab.jsonl, in the order they ran): each run's commit, pair, steady step,
the placement it ran (resident blocks, window, the blockwise backward) and its GPU and host peaks; then per point each
commit's median step and the later tree's median over the earlier's (the first commit to run is the base). Writes
OUT_DIR/tree_ab_summary.json. With --same-call and --out it also appends the records, `same_call` set, to FILE (the
results file the call's figures are read from).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from examples.bench.markdown import fmt, table
from examples.bench.store import read_jsonl


def point_of(record: dict[str, Any]) -> str:
    """A point's name in the table: its shape, without the pair (`repeat`)."""
    cap = "uncapped" if record.get("gpu_cap_GB") is None else f"{record['gpu_cap_GB']:g} GiB"
    return (f"{record.get('arch', 'gpt2')} h{record.get('hidden')} L{record.get('layers')} seq {record.get('seq')} "
            f"mb {record.get('batch')} GA {record.get('accumulation', 1)} {cap}")


def placement_of(record: dict[str, Any]) -> str:
    report = record.get("stronghold") or {}
    if "resident_blocks" not in report:
        return "-"
    return (f"R{report['resident_blocks']} W{report.get('window_size')}"
            + (" blockwise" if report.get("blockwise_backward") else ""))


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"point": point_of(r), "commit": r.get("commit"), "pair": r.get("repeat"), "step_s": r.get("step_s"),
             "placement": placement_of(r), "peak_gpu_GB": r.get("peak_gpu_GB"), "peak_host_GB": r.get("peak_host_GB"),
             "error": r.get("error")} for r in records]


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: each commit's median steady step, and the second commit's over the first's (the base ran first)."""
    out = []
    for point in dict.fromkeys(point_of(r) for r in records):
        steps: dict[str, list[float]] = {}
        for r in records:
            if point_of(r) == point:
                steps.setdefault(r.get("commit"), [])
                if r.get("step_s") and not r.get("error"):
                    steps[r.get("commit")].append(r["step_s"])
        medians = {commit: statistics.median(s) if s else None for commit, s in steps.items()}
        commits = list(medians)
        ratio: Optional[float] = None
        if len(commits) == 2 and all(medians[c] for c in commits):
            ratio = medians[commits[1]] / medians[commits[0]]
        out.append({"point": point, "medians_s": medians, "runs": {c: len(s) for c, s in steps.items()},
                    "base": commits[0], "head": commits[1] if len(commits) > 1 else None, "head_over_base": ratio})
    return out


def summarize(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "bench" / "tree_ab.jsonl"
    if not path.exists():
        raise ValueError(f"no records at {path}: did any run of examples/bench/tree_ab.sh finish?")
    records = read_jsonl(path)
    summary = {"rows": rows(records), "points": ratios(records)}
    (out_dir / "tree_ab_summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


def append_results(out_dir: Path, same_call: str, dest: Path) -> int:
    """The call's records with `same_call` set, appended to `dest`; how many."""
    records = read_jsonl(out_dir / "bench" / "tree_ab.jsonl")
    with dest.open("a") as f:
        for record in records:
            f.write(json.dumps({**record, "same_call": same_call}, sort_keys=True) + "\n")
    return len(records)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m examples.bench.tree_ab_summary",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--same-call", default=None, help="the call's name, set on each record appended to --out")
    parser.add_argument("--out", type=Path, default=None, help="a results file to append the records to")
    args = parser.parse_args(argv)
    if (args.same_call is None) != (args.out is None):
        parser.error("--same-call and --out go together: the records appended to a results file name their call")
    try:
        summary = summarize(args.out_dir)
    except ValueError as err:
        print(f"tree_ab_summary: {err}", file=sys.stderr)
        return 1
    print(table(["point", "commit", "pair", "steady step s", "placement", "GPU peak GiB", "host peak GiB", "error"],
                [[r["point"], r["commit"], r["pair"], fmt(r["step_s"], 3), r["placement"], fmt(r["peak_gpu_GB"]),
                  fmt(r["peak_host_GB"], 1), r["error"] or ""] for r in summary["rows"]]))
    print()
    for p in summary["points"]:
        medians = ", ".join(f"{c} {fmt(m, 3)} s ({p['runs'][c]} runs)" for c, m in p["medians_s"].items())
        print(f"{p['point']}: medians {medians}; {p['head']} over {p['base']}: {fmt(p['head_over_base'], 3)}")
    if args.out is not None:
        print(f"tree_ab_summary: {append_results(args.out_dir, args.same_call, args.out)} records appended to "
              f"{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
