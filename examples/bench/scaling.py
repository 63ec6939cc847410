"""Issue 14's scaling report: per system and world size the samples/s, the scaling efficiency, the node's host
memory, and stronghold over ZeRO-Offload on the same GPUs, from `examples.bench.data_parallel`'s records.

    python3 -m examples.bench.scaling DATA_PARALLEL_JSONL [--json OUT.json] [--plot OUT.png]

Efficiency at N GPUs is samples/s at N over N times samples/s at 1 GPU of the same system, shape and commit; every
ratio comes from records of one file (`data_parallel --resume` adds the world sizes a file lacks).
The plot needs matplotlib (on the GPU image; not a dependency of the package): without it only the JSON is written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

EFFICIENCY_AT_8 = 0.85
"""Issue 14's acceptance: stronghold's scaling efficiency at 8 GPUs."""


def _key(record: dict[str, Any]) -> tuple:
    return record.get("commit"), record.get("layers"), record.get("gpu_cap_GB")


def scaling(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The report over the newest shape and commit that has a successful measurement: the last successful
    configuration line names them, and only lines of the same commit, layers and cap count."""
    ok = [r for r in records if r.get("kind") == "config" and r.get("role", "measure") == "measure"
          and r.get("error") is None and r.get("samples_per_s")]
    if not ok:
        return {"systems": {}, "note": "no successful configuration"}
    shape = _key(ok[-1])
    newest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in ok:
        if _key(r) == shape:
            newest[(r["system"], r["world_size"])] = r  # a later line of the same configuration replaces it
    systems: dict[str, list[dict[str, Any]]] = {}
    for (system, world), r in sorted(newest.items()):
        base = newest.get((system, 1))
        node = r.get("node") or {}
        systems.setdefault(system, []).append({
            "world_size": world, "samples_per_s": r["samples_per_s"], "step_s": r.get("step_s"),
            "efficiency": r["samples_per_s"] / (world * base["samples_per_s"]) if base else None,
            "node_peak_used_GB": node.get("peak_used_GB"), "node_steady_used_GB": node.get("steady_used_GB")})
    over_zero = {}
    for row in systems.get("stronghold", []):
        zero = newest.get(("zero_offload", row["world_size"]))
        if zero:
            over_zero[row["world_size"]] = row["samples_per_s"] / zero["samples_per_s"]
    at_8 = next((row["efficiency"] for row in systems.get("stronghold", []) if row["world_size"] == 8), None)
    commit, layers, cap = shape
    return {"commit": commit, "layers": layers, "gpu_cap_GB": cap, "params_B": ok[-1].get("params_B"),
            "device": ok[-1].get("device"), "systems": systems, "stronghold_over_zero_offload": over_zero,
            "efficiency_at_8": at_8, "efficiency_at_8_asked": EFFICIENCY_AT_8,
            "efficiency_at_8_met": None if at_8 is None else at_8 >= EFFICIENCY_AT_8}


def plot(report: dict[str, Any], path: Path) -> Optional[str]:
    """Samples/s and node host memory against world size, one line per system; the reason when there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for system, rows in report["systems"].items():
        worlds = [row["world_size"] for row in rows]
        speed.plot(worlds, [row["samples_per_s"] for row in rows], marker="o", label=system)
        memory.plot(worlds, [row["node_peak_used_GB"] or 0 for row in rows], marker="o", label=system)
    speed.set(xlabel="GPUs", ylabel="samples/s", title=f"GPT-2 {report.get('params_B') or 0:.2f} B, "
              f"{report.get('gpu_cap_GB')} GiB cap per GPU")
    memory.set(xlabel="GPUs", ylabel="node host memory, peak GiB", title=f"commit {report.get('commit')}")
    worlds = sorted({row["world_size"] for rows in report["systems"].values() for row in rows})
    for axis in (speed, memory):
        axis.set_xticks(worlds)
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m examples.bench.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("records", type=Path, help="examples.bench.data_parallel's --out")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.records.exists():
        print(f"{args.records}: no such file (run examples.bench.data_parallel --out {args.records} first)",
              file=sys.stderr)
        return 2
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    report = scaling(records)
    for system, rows in report["systems"].items():
        for row in rows:
            eff = "-" if row["efficiency"] is None else f"{row['efficiency']:.3f}"
            print(f"{system}:{row['world_size']}: {row['samples_per_s']:.3f} samples/s, efficiency {eff}, node peak "
                  f"{row['node_peak_used_GB'] or 0:.1f} GiB")
    for world, ratio in report.get("stronghold_over_zero_offload", {}).items():
        print(f"stronghold over ZeRO-Offload at {world} GPUs: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True))
    if args.plot:
        why = plot(report, args.plot)
        if why:
            print(f"no plot: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
