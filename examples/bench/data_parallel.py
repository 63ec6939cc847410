"""Issue 11's acceptance in one command: stronghold and ZeRO-Offload on 1 and 2 GPUs of one node, same run.

    python3 -m examples.bench.data_parallel --out $OUT/dp.jsonl [--configs stronghold:1,stronghold:2,zero_offload:2]
    python3 -m examples.bench.data_parallel --out $OUT/dp.jsonl --largest        # largest layer count, 2 GPUs

The parent runs each configuration (system, world size) in turn: it starts `world` rank processes of this
module (`--child`), each with what a launcher sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT; the rendezvous store is the parent's, as torchrun's agent store, so no port is found free
and then lost), and waits for them under the configuration's time limit. Meanwhile it samples the node's used
memory (MemTotal - MemAvailable, minus the baseline before the launch: unlike psutil's `used` it counts
/dev/shm, which holds stronghold's node-shared working copy) and the ranks' RSS. A rank that fails makes the
others be killed `--grace-s` later (they would wait in a collective until NCCL's own timeout). One JSON line
per configuration goes to `--out` (appended), then a summary line with the acceptance ratios.

Each rank builds the model and engine exactly as every other benchmark (examples/bench: `systems.build`,
the seeded init of `model.py`, the GPU cap as `run_one` sets it, on the rank's own device), trains on seeded
batches that differ per rank (seed + rank, rank 0's are the other benches' batches), and times its steps
with `run_one.optimizer_steps`. A step of the configuration is the slowest rank's (the ranks meet in the
collectives anyway); samples/s = world x micro-batch x accumulation / median step. The ranks are not bound:
stronghold gives each local rank its share of the node's cores itself (stronghold/engine/cores.py), as under a
user's plain launch (`--bind-cores` binds them here first, for comparisons). `--launch torchrun|deepspeed` starts
the ranks by that launcher instead of this parent (launchers.py); each record names it (`"launch"`) and carries
`"speedup_vs_1gpu"`: samples/s over the same system's 1-rank configuration earlier in the same command.

Memory fields (GiB = 2**30 bytes): per rank `peak_host_GB` (ru_maxrss), `rss_steady_GB` and
`rss_shmem_steady_GB` (after the timed steps), `rss_timeline_GB` ([seconds, RSS GiB, its shared part GiB] every
0.05 s from the start of the build, at most 400 points), `rss_marks_s` ("built", "first_step_done", "warmed_up",
"timed_steps_done") and `rss_peak_GB` / `rss_peak_at_s`; per node `node.peak_used_GB` (sampled every `--sample-s`),
`node.steady_used_GB` (rank 0 reads it after the timed steps, every rank past a barrier), `node.timeline_GB`
([seconds, used, Shmem, AnonPages], each above its value before the launch, about every second),
`node.ranks_rss_sum_peak_GB` and `node.ranks_shmem_sum_peak_GB`. Shared memory is counted once by the
node figures but in every rank's RSS, so the ranks' RSS sum overstates the node for stronghold.
Stronghold's `stronghold_report()` (host bytes per rank and node) and floor terms come from rank 0; the
floor terms are measured on rank 0 alone after the steps (the other ranks idle), so they leave out the
ranks' contention for host memory bandwidth and the gradients' reduce-scatter.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.bench.data_parallel_rank import child_main  # noqa: E402
from examples.bench.dp_config import FIGURE, Options, run_config  # noqa: E402
from examples.bench.dp_summary import fmt, label, predict_largest_layers, print_table, summarize  # noqa: E402
from examples.bench.launchers import LAUNCHES, redirect_rank_output  # noqa: E402
from examples.bench.point import SEED_CAP_GB, Point, add_point_args, add_shape_args, parse_cap, point_from_args  # noqa: E402
from examples.bench.search import IntSearch, largest_trainable  # noqa: E402
from examples.bench.store import current_provenance, now_iso, point_fields, read_jsonl  # noqa: E402

DEFAULT_CONFIGS = "stronghold:1,stronghold:2,zero_offload:2"
ACCEPTANCE_LAYERS = 100  # GPT-2 h2048 x 100 layers = 5.14 B
FALLBACK_LARGEST_START = 160  # 8.2 B: about half of what 256 GiB of host memory should hold
DP_TIMED_STEPS = 12
"""Timed steps of each configuration (the points' default is 3): over 3 steps the one-GPU step moves between calls of
one machine kind by more than the 2-over-1 ratio's margin (results/placement/data_parallel.jsonl); at the acceptance
point's step time the extra steps cost seconds against the configuration's build."""


# ---------------------------------------------------------------- CLI

def _configs(text: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        system, _, world = item.partition(":")
        if system not in ("stronghold", "zero_offload", "no_offload", "zero_infinity") or not world.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected SYSTEM:WORLD, e.g. stronghold:2")
        out.append((system, int(world)))
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    from examples.bench.run_one import _json_safe

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(_json_safe(record), sort_keys=True) + "\n")


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _measured(path: Path, commit: str) -> dict[tuple, dict[str, Any]]:
    """--resume: this commit's successful configuration lines in `path`, by (system, world, key of the point,
    round)."""
    return {(r["system"], r["world_size"], r.get("key"), r.get("round", 1)): r for r in read_jsonl(path)
            if r.get("kind") == "config" and r.get("role") == "measure" and r.get("error") is None
            and r.get("commit") == commit}


def _speedup(record: dict[str, Any], earlier: list[dict[str, Any]]) -> float | None:
    """samples/s over the same system's 1-rank configuration measured before it in this command (same launch)."""
    if record.get("error") is not None or not record.get("samples_per_s"):
        return None
    if record["world_size"] == 1:
        return 1.0
    one = [r for r in earlier if r.get("system") == record["system"] and r.get("world_size") == 1
           and r.get("error") is None and r.get("launch") == record.get("launch") and r.get("samples_per_s")]
    return record["samples_per_s"] / one[-1]["samples_per_s"] if one else None


def run_all(args: argparse.Namespace, opts: Options) -> list[dict[str, Any]]:
    budget, records = Budget(args.budget_s), []
    done = _measured(args.out, current_provenance().commit) if args.resume else {}
    for round_, (system, world) in itertools.product(range(1, args.rounds + 1), args.configs):
        point = point_from_args(args, system=system)
        measured = done.get((system, world, point.key(), round_))
        if measured is not None:
            print(f"[dp] {label(measured)}: measured at this commit already ({args.out}), not run again", flush=True)
            records.append(measured)
            continue
        timeout_s = min(args.config_timeout_s, budget.left())
        if timeout_s < args.min_start_s:
            record = {"kind": "config", "role": "measure", "label": f"{system}:{world}", **point_fields(point),
                      "world_size": world, "error": "skipped", "error_detail": f"budget: {budget.left():.0f} s left",
                      "date": now_iso(), "commit": current_provenance().commit}
        else:
            print(f"[dp] {system}:{world} {point.label()} (limit {timeout_s:.0f} s)", flush=True)
            record = run_config(point, world, timeout_s, opts)
            if record["error"] == "timeout" and timeout_s < args.config_timeout_s:
                record["error_detail"] = f"cut by the budget at {timeout_s:.0f} s (--budget-s): {record['error_detail']}"
        record["round"] = round_
        record["speedup_vs_1gpu"] = _speedup(record, records)
        print(f"[dp] {record['label']}: {record['error'] or 'ok'} {fmt(record.get('samples_per_s'))} samples/s "
              f"after {record.get('wall_s', 0):.0f} s", flush=True)
        _append(args.out, record)
        records.append(record)
    summary = {"kind": "summary", "figure": FIGURE, "date": now_iso(), "commit": current_provenance().commit,
               "device": next((r.get("device") for r in records if r.get("device")), None), **summarize(records)}
    _append(args.out, summary)
    print_table(records, summary)
    return records


def _cached_probe(path: Path, point: Point, world: int, commit: str) -> dict[str, Any] | None:
    found = None
    for r in read_jsonl(path):
        if (r.get("role") == "largest_probe" and r.get("key") == point.key() and r.get("world_size") == world
                and r.get("commit") == commit and r.get("error") != "skipped"):
            found = r
    return found


def _predicted_start(path: Path, base: Point, world: int, commit: str) -> int | None:
    """predict_largest_layers of the newest measured stronghold record of this shape and world in `path`."""
    shape = lambda r: [r.get(k) for k in ("arch", "hidden", "heads", "seq", "batch", "vocab", "gpu_cap_GB")]  # noqa: E731
    newest = None
    for r in read_jsonl(path):
        if (r.get("kind") == "config" and r.get("role") == "measure" and r.get("system") == "stronghold"
                and r.get("world_size") == world and r.get("error") is None and r.get("commit") == commit
                and shape(r) == shape(point_fields(base))):
            newest = r
    return None if newest is None else predict_largest_layers(newest)


class _OutOfBudget(Exception):
    pass


def run_largest(args: argparse.Namespace, opts: Options) -> int:
    """Largest trainable layer count of stronghold at world 2 (search.py); probes cached in --out per commit,
    so a search cut by the budget resumes where it stopped when the same command runs again."""
    budget, world, commit = Budget(args.budget_s), args.largest_world, current_provenance().commit
    base = point_from_args(args, system="stronghold", warmup_steps=args.probe_warmup_steps,
                           timed_steps=args.probe_timed_steps)

    def fits(layers: int) -> bool:
        point = base.with_(layers=layers)
        record = _cached_probe(args.out, point, world, commit)
        if record is None:
            limit = min(args.probe_timeout_s, budget.left())
            if limit < args.min_start_s:
                raise _OutOfBudget(layers)
            print(f"[dp] probe {layers} layers on {world} ranks (limit {limit:.0f} s)", flush=True)
            record = run_config(point, world, limit, opts, role="largest_probe")
            if record["error"] == "timeout" and limit < args.probe_timeout_s:
                # Cut by the budget, not by its own limit: no verdict; the next command probes it again.
                record.update(error="skipped", error_detail=f"cut by the budget at {limit:.0f} s")
                _append(args.out, record)
                raise _OutOfBudget(layers)
            _append(args.out, record)
        print(f"[dp] {layers} layers: {record['error'] or 'trains'}", flush=True)
        return record["error"] is None

    start = args.largest_start or _predicted_start(args.out, base, world, commit) or FALLBACK_LARGEST_START
    start = max(args.largest_step, min(start, args.largest_max) // args.largest_step * args.largest_step)
    # search.py truncates value x growth before rounding up to the step: with start x (growth - 1) < step the
    # first growth would give the start again, forever. Values only grow, so a large enough first factor suffices.
    growth = max(args.largest_growth, 1 + args.largest_step / start)
    print(f"[dp] largest: search from {start} layers (step {args.largest_step}, growth {growth:g})")
    search = IntSearch(field="layers", start=start, step=args.largest_step, growth=growth,
                       maximum=args.largest_max, known_fit=args.largest_known)
    try:
        found = largest_trainable(fits, search)
    except _OutOfBudget as cut:
        print(f"[dp] largest: incomplete (budget spent at the probe of {cut} layers): run the same command again")
        return 2
    params = point_fields(base.with_(layers=max(found.largest_fit, 1)))["params_B"] if found.largest_fit else 0.0
    record = {"kind": "largest", "figure": FIGURE, "system": "stronghold", "world_size": world, "date": now_iso(),
              "commit": commit, "largest_layers": found.largest_fit, "params_B": params,
              "smallest_failure_layers": found.smallest_failure, "probes": list(found.probes),
              "shape": {k: v for k, v in point_fields(base).items() if k not in ("key", "layers", "params_B")}}
    _append(args.out, record)
    print(f"[dp] largest: complete: {found.largest_fit} layers ({params:.2f} B) train on {world} ranks; "
          f"smallest failure {found.smallest_failure}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        parser = argparse.ArgumentParser(prog="examples.bench.data_parallel --child")
        parser.add_argument("--child", action="store_true")
        add_point_args(parser)
        parser.add_argument("--no-floor", dest="floor", action="store_false")
        parser.add_argument("--bind-cores", action="store_true")
        parser.add_argument("--simulate-crash", action="store_true")
        parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's launcher
        redirect_rank_output()
        return child_main(parser.parse_args(argv))
    parser = argparse.ArgumentParser(prog="python3 -m examples.bench.data_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines appended here")
    parser.add_argument("--configs", type=_configs, default=_configs(DEFAULT_CONFIGS),
                        help=f"SYSTEM:WORLD list, run in this order (default {DEFAULT_CONFIGS})")
    parser.add_argument("--layers", type=int, default=ACCEPTANCE_LAYERS)
    parser.add_argument("--gpu-cap-gb", type=parse_cap, default=SEED_CAP_GB, help="GiB per GPU, or 'none'")
    add_shape_args(parser)
    parser.set_defaults(timed_steps=DP_TIMED_STEPS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--config-timeout-s", type=float, default=300.0, help="per configuration, build included")
    parser.add_argument("--budget-s", type=float, default=540.0, help="no configuration starts past it")
    parser.add_argument("--min-start-s", type=float, default=60.0, help="skip a configuration with less left")
    parser.add_argument("--grace-s", type=float, default=30.0, help="after a rank fails, kill the others this late")
    parser.add_argument("--sample-s", type=float, default=0.2, help="node memory sampling interval")
    parser.add_argument("--log-dir", type=Path, default=None, help="ranks' stdout/stderr (default: a temp dir)")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip the floor-term probes")
    parser.add_argument("--bind-cores", action="store_true",
                        help="bind each rank to an equal share of the cores before it starts (default: the engine "
                             "shares them itself, as under a plain launch)")
    parser.add_argument("--launch", choices=LAUNCHES, default="spawn",
                        help="who starts the ranks: this script (spawn), plain torchrun or plain deepspeed; recorded "
                             "as the record's \"launch\"")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the --configs list this many times in turn (1, 2, 1, 2, ...); the summary's ratios "
                             "are the medians of the rounds' (a machine that drifts within a call favours the later "
                             "runs of a single round)")
    parser.add_argument("--resume", action="store_true",
                        help="skip configurations --out holds a successful line of at this commit (so the "
                             "configurations of 1 to 8 GPUs can span several commands)")
    parser.add_argument("--largest", action="store_true", help="search stronghold's largest layer count instead")
    parser.add_argument("--largest-world", type=int, default=2)
    parser.add_argument("--largest-start", type=int, default=None,
                        help="first probe (default: predicted from this commit's stronghold:2 line in --out, "
                             f"else {FALLBACK_LARGEST_START})")
    parser.add_argument("--largest-step", type=int, default=16)
    parser.add_argument("--largest-growth", type=float, default=1.25)
    parser.add_argument("--largest-known", type=int, default=0,
                        help="a layer count known to train (an earlier call): a failing start bisects down to it")
    parser.add_argument("--largest-max", type=int, default=512)
    parser.add_argument("--probe-timeout-s", type=float, default=420.0)
    parser.add_argument("--probe-warmup-steps", type=int, default=1)
    parser.add_argument("--probe-timed-steps", type=int, default=1)
    parser.add_argument("--simulate-crash", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if args.device == "cuda":
        import torch

        needed = max(w for _, w in args.configs) if not args.largest else args.largest_world
        if torch.cuda.device_count() < needed:
            print(f"[dp] needs {needed} GPUs, {torch.cuda.device_count()} visible (a 2-GPU machine for world 2; "
                  "--device cpu for a CPU run)", file=sys.stderr)
            return 3
    with tempfile.TemporaryDirectory() as tmp:
        opts = Options(device=args.device, log_dir=args.log_dir or Path(tmp), grace_s=args.grace_s,
                       sample_s=args.sample_s, floor=args.floor and not args.largest, bind_cores=args.bind_cores,
                       launch=args.launch,
                       simulate_crash=args.simulate_crash)
        if args.largest:
            return run_largest(args, opts)
        records = run_all(args, opts)
    return 0 if all(r["error"] is None for r in records) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "--child" in sys.argv:
        # The result is out; skip interpreter teardown, where DeepSpeed's process group and pinned
        # buffers have been seen to hang (run_one.py).
        os._exit(code)
    sys.exit(code)
