"""The summary of examples/bench/data_parallel.py's configuration lines: issue 11's acceptance ratios, the largest
layer count the node's host memory predicts, and the table it prints."""
from __future__ import annotations

import statistics
from typing import Any

# (ratio, comparison, threshold): issue 11's acceptance.
THRESHOLDS = {
    "stronghold_2_over_1": (">=", 1.8),
    "stronghold_over_zero_offload_at_2": (">=", 2.5),
    "node_host_2_over_1_peak": ("<=", 1.15),
}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The acceptance ratios from a run's configuration records. With one round (each configuration once), a ratio is
    that of the two lines (the newest success per system and world); with several (`--rounds`), each round's
    configurations are paired and the ratio is the median of the rounds' ratios, each listed in
    `ratios_by_round`, so a run whose machine drifts within the call is read pair by pair."""
    ok: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == "config" and r.get("role") == "measure" and r.get("error") is None:
            ok[(r["system"], r["world_size"], r.get("round", 1))] = r
    rounds = sorted({key[2] for key in ok})

    def by_round(a, b, get):
        values = []
        for n in rounds:
            top, bottom = ok.get((*a, n)), ok.get((*b, n))
            if top is not None and bottom is not None and get(top) is not None and get(bottom):
                values.append(get(top) / get(bottom))
        return values

    sps = lambda r: r["samples_per_s"]  # noqa: E731
    pairs = {
        "stronghold_2_over_1": (("stronghold", 2), ("stronghold", 1), sps),
        "stronghold_2_over_1_mean_step": (("stronghold", 2), ("stronghold", 1), samples_per_s_over_mean_step),
        "stronghold_over_zero_offload_at_2": (("stronghold", 2), ("zero_offload", 2), sps),
        "zero_offload_2_over_1": (("zero_offload", 2), ("zero_offload", 1), sps),
        "node_host_2_over_1_peak": (("stronghold", 2), ("stronghold", 1), lambda r: r["node"]["peak_used_GB"]),
        "node_host_2_over_1_steady": (("stronghold", 2), ("stronghold", 1), lambda r: r["node"]["steady_used_GB"]),
    }
    ratios_by_round = {name: by_round(*pair) for name, pair in pairs.items()}
    ratios = {name: statistics.median(values) if values else None for name, values in ratios_by_round.items()}
    verdicts = {}
    for name, (op, bound) in THRESHOLDS.items():
        value = ratios[name]
        verdicts[name] = None if value is None else (value >= bound if op == ">=" else value <= bound)
    two = [ok[key] for key in sorted(ok) if key[:2] == ("stronghold", 2)]
    summary = {"ratios": ratios, "thresholds": {k: f"{op} {v}" for k, (op, v) in THRESHOLDS.items()},
               "predicted_largest_layers_at_2": predict_largest_layers(two[-1]) if two else None,
               "pass": verdicts, "configs": {label(r): r["error"] for r in records if r.get("kind") == "config"}}
    if len(rounds) > 1:
        summary["ratios_by_round"] = ratios_by_round
    return summary


def samples_per_s_over_mean_step(record: dict[str, Any]) -> float | None:
    """samples/s over the mean of the timed steps rather than their median: what a long run gets, pauses that come
    every few steps (a full garbage collection on one rank, which in data parallel every rank waits out) included,
    which the median leaves out. Reported beside the judged ratio, not judged."""
    steps = record.get("step_s_all")
    if not steps or not record.get("step_s"):
        return None
    return record["samples_per_s"] * record["step_s"] / statistics.fmean(steps)


def label(record: dict[str, Any]) -> str:
    """A configuration line's label, with its round after a "#" from the second round on."""
    n = record.get("round", 1)
    return record["label"] if n == 1 else f"{record['label']}#{n}"


def predict_largest_layers(record: dict[str, Any], headroom: float = 0.95) -> int | None:
    """Layers whose node host memory would fill `headroom` of what the node had free before the run, scaling the
    record's peak linearly in the layer count (its fixed part, embeddings and process overheads, scaled too:
    the estimate errs low). Host memory is what bounds stronghold's size; its GPU use hardly grows with depth."""
    node, total = record.get("node") or {}, record.get("host_total_GB")
    if record.get("error") is not None or not node.get("peak_used_GB") or not total:
        return None
    return int(headroom * (total - node["baseline_GB"]) / (node["peak_used_GB"] / record["layers"]))


def fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def full_collection_steps(record: dict[str, Any]) -> tuple[int, int, float] | None:
    """(timed steps in which some rank ran a full garbage collection, timed steps, the longest rank's collection
    time summed over those steps) from the ranks' `per_step` (step_probes.py's `gc2_s`); None without them. In
    data parallel a step waits for its slowest rank, so a collection on any rank lengthens that step."""
    ranks = [r.get("per_step") for r in record.get("ranks") or []]
    if not ranks or not all(ranks):
        return None
    steps = min(len(r) for r in ranks)
    pauses = [max(r[i].get("gc2_s", 0.0) for r in ranks) for i in range(steps)]
    return sum(p > 0 for p in pauses), steps, sum(pauses)


def print_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print("| config | samples/s | step s | mean step s | full-GC steps (s) | node peak GiB | node steady GiB "
          "| ranks RSS sum GiB | rank peak RSS GiB | rank GPU peak GiB | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        if r.get("kind") != "config":
            continue
        node = r.get("node", {})
        per_rank = lambda key: "/".join(fmt(x.get(key), 1) for x in r.get("ranks", []))  # noqa: E731
        gc_steps = full_collection_steps(r)
        gc_text = "-" if gc_steps is None else f"{gc_steps[0]}/{gc_steps[1]} ({gc_steps[2]:.2f})"
        steps = r.get("step_s_all")
        print(f"| {label(r)} (L{r['layers']}) | {fmt(r.get('samples_per_s'))} | {fmt(r.get('step_s'), 3)} "
              f"| {fmt(statistics.fmean(steps) if steps else None, 3)} | {gc_text} "
              f"| {fmt(node.get('peak_used_GB'), 1)} | {fmt(node.get('steady_used_GB'), 1)} "
              f"| {fmt(node.get('ranks_rss_sum_peak_GB'), 1)} | {per_rank('peak_host_GB')} | {per_rank('peak_gpu_GB')} "
              f"| {r.get('error') or 'ok'} |")
    for name, value in summary["ratios"].items():
        bound = summary["thresholds"].get(name, "")
        verdict = summary["pass"].get(name)
        mark = "" if name not in summary["pass"] else " PASS" if verdict else " FAIL" if verdict is False else " n/a"
        print(f"[dp] {name} = {fmt(value, 3)} {bound}{mark}")
    print(f"[dp] predicted largest layer count on 2 ranks (host memory, linear): "
          f"{fmt(summary['predicted_largest_layers_at_2'])}")


def main(argv: list[str] | None = None) -> None:
    """python3 -m examples.bench.dp_summary FILE.jsonl [SAME_CALL_PREFIX]: the table and ratios of the configuration
    lines already recorded (those whose `same_call` starts with the prefix, if given)."""
    import json
    import sys
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit(main.__doc__)
    prefix = args[1] if len(args) > 1 else None
    records = [json.loads(line) for line in open(args[0]) if line.strip()]
    records = [r for r in records if r.get("kind") == "config"
               and (prefix is None or str(r.get("same_call", "")).startswith(prefix))]
    print_table(records, summarize(records))


if __name__ == "__main__":
    main()
