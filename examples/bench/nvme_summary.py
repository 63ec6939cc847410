"""Summary of examples/bench/nvme_acceptance.sh: stronghold with the NVMe tier under a host limit against the same
point with the host unlimited (the tier's cost) and against ZeRO-Infinity on NVMe, from one run; the NVMe floor term
the plan predicted against the drive's busy seconds a step, and each system's host peak.

    python3 -m examples.bench.nvme_summary OUT_DIR   (prints the lines; writes OUT_DIR/nvme_summary.json)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _row(record: dict) -> dict:
    report = record.get("stronghold") or {}
    nvme = report.get("nvme") or {}
    knobs = record.get("stronghold_knobs") or {}
    row = {"system": record.get("system"), "knobs": knobs, "error": record.get("error"),
           "error_detail": record.get("error_detail"), "samples_per_s": record.get("samples_per_s"),
           "step_s": record.get("step_s"), "peak_host_GB": record.get("peak_host_GB"),
           "peak_gpu_reserved_GB": record.get("peak_gpu_reserved_GB")}
    if nvme:
        predicted, busy = nvme.get("predicted_s_per_step"), nvme.get("busy_s_per_step")
        row.update(nvme_blocks=nvme.get("blocks"), nvme_GiB_on_drive=nvme.get("bytes_on_drive", 0) / 2 ** 30,
                   nvme_predicted_s=predicted, nvme_busy_s=busy, nvme_hold_wait_s=nvme.get("hold_wait_s_per_step"),
                   nvme_error=predicted / busy - 1 if predicted and busy else None)
    return row


def summarize(out: Path) -> dict:
    rows = [_row(r) for r in _lines(out / "bench" / "nvme.jsonl")]
    tier = next((r for r in reversed(rows) if r["system"] == "stronghold" and "nvme_path" in r["knobs"]), None)
    unlimited = next((r for r in reversed(rows) if r["system"] == "stronghold" and "nvme_path" not in r["knobs"]), None)
    peer = next((r for r in reversed(rows) if r["system"] == "zero_infinity_nvme"), None)

    def ratio(a, b):
        return a["samples_per_s"] / b["samples_per_s"] if a and b and a.get("samples_per_s") and b.get(
            "samples_per_s") else None
    summary = {"rows": rows, "tier_vs_zero_infinity_nvme": ratio(tier, peer),
               "tier_vs_host_unlimited": ratio(tier, unlimited)}
    (out / "nvme_summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


def main(argv: list[str]) -> int:
    summary = summarize(Path(argv[0]))
    for row in summary["rows"]:
        print(json.dumps(row, sort_keys=True))
    print(f"stronghold NVMe tier / ZeRO-Infinity NVMe samples/s: {summary['tier_vs_zero_infinity_nvme']}")
    print(f"stronghold NVMe tier / stronghold host unlimited samples/s: {summary['tier_vs_host_unlimited']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
