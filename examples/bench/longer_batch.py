"""Micro-batches longer than the first, as a collator that pads each batch to its own longest sequence sends: one
stronghold point trained with the first step's first `--first-micro-batches` micro-batches (default 1) `--first-seq`
tokens a sequence long and every other micro-batch `--seq`, so the placement plans from the short ones and the long ones
must find their room (stronghold/planning/batch_room.py). Prints one JSON record (appended to `--out` if given): the
step times, the window and residency after each step, the window's shrinks, the engine's report, the GPU and host
peaks, or the error that ended it.

    python -m examples.bench.longer_batch --system stronghold --arch llama --layers 32 --hidden 2560 --heads 20 \\
        --seq 2048 --batch 2 --accumulation 4 --gpu-cap-gb 32 --first-seq 512 --out results/kernels/longer_batch.jsonl

`--first-seq` equal to `--seq` is the same point with every micro-batch of one length: its baseline, in the same call.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

from .environment import GiB, apply_gpu_cap, environment_info, gpu_memory, setup_environment
from .point import add_point_args, point_from_args
from .run_one import _json_safe, _sync, caught
from .store import current_provenance, now_iso, point_fields


def train(engine, batches: list[dict], first: list[dict], steps: int, has_cuda: bool) -> dict[str, Any]:
    """`steps` optimizer steps of len(batches) micro-batches, the first step's first ones `first`: each step's seconds
    and the runtime's window and resident blocks after it."""
    runtime = engine.stronghold_runtime
    out: dict[str, list] = {"step_s_all": [], "window_sizes": [], "resident_blocks": [], "losses": []}
    for step in range(steps):
        micro = [*first, *batches[len(first):]] if step == 0 else batches
        _sync(has_cuda)
        start = time.perf_counter()
        for batch in micro:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            out["losses"].append(loss.detach())
        _sync(has_cuda)
        out["step_s_all"].append(time.perf_counter() - start)
        out["window_sizes"].append(runtime.window_size)
        out["resident_blocks"].append(runtime.resident_count)
    out["losses"] = [float(loss.float()) for loss in out["losses"]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.bench.longer_batch", description=__doc__.split("\n")[0])
    add_point_args(parser)
    parser.add_argument("--first-seq", type=int, required=True,
                        help="tokens a sequence of the first step's first micro-batch (at most --seq)")
    parser.add_argument("--first-micro-batches", type=int, default=1,
                        help="how many of the first step's micro-batches are --first-seq long (default 1)")
    parser.add_argument("--out", default=None, help="a JSONL file to append the record to")
    args = parser.parse_args(argv)
    point = point_from_args(args)
    if point.system != "stronghold" or not 1 <= args.first_seq <= point.seq:
        parser.error(f"--system stronghold and 1 <= --first-seq <= --seq ({point.seq}) are needed "
                     f"(got {point.system}, {args.first_seq})")
    if not 1 <= args.first_micro_batches <= point.accumulation:
        parser.error(f"--first-micro-batches must be from 1 to --accumulation ({point.accumulation}), got "
                     f"{args.first_micro_batches}")
    import torch

    from .model import random_batches
    from .systems import build

    has_cuda = setup_environment()
    provenance = current_provenance()
    record: dict[str, Any] = {"figure": "longer_batch", "first_seq": args.first_seq,
                              "first_micro_batches": args.first_micro_batches, **point_fields(point),
                              **environment_info(has_cuda), "commit": provenance.commit, "dirty": provenance.dirty,
                              "date": now_iso(), "gpu_cap_applied": apply_gpu_cap(point, has_cuda)}
    try:
        device = torch.device("cuda", 0) if has_cuda else torch.device("cpu")
        built = build(point, device)
        record.update(build_s=built.build_s, engine_init_s=built.engine_init_s)
        batches = random_batches(point, point.accumulation, device)
        first = [{key: value[:, :args.first_seq] for key, value in batch.items()}
                 for batch in batches[:args.first_micro_batches]]
        record.update(train(built.engine, batches, first, point.warmup_steps + point.timed_steps, has_cuda))
        record["step_s"] = statistics.median(record["step_s_all"][point.warmup_steps:])
        report = built.engine.stronghold_report()
        placement = report.get("placement") or {}
        record["longer_batches"] = placement.get("longer_batches")
        record["plan"] = {key: (placement.get("plan") or {}).get(key) for key in ("resident_blocks", "window_size")}
        record["stronghold"] = report
        record["error"] = None
    except BaseException as exc:  # noqa: B036 - every failure becomes a recorded outcome
        record.update(caught(exc))
    if has_cuda:
        record.update(gpu_memory())
    record["peak_host_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    line = json.dumps(_json_safe(record), sort_keys=True)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(line + "\n")
    return 0 if record["error"] is None else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as run_one: skip the interpreter teardown, where DeepSpeed's process group has been seen to hang
