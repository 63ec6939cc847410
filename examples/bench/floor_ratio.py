"""Issue 10's ratio: each stronghold record's step time against its largest floor term, in both clipping regimes.

The floor terms come from the record's `floor` (measured at start-up: the CPU AdamW kernel's own rate, the copy
bandwidths, the GPU compute of the blocks). The host-DRAM term puts every byte the host's memory moves a step on one
budget, at the rate the AdamW kernel reaches alone: 28 bytes a streamed parameter for the update plus the H2D and
D2H bytes, over 28 x that kernel's parameters a second. It is the largest term wherever the CPU is the bound.

Steps fall in two regimes (per_step): with the global norm over the clipping limit the streamed updates are deferred
to step() (`deferred_blocks` = every streamed block; the next step's forward waits for them), below it they run during
backward. `inactive` lists the steps that deferred fewer than all, after the first such step (which still pays the
deferred updates of the step before it).

    python3 -m examples.bench.floor_ratio OUT/bench/regimes.jsonl [...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from stronghold.planning.plan_types import ADAM_HOST_BYTES


def floor_terms(floor: dict) -> dict[str, float]:
    """The record's floor terms in seconds, with the host-DRAM term added."""
    streamed, rate = floor["streamed_trainable_params"], floor["cpu_adam_params_per_s"]
    copies = floor["h2d_s"] * floor["h2d_GBps"] * 1e9 + floor["d2h_s"] * floor["d2h_GBps"] * 1e9
    return {"cpu_adamw_s": floor["cpu_optim_s"], "gpu_compute_s": floor["gpu_compute_s"],
            "h2d_s": floor["h2d_s"], "d2h_s": floor["d2h_s"],
            "host_dram_s": (ADAM_HOST_BYTES * streamed + copies) / (ADAM_HOST_BYTES * rate)}


def summarize(record: dict) -> Optional[dict]:
    """None for records without a stronghold floor or timed steps."""
    floor, steps, per_step = record.get("floor"), record.get("step_s_all") or [], record.get("per_step") or []
    if record.get("system") != "stronghold" or not floor or not steps or len(per_step) != len(steps):
        return None
    terms = floor_terms(floor)
    largest = max(terms, key=terms.get)
    streamed_blocks = max(s.get("deferred_blocks", 0) for s in per_step)
    partial = [t for t, s in zip(steps, per_step) if s.get("deferred_blocks", 0) < streamed_blocks]
    inactive = partial[1:]
    median = statistics.median(steps)
    out = {"commit": record.get("commit"), "device": record.get("device"), "layers": record.get("layers"),
           "params_B": record.get("params_B"), "clipping": record.get("clipping"), "steps_s": steps,
           "median_step_s": median, "terms_s": terms, "largest_term": largest,
           "median_over_largest": median / terms[largest],
           "full_gc_s": [s.get("gc2_s", 0.0) for s in per_step], "inactive_steps_s": inactive}
    if inactive:
        out["inactive_median_over_largest"] = statistics.median(inactive) / terms[largest]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", type=Path, help="bench .jsonl files")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    args = parser.parse_args(argv)
    rows = []
    for path in args.records:
        for line in path.read_text().splitlines():
            summary = summarize(json.loads(line)) if line.strip() else None
            if summary is not None:
                rows.append({"file": str(path), **summary})
    for row in rows:
        inactive = row.get("inactive_median_over_largest")
        print(f"{row['file']} {str(row['commit'])[:7]} {row['layers']} layers clip {row['clipping']}: median "
              f"{row['median_step_s']:.3f} s = {row['median_over_largest']:.2f}x {row['largest_term']} "
              f"({row['terms_s'][row['largest_term']]:.3f} s)"
              + (f"; clip-inactive steps {[round(t, 3) for t in row['inactive_steps_s']]} = {inactive:.2f}x"
                 if inactive is not None else "; no clip-inactive step"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
