"""`python -m examples.bench kernels-report`: results/kernels/e2e_ab.md from the kernels sweep.

Per family (and depth, cap and knobs), each kernel set's step time and its speedup over `none`
(none's step time / the set's: above 1 is faster). The noise is the spread of the repeated sets
(none and all, and the default with `--kernel-sets defaults`, each ran twice, at the start and at the
end): (max - min) / mean, the largest of them.
A kernel alone wins when its speedup is at least WIN_SPEEDUP and beyond the noise; the winners are
the data from which each family's default kernel set is chosen.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from .kernels import set_label
from .markdown import cap_label, fmt, table
from .queries import latest
from .report import caption
from .store import read_records

WIN_SPEEDUP = 1.02
"""A kernel alone must make the step at least 2% faster than none to be on by default."""


def _series_key(record: dict[str, Any]) -> str:
    """The record's point without its kernel set and repeat: one A/B."""
    fields = json.loads(record["key"])
    fields.pop("repeat", None)
    fields["stronghold"] = {k: v for k, v in fields["stronghold"].items() if k != "kernels"}
    return json.dumps(fields, sort_keys=True)


def ab_groups(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{series key: {set label: [records by repeat]}} of the stronghold records that set "kernels"."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for record in latest(records).values():
        knobs = record.get("stronghold_knobs") or {}
        if record.get("system") != "stronghold" or "kernels" not in knobs:
            continue
        sets = groups.setdefault(_series_key(record), {})
        sets.setdefault(set_label(knobs["kernels"]), []).append(record)
    for sets in groups.values():
        for found in sets.values():
            found.sort(key=lambda r: r.get("repeat", 0))
    return groups


def _times(found: list[dict[str, Any]]) -> list[float]:
    return [r["step_s"] for r in found if r.get("error") is None and r.get("step_s")]


def spread(times: list[float]) -> float | None:
    """(max - min) / mean of repeated step times; None with fewer than two."""
    return (max(times) - min(times)) / statistics.mean(times) if len(times) >= 2 else None


def analyse(sets: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Speedups over none, the noise and the verdict per kernel alone, for one A/B."""
    base = _times(sets.get("none", []))
    base_s = statistics.mean(base) if base else None
    noises = [n for n in (spread(_times(found)) for found in sets.values()) if n is not None]
    noise = max(noises) if noises else None
    rows = {}
    for label, found in sets.items():
        times = _times(found)
        step_s = statistics.mean(times) if times else None
        speedup = base_s / step_s if base_s and step_s else None
        rows[label] = {"step_s": step_s, "times": times, "speedup": speedup,
                       "errors": [r.get("error") for r in found if r.get("error") is not None]}
    winners = []
    for label, row in rows.items():
        if label in ("none", "all"):
            continue
        row["verdict"] = verdict(row["speedup"], noise)
        if row["verdict"].startswith("on"):
            winners.append(label)
    return {"base_s": base_s, "noise": noise, "rows": rows, "winners": winners}


def verdict(speedup: float | None, noise: float | None) -> str:
    if speedup is None:
        return "unknown (not measured, or it or none failed)"
    threshold = max(WIN_SPEEDUP, 1 + (noise or 0.0))
    if speedup >= threshold:
        return f"on: {speedup:.3f}x >= {threshold:.3f} (the 1.02 rule and the noise)"
    if speedup >= WIN_SPEEDUP:
        return f"off: {speedup:.3f}x is within the noise ({noise:.1%})"
    return f"off: {speedup:.3f}x < {WIN_SPEEDUP}"


def markdown(records: list[dict[str, Any]]) -> str:
    parts = ["# End-to-end kernel A/B inside the engine (issue 10)",
             "Regenerate with `python -m examples.bench kernels-report`. Speedup = none's step time / the set's "
             f"(above 1: faster). A kernel alone is on by default for a family when its speedup is >= {WIN_SPEEDUP} and "
             "beyond the noise, the spread (max - min) / mean of the repeated none and all runs. Compare ratios, not "
             "absolute times: a cheaper run may have fewer layers than the family's acceptance shape."]
    groups = ab_groups(records)
    if not groups:
        parts.append("_No kernels sweep records yet: run `python -m examples.bench kernels`._")
    for key, sets in sorted(groups.items()):
        point = json.loads(key)
        result = analyse(sets)
        used = [r for found in sets.values() for r in found]
        arch = point.get("arch", "gpt2")
        title = (f"## {arch}: h{point['hidden']}, {point['layers']} layers, seq {point['seq']}, micro-batch "
                 f"{point['batch']}, accumulation {point.get('accumulation', 1)}, {cap_label(point['gpu_cap_GB'])}, "
                 f"knobs {point['stronghold']}")
        order = ["none", "all"] + sorted(label for label in sets if label not in ("none", "all"))
        rows = []
        for label in order:
            if label not in result["rows"]:
                continue
            row = result["rows"][label]
            rows.append([label, " / ".join(fmt(t, 4) for t in row["times"]) or "-", fmt(row["step_s"], 4),
                         fmt(row["speedup"], 3), ", ".join(row["errors"]) or "",
                         row.get("verdict", "baseline" if label == "none" else "all that apply")])
        noise = "n/a (no repeated baseline yet)" if result["noise"] is None else f"{result['noise']:.2%}"
        parts += [title, caption(used),
                  table(["kernels", "step s (each run)", "mean step s", "speedup vs none", "errors", "default"], rows),
                  f"Noise (repeated baselines): {noise}. Winners alone: {', '.join(result['winners']) or 'none'}."]
    return "\n\n".join(parts) + "\n"


def write_kernels_report(results_dir: Path, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(read_records(results_dir)))
    print(f"[bench] kernels report: {out}")
    return out
