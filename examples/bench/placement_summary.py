"""Summary of examples/bench/placement_acceptance.sh: each stronghold point against plain training of the
same shape from the same run, and the plan's predictions against what was measured (for every stronghold
record under OUT_DIR/bench, e.g. a Fig. 8b sweep written there too).

    python3 -m examples.bench.placement_summary OUT_DIR   (prints a table; writes OUT_DIR/summary.json)
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

GIB = 2 ** 30


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _placement(record: dict) -> dict:
    """Plan vs measured of a stronghold point (its engine report's "placement" section)."""
    placement = (record.get("stronghold") or {}).get("placement")
    if not placement:
        return {}
    plan, first, measured = placement["plan"], placement["initial_plan"], placement["measured"]
    step_s = record.get("step_s_all") or []
    median_step = sorted(step_s)[len(step_s) // 2] if step_s else None
    return {
        "resident_blocks": [first["resident_blocks"], plan["resident_blocks"]],
        "window_size": [first["window_size"], plan["window_size"]],
        "predicted_step_s": plan["predicted_step_s"], "measured_step_s": median_step,
        "step_error": plan["predicted_step_s"] / median_step - 1 if median_step else None,
        "predicted_gpu_peak_GiB": plan["gpu"]["peak"] / GIB,
        "measured_gpu_peak_GiB": measured["gpu_peak_allocated_bytes_now"] / GIB,
        "gpu_peak_error": plan["gpu"]["peak"] / measured["gpu_peak_allocated_bytes_now"] - 1,
        # The plan's peak includes the allocator's fragmentation seen in the first step (placement._replan), and
        # the cap applies to what the allocator reserves, so the reserved peak is its like-for-like measure.
        "measured_gpu_peak_reserved_GiB": record.get("peak_gpu_reserved_GB"),
        "gpu_peak_error_vs_reserved": (plan["gpu"]["peak"] / GIB / record["peak_gpu_reserved_GB"] - 1
                                       if record.get("peak_gpu_reserved_GB") else None),
        # The host prediction is the first plan's (its streamed blocks were pinned before promotion): its buffers plus
        # what the process held when it was made (records from before that was counted: the buffers alone), against
        # the RSS after the first step (before promotion; older records: the peak RSS, which can predate the engine).
        "predicted_host_GiB_first_plan": first["host"].get("rss", first["host"]["total"]) / GIB,
        "measured_host_rss_first_step_GiB": measured.get("host_rss_bytes_first_step", 0) / GIB or None,
        "host_error": first["host"].get("rss", first["host"]["total"]) / measured.get(
            "host_rss_bytes_first_step", measured["host_peak_rss_bytes_now"]) - 1,
        "measured_host_peak_rss_GiB": measured["host_peak_rss_bytes_now"] / GIB,
        "floor_terms": plan["floor"], "measured_activations_GiB": measured.get("activations_bytes", 0) / GIB,
        "rates": measured.get("rates"),
    }


def _pair(arch: str, plain: dict, ours: dict) -> dict:
    return {
        "arch": arch, "commit": ours.get("commit"), "device": ours.get("device"),
        "plain_uncapped_samples_per_s": plain["samples_per_s"], "stronghold_samples_per_s": ours["samples_per_s"],
        "stronghold_cap_GiB": ours.get("gpu_cap_GB"), "ratio": ours["samples_per_s"] / plain["samples_per_s"],
        "stronghold_knobs": ours.get("stronghold_knobs"), "placement": _placement(ours)}


def summarize(out: Path) -> dict:
    summary: dict = {"pairs": [], "hf": None}
    # placement.jsonl, and placement_r2.jsonl ... for the repeats of the Llama pair (LLAMA_REPEAT): each file pairs
    # within itself, so a repeat's ratio is from its own back-to-back points.
    for path in sorted((out / "bench").glob("placement*.jsonl")):
        # A point that failed (no measurement: its error and log are in the record) pairs with nothing.
        bench = [r for r in _lines(path) if r.get("samples_per_s")]
        # Records from before the clipping field clipped at 1.0.
        groups = sorted({(r.get("arch", "gpt2"), r.get("clipping", 1.0)) for r in bench})
        for arch, clipping in groups:
            points = [r for r in bench if (r.get("arch", "gpt2"), r.get("clipping", 1.0)) == (arch, clipping)]
            plain = next((r for r in reversed(points) if r["system"] == "no_offload"), None)
            # Every stronghold point of the run (no knobs, and any A/B with knobs) against the one plain point
            # of its shape and clipping.
            for ours in (r for r in points if r["system"] == "stronghold" and plain is not None):
                summary["pairs"].append({**_pair(arch, plain, ours), "clipping": clipping, "file": path.name})
    # Plan vs measured for every stronghold point under OUT/bench (the Fig. 8b sweep's too), paired or not.
    summary["predictions"] = [
        {"figure": path.stem, "arch": r.get("arch", "gpt2"), "layers": r.get("layers"),
         "stronghold_knobs": r.get("stronghold_knobs"), **_placement(r)}
        for path in sorted((out / "bench").glob("*.jsonl")) for r in _lines(path)
        if r.get("system") == "stronghold" and _placement(r)]
    hf = _lines(out / "hf" / "llama.jsonl")
    plain = [r for r in hf if not r.get("stronghold")]
    ours = [r for r in hf if r.get("stronghold")]
    if plain and ours:
        summary["hf"] = {"plain_samples_per_s": plain[-1].get("samples_per_s"),
                         "one_liner_samples_per_s": ours[-1].get("samples_per_s"),
                         "plain_setup_s": plain[-1].get("setup_s"), "one_liner_setup_s": ours[-1].get("setup_s"),
                         "one_liner_vs_plain": ours[-1]["samples_per_s"] / plain[-1]["samples_per_s"]}
    return summary


def repeat_lines(pairs: list[dict]) -> list[str]:
    """One line per shape, knobs and clipping measured more than once (LLAMA_REPEAT): the ratios' median and range,
    each ratio still from its own back-to-back pair."""
    groups: dict[str, list[float]] = {}
    for pair in pairs:
        name = f"{pair['arch']} knobs {pair.get('stronghold_knobs') or {}} clipping {pair['clipping']:g}"
        groups.setdefault(name, []).append(pair["ratio"])
    return [f"{name}: {len(ratios)} pairs, median {statistics.median(ratios):.3f}x, range {min(ratios):.3f}x-"
            f"{max(ratios):.3f}x" for name, ratios in groups.items() if len(ratios) > 1]


def main() -> None:
    out = Path(sys.argv[1])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for pair in summary["pairs"]:
        p = pair["placement"]
        knobs = f" knobs {pair['stronghold_knobs']}" if pair.get("stronghold_knobs") else ""
        knobs += f" clipping {pair['clipping']:g}" if pair["clipping"] != 1.0 else ""
        knobs += f" ({pair['file']})" if pair.get("file", "placement.jsonl") != "placement.jsonl" else ""
        print(f"{pair['arch']}{knobs}: plain uncapped {pair['plain_uncapped_samples_per_s']:.3f} samples/s, stronghold "
              f"(cap {pair['stronghold_cap_GiB']}) {pair['stronghold_samples_per_s']:.3f} -> {pair['ratio']:.3f}x")
        if p:
            print(f"  resident/window {p['resident_blocks']} / {p['window_size']} (first step -> after); step "
                  f"predicted {p['predicted_step_s']:.4f} s vs {p['measured_step_s']:.4f} ({p['step_error']:+.1%}); "
                  f"GPU peak {p['predicted_gpu_peak_GiB']:.2f} vs {p['measured_gpu_peak_GiB']:.2f} GiB "
                  f"({p['gpu_peak_error']:+.1%}); host {p['predicted_host_GiB_first_plan']:.1f} GiB planned, "
                  f"{p['measured_host_peak_rss_GiB']:.1f} peak RSS")
    for line in repeat_lines(summary["pairs"]):
        print(line)
    for p in summary["predictions"]:
        print(f"{p['figure']} {p['arch']} {p['layers']} layers{' knobs ' + str(p['stronghold_knobs']) if p['stronghold_knobs'] else ''}: "
              f"R/W {p['resident_blocks'][1]}/{p['window_size'][1]}, step predicted {p['predicted_step_s']:.4f} s vs "
              f"{p['measured_step_s']:.4f} ({p['step_error']:+.1%}), GPU peak {p['gpu_peak_error']:+.1%} of allocated, "
              f"{p['gpu_peak_error_vs_reserved'] or 0:+.1%} of reserved, host {p['predicted_host_GiB_first_plan']:.1f} GiB vs "
              f"RSS after step 1 {p['measured_host_rss_first_step_GiB'] or 0:.1f} ({p['host_error']:+.1%}), peak RSS "
              f"{p['measured_host_peak_rss_GiB']:.1f}")
    if summary["hf"]:
        h = summary["hf"]
        print(f"hf: plain {h['plain_samples_per_s']:.3f} samples/s (set-up {h['plain_setup_s']:.1f} s), one-liner "
              f"{h['one_liner_samples_per_s']:.3f} (set-up {h['one_liner_setup_s']:.1f} s) -> {h['one_liner_vs_plain']:.3f}x")


if __name__ == "__main__":
    main()
