"""The peers' records of one call side by side, with stronghold's tokens/s over each peer's (peers.sh's last step).

    python -m examples.bench.peers_summary OUT_DIR [--json OUT_DIR/peers_summary.json]

Reads every JSONL under OUT_DIR/hf (hf_peers.py's records) and OUT_DIR/bench (the bench's `one` records), groups
them by model shape, and prints one markdown table per shape: each system's outcome, tokens/s, first step, set-up,
peak GPU and host memory and whether its update is exact, and stronghold's tokens/s over that system's (stronghold
under the same cap), over the run's timed steps and over its steady steps (the median step after the first two, the
same steps of every system). Under each cap stronghold ran at, the best peer is the fastest one that trained (an
error, a timeout or no steady rate is not a fit; plain training and plain DeepSpeed are references, not peers). A
stronghold point run with a knob beside the cap (peers.sh's STRONGHOLD_CONFIG_B) or another clipping threshold
(STRONGHOLD_FLAGS_B) is a row of its own, named by them, and the ratios stay against the no-knob point: the default is
the product.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from .store import read_jsonl

SHAPE = ("arch", "hidden", "layers", "heads", "seq", "accumulation", "vocab")
REFERENCES = ("plain", "no_offload")
"""Plain training (HF Trainer) and plain DeepSpeed: the ratio to them is reported, but they are not offload peers."""


def system_of(record: dict[str, Any]) -> str:
    """The system's name; a stronghold run given knobs other than the cap is "stronghold {knobs}", and a run
    clipped at other than Trainer's default 1.0 says its threshold."""
    name = record.get("peer") or record.get("system") or "?"
    config = record.get("config") if name == "stronghold" else None
    knobs = {key: value for key, value in ((config or {}).get("stronghold") or {}).items()
             if key != "gpu_memory_limit_gb"} if isinstance(config, dict) else {}
    name = f"stronghold {json.dumps(knobs, sort_keys=True)}" if knobs else name
    clipping = record.get("max_grad_norm")
    return name if clipping in (None, 1.0) else f"{name}, max_grad_norm {clipping:g}"


def is_stronghold(system: str) -> bool:
    return system == "stronghold" or system.startswith("stronghold ")


def shape_of(record: dict[str, Any]) -> tuple:
    batch = record.get("micro_batch", record.get("batch"))
    return (record.get("source"), batch, *(record.get(key, 1 if key == "accumulation" else None) for key in SHAPE))


def load(out_dir: Path) -> list[dict[str, Any]]:
    records = []
    for source in ("hf", "bench"):
        for path in sorted((out_dir / source).glob("*.jsonl")):
            records += [{**record, "source": source} for record in read_jsonl(path)]
    return records


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One group per (source, shape): its rows (the newest record per system and cap) and stronghold's ratios, each
    against stronghold under the same cap (its best under any cap for a system run without stronghold's cap)."""
    groups: dict[tuple, dict[tuple, dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(shape_of(record), {})[(system_of(record), record.get("gpu_cap_GB"))] = record
    out = []
    for shape, by_system in groups.items():
        rows = [row(record) for record in by_system.values()]
        ours = {r["gpu_cap_GB"]: r["tokens_per_s"] for r in rows if r["system"] == "stronghold" and r["tokens_per_s"]}
        ours_steady = {r["gpu_cap_GB"]: r["steady_tokens_per_s"] for r in rows
                       if r["system"] == "stronghold" and r["steady_tokens_per_s"]}
        for r in rows:
            for key, rate, mine_by_cap in (("stronghold_over", "tokens_per_s", ours),
                                           ("stronghold_over_steady", "steady_tokens_per_s", ours_steady)):
                mine = mine_by_cap.get(r["gpu_cap_GB"], max(mine_by_cap.values(), default=None))
                r[key] = round(mine / r[rate], 3) if mine and r[rate] else None
        best = {}
        for cap in ours:
            fits = [r for r in rows if not is_stronghold(r["system"]) and r["system"] not in REFERENCES
                    and r["tokens_per_s"] and r["gpu_cap_GB"] == cap]
            fastest = max(fits, key=lambda r: r["tokens_per_s"], default=None)
            steadiest = max((r for r in fits if r["steady_tokens_per_s"]), key=lambda r: r["steady_tokens_per_s"],
                            default=None)
            best[cap] = {"peer": fastest and fastest["system"],
                         "stronghold_over": fastest and fastest["stronghold_over"],
                         "steady_peer": steadiest and steadiest["system"],
                         "stronghold_over_steady": steadiest and steadiest["stronghold_over_steady"]}
        out.append({"source": shape[0], "shape": dict(zip(("micro_batch", *SHAPE), shape[1:])), "rows": rows,
                    "stronghold_tokens_per_s": ours, "stronghold_steady_tokens_per_s": ours_steady,
                    "best_peer_by_cap": best})
    return out


STEADY_FROM = 2
"""Steps left out of the steady rate: the first (compiles, caches, the first plan) and the second (where an offloading
system's first optimizer update runs, and on a fresh machine the first touch of its host memory)."""


def steady(record: dict[str, Any]) -> tuple[float | None, float | None]:
    """(median step s, tokens/s) over every step after the first STEADY_FROM, or (None, None) with fewer than two
    such steps. The steps are the run's in order: a bench record's warm-up steps, then its timed ones."""
    steps = [*(record.get("warmup_step_s") or []), *record["step_s_all"]] if record.get("source") == "bench" \
        else list(record.get("step_s_all") or [])
    later = steps[STEADY_FROM:]
    tokens = (record.get("micro_batch") or record.get("batch") or 0) * (record.get("seq") or 0) * (
        record.get("accumulation") or 1)
    if len(later) < 2 or not tokens or record.get("error"):
        return None, None
    median = statistics.median(later)
    return round(median, 4), round(tokens / median, 1)


def row(record: dict[str, Any]) -> dict[str, Any]:
    error = record.get("error")
    rate = None if error else record.get("tokens_per_s")
    steady_step_s, steady_rate = steady(record)
    return {"system": system_of(record), "gpu_cap_GB": record.get("gpu_cap_GB"), "error": error,
            "error_detail": str(record.get("error_detail") or "")[-160:] if error else None,
            "tokens_per_s": rate, "samples_per_s": None if error else record.get("samples_per_s"),
            "steady_step_s": steady_step_s, "steady_tokens_per_s": steady_rate,
            "first_step_s": record.get("first_step_s"), "setup_s": record.get("setup_s", setup_s(record)),
            "steps": record.get("steps_done", len(record.get("warmup_step_s") or []) + len(record.get("step_s_all") or [])),
            "peak_gpu_GB": record.get("peak_gpu_GB"), "peak_host_GB": record.get("peak_host_GB"),
            "exact": record.get("exact", None if error else True), "device": record.get("device"),
            "commit": record.get("commit")}


EXACT = {True: "yes", False: "no", None: "-"}


def setup_s(record: dict[str, Any]) -> float | None:
    """A bench record's set-up: model build plus engine construction (its child's imports are not timed)."""
    parts = [record.get("build_s"), record.get("engine_init_s")]
    return None if None in parts else sum(parts)


def markdown(group: dict[str, Any]) -> str:
    def num(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    shape = ", ".join(f"{k} {v}" for k, v in group["shape"].items() if v is not None)
    lines = [f"### {group['source']}: {shape}", "",
             "| system | cap GiB | outcome | tokens/s | stronghold / it | steady tokens/s | stronghold / it, steady | "
             "first step s | set-up s | steps | GPU peak GiB | host peak GiB | exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(group["rows"], key=lambda r: (r["system"] != "stronghold", not is_stronghold(r["system"]),
                                                  -(r["tokens_per_s"] or 0))):
        outcome = "ok" if not r["error"] else f"{r['error']}: {r['error_detail']}".replace("|", "/")
        lines.append(f"| {r['system']} | {r['gpu_cap_GB'] or 'none'} | {outcome} | {num(r['tokens_per_s'], 0)} | "
                     f"{num(r['stronghold_over'], 2)} | {num(r['steady_tokens_per_s'], 0)} | "
                     f"{num(r['stronghold_over_steady'], 2)} | {num(r['first_step_s'])} | {num(r['setup_s'])} | "
                     f"{r['steps'] if r['steps'] is not None else '-'} | {num(r['peak_gpu_GB'])} | "
                     f"{num(r['peak_host_GB'])} | {EXACT[r['exact']]} |")
    devices = sorted({r["device"] for r in group["rows"] if r["device"]})
    best = "; ".join(f"under {cap or 'no'} cap: {b['peer'] or 'none'}, stronghold over it "
                     f"{num(b['stronghold_over'], 2)} (steady, steps {STEADY_FROM + 1} on: {b['steady_peer'] or 'none'}, "
                     f"{num(b['stronghold_over_steady'], 2)})" for cap, b in group["best_peer_by_cap"].items())
    lines += ["", f"Fastest peer that trained {best or '(none: stronghold has no steady rate here)'}. Devices: {'; '.join(devices) or '-'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.bench.peers_summary", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--json", type=Path, default=None, help="default: OUT_DIR/peers_summary.json")
    args = parser.parse_args(argv)
    groups = summarise(load(args.out_dir))
    print("\n\n".join(markdown(group) for group in groups) if groups else f"no records under {args.out_dir}")
    path = args.json or args.out_dir / "peers_summary.json"
    path.write_text(json.dumps(groups, indent=1, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
