"""Set-up time of `stronghold.initialize` with and without huge pages for the host buffers (host_pages.py).

Each measurement is a fresh process (the allocator's state and the page cache would otherwise carry over),
alternating the two variants round by round so that drift hits both; the record gives every time and the
medians. CPU by default (DS_ACCELERATOR=cpu: the buffers are then all pageable); on a GPU machine the
pinned ones are the driver's and only masters and moments get the advice.

    python examples/bench_setup.py --layers 24 --hidden 1024 --rounds 5 --out results/engine/setup_time.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> None:
    from stronghold.launch import single_process_env
    single_process_env()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import stronghold
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 64,
                                       n_positions=128, vocab_size=1024)).to(torch.bfloat16)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
              "stronghold": {"kernels": False, "resident_blocks": 1, "window_size": 2}}
    start = time.perf_counter()
    engine, *_ = stronghold.initialize(model=model, config=config)
    seconds = time.perf_counter() - start
    print(json.dumps({"initialize_s": seconds, "params": sum(p.numel() for p in model.parameters()),
                      "host_bytes": engine.stronghold_runtime.host_bytes.peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from examples.provenance import git_commit
    times: dict[str, list[float]] = {"huge_pages": [], "small_pages": []}
    last = {}
    for _ in range(args.rounds):
        for variant in times:
            env = {**os.environ, "STRONGHOLD_HUGE_PAGES": "1" if variant == "huge_pages" else "0"}
            env.setdefault("DS_ACCELERATOR", "cpu")
            done = subprocess.run([sys.executable, __file__, "--child", "--layers", str(args.layers),
                                   "--hidden", str(args.hidden)], env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"bench_setup: the {variant} run failed:\n{done.stderr[-3000:]}")
            last = json.loads(done.stdout.strip().splitlines()[-1])
            times[variant].append(last["initialize_s"])
    import platform

    import psutil
    medians = {k: statistics.median(v) for k, v in times.items()}
    record = {"bench": "setup_time", "commit": git_commit(), "device": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB host (DS_ACCELERATOR "
              f"{os.environ.get('DS_ACCELERATOR', 'cpu')})",
              "config": {"layers": args.layers, "hidden": args.hidden, "dtype": "bf16", "params": last["params"],
                         "host_bytes": last["host_bytes"], "rounds": args.rounds},
              "initialize_s": times, "median_s": medians,
              "small_over_huge": medians["small_pages"] / medians["huge_pages"]}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
