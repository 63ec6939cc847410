"""DeepSpeed's throughput timer with and without its device synchronizations, alternated step by step in one process.

DeepSpeed's `ThroughputTimer` synchronizes the whole device at every forward and every step() when its config says
`"synchronized": true` (DeepSpeed's default; stronghold.initialize leaves it off unless the config sets "timers":
engine/launch.py). One engine, one point: after the warm-up steps, timed steps alternate synchronized (S) and not (U)
in the order S U U S S U U S ..., so a drift over the run weighs on both alike; each step's seconds run from its first
forward to a device synchronization after its last step(). Same step, same memory, same plan: only the timer's
synchronizations differ.

    python3 -m examples.bench.timer_sync --system stronghold --layers 32 --arch llama --hidden 4096 \
        --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256 --seq 2048 --batch 1 --accumulation 8 \
        --gpu-cap-gb 24 --timed-steps 8 --out results/engine/timer_sync.jsonl [--same-call NAME]

Appends one JSON line to --out: both arms' step seconds and medians, unsynchronized over synchronized (of the medians,
and pair by pair: each two adjacent timed steps hold one of each arm, so a change of regime part-way through the run,
such as the gradient norm falling under the clipping threshold, weighs on both sides of a pair alike), every step's
micro-batch losses and gradient norm (warm-up first), the engine's placement and its floor terms, commit and device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.bench.point import add_point_args, point_from_args  # noqa: E402
from examples.bench.store import current_provenance, now_iso  # noqa: E402


def arms(timed_steps: int) -> list[bool]:
    """Whether each timed step runs synchronized: S U U S, S U U S, ... (`timed_steps` of them)."""
    return [(i % 4) in (0, 3) for i in range(timed_steps)]


def pair_ratios(order: list[bool], step_s: list[float]) -> list[float]:
    """Unsynchronized over synchronized for each two adjacent timed steps (`order`: whether each ran synchronized,
    `step_s`: their seconds, in the order run); an odd last step has no pair."""
    return [step_s[j + 1] / step_s[j] if order[j] else step_s[j] / step_s[j + 1] for j in range(0, len(order) - 1, 2)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_point_args(parser)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--same-call", default=None)
    args = parser.parse_args(argv)

    import torch

    from examples.bench.environment import apply_gpu_cap, environment_info
    from examples.bench.model import random_batches
    from examples.bench.run_one import optimizer_steps
    from examples.bench.systems import build

    point = point_from_args(args)
    if point.system != "stronghold":
        parser.error("--system stronghold: the timer's default is stronghold's to set")
    has_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if has_cuda else torch.device("cpu")
    apply_gpu_cap(point, has_cuda)
    engine = build(point, device).engine
    batches = random_batches(point, max(2, point.accumulation), device)
    sync = torch.cuda.synchronize if has_cuda else (lambda: None)
    timer = engine.tput_timer.config
    plan = arms(point.timed_steps)
    seconds: dict[str, list[float]] = {"synchronized": [], "unsynchronized": []}
    losses: list[list[float]] = []
    norms: list[float | None] = []
    in_order: list[float] = []
    one = point.with_(warmup_steps=0, timed_steps=1)  # run_one's step loop, a step at a time: the arm changes between
    for i in range(point.warmup_steps + point.timed_steps):
        synchronized = plan[i - point.warmup_steps] if i >= point.warmup_steps else False
        timer.synchronized = synchronized
        step_s, step_losses = optimizer_steps(engine, one, batches, sync, lambda: None)
        losses.append(step_losses)
        norms.append(engine.get_global_grad_norm())  # beside the deferred shares: under the clipping threshold or not
        if i >= point.warmup_steps:
            seconds["synchronized" if synchronized else "unsynchronized"].append(step_s[0])
            in_order.append(step_s[0])
    report = engine.stronghold_report()
    chosen = report.get("placement", {}).get("plan", {})
    medians = {arm: statistics.median(values) for arm, values in seconds.items() if values}
    pairs = pair_ratios(plan, in_order)
    record = {
        "figure": "timer_sync", "date": now_iso(), "same_call": args.same_call, **environment_info(has_cuda),
        "commit": current_provenance().commit, "point": point.key(),
        "arch": point.arch, "hidden": point.hidden, "layers": point.layers, "seq": point.seq, "batch": point.batch,
        "accumulation": point.accumulation, "vocab": point.vocab, "gpu_cap_GB": point.gpu_cap_GB,
        "order": ["S" if s else "U" for s in plan], "step_s": seconds, "losses": losses, "grad_norms": norms,
        "median_s": medians,
        "unsynchronized_over_synchronized": (medians["unsynchronized"] / medians["synchronized"]
                                             if len(medians) == 2 else None),
        "pairwise_unsynchronized_over_synchronized": pairs,
        "pairwise_median": statistics.median(pairs) if pairs else None,
        "placement": {"resident_blocks": report.get("resident_blocks"), "window_size": report.get("window_size"),
                      "blockwise_backward": chosen.get("blockwise_backward"),
                      "predicted_step_s": chosen.get("predicted_step_s"), "floor": chosen.get("floor"),
                      # Each step's share of updates deferred past the backward (1.0: none ran early, beside it).
                      "deferred_share_per_step": report.get("placement", {}).get("measured", {}).get(
                          "deferred_share_per_step")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    shown = ("median_s", "unsynchronized_over_synchronized", "pairwise_median", "placement")
    print(json.dumps({k: record[k] for k in shown}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
