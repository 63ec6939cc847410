"""Set-up time of `stronghold.initialize` with the streamed blocks' host buffers built by 1 thread or by the
default number at once (store.build_block_stores, SETUP_THREADS), alternating, each round in a fresh
process (the first engine's host memory would otherwise still be held), so the two are compared on the
same machine and moment. A Llama-shaped model built fresh per round (fp32 on the
CPU, as a user builds it), bf16 training, the given accumulation. CPU or GPU (on a GPU the buffers are
also page-locked).

    python3 -m examples.bench.setup_time --out results/engine/setup_time.jsonl   (defaults: h2560, 8 layers, 1 resident)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

if __package__ in (None, ""):  # run as a file, not with -m: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.provenance import ROOT as REPO_ROOT, git_commit  # noqa: E402


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    host = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB host"
    return f"{host} (DS_ACCELERATOR {os.environ.get('DS_ACCELERATOR', 'default')})"


def one_round(opts: argparse.Namespace, threads: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    import stronghold
    from stronghold.engine.launch import single_process_env
    from stronghold.streaming import store
    single_process_env()  # one process without a launcher: DeepSpeed needs the rank variables
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=opts.hidden, intermediate_size=opts.intermediate,
                                         num_attention_heads=opts.heads, num_hidden_layers=opts.layers,
                                         vocab_size=opts.vocab))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": opts.accumulation,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 0},
              "stronghold": {"resident_blocks": opts.resident, "window_size": 4, "kernels": False}}
    default = store.SETUP_THREADS
    store.SETUP_THREADS = threads
    try:
        start = time.perf_counter()
        engine, _, _, _ = stronghold.initialize(model=model, config=config)
        seconds = time.perf_counter() - start
    finally:
        store.SETUP_THREADS = default
    engine.destroy()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--intermediate", type=int, default=6912)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--resident", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each, alternating")
    parser.add_argument("--out")
    parser.add_argument("--child-threads", type=int, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child_threads is not None:  # one round, in this fresh process
        print(f"initialize_s {one_round(opts, opts.child_threads)}", flush=True)
        return
    if not opts.out:
        parser.error("--out is required")
    from stronghold.streaming import store
    counts = {"1": 1, "default": store.SETUP_THREADS}
    times: dict[str, list[float]] = {name: [] for name in counts}
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items() if k not in ("out", "child_threads", "rounds")]
    for _ in range(opts.rounds):
        for name, threads in counts.items():
            child = subprocess.run([sys.executable, "-m", "examples.bench.setup_time", *shape, f"--child-threads={threads}"],
                                   capture_output=True, text=True, check=True, cwd=REPO_ROOT)
            times[name].append(float(child.stdout.split("initialize_s ")[-1].split()[0]))
            print(f"threads {name}: {times[name][-1]:.2f} s", flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    record = {"bench": "setup_threads", "commit": git_commit(), "device": device_name(),
              "config": {**{k: v for k, v in vars(opts).items() if k not in ("out", "child_threads")}, "dtype": "bf16",
                         "default_threads": store.SETUP_THREADS},
              "initialize_s": times, "median_s": median, "ratio_1_over_default": median["1"] / median["default"]}
    with open(opts.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
