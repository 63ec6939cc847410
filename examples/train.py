"""The main job: train a GPT-2-style byte-level model on the embedded corpus with stronghold.

    deepspeed examples/train.py --deepspeed_config ds_configs/stronghold.json [--size small]
    python examples/train.py --deepspeed_config ds_configs/stronghold_cpu.json   (no launcher needed)

Uses the GPU if there is one, else the CPU (set DS_ACCELERATOR=cpu there). Prints a progress bar and
one line per step: loss, tokens/s, TFLOP/s, GPU and host memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Model sizes (hidden, layers, heads, seq, micro-batch). "tiny" is the CPU default.
SIZES = {
    "tiny": (128, 4, 4, 128, 4),
    "small": (768, 12, 12, 512, 8),
    "medium": (1024, 24, 16, 1024, 8),
    "1b": (2048, 20, 16, 1024, 4),
    "1.7b": (2048, 32, 16, 1024, 4),
}


def parse_args() -> argparse.Namespace:
    import deepspeed
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model preset (default: tiny on the CPU, small on a GPU)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int, help="micro-batch size (overrides the config's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40 CPU / 100 GPU)")
    parser.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="append a JSON summary line to this file")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def build_model(hidden: int, layers: int, heads: int, seq: int, vocab: int | None = None):
    """GPT-2 of this shape, HF's own init; `vocab` defaults to the byte corpus's 256 (a larger one
    only widens the embedding and the head, for benchmarks that name a model size)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from examples.corpus import VOCAB
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq, vocab_size=vocab or VOCAB,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main() -> None:
    from stronghold.engine.launch import single_process_env
    single_process_env()  # `python examples/train.py` works without the launcher
    args = parse_args()
    if args.deepspeed_config is None:
        raise SystemExit("pass --deepspeed_config ds_configs/stronghold.json (GPU) or stronghold_cpu.json (CPU)")
    import stronghold
    from stronghold.engine.launch import load_config
    from stronghold.engine.flops import transformer_flops_per_token
    from stronghold.integrations.hf_compat import enable_checkpointing
    from stronghold.engine.telemetry import host_rss_gb, matmul_params
    from examples.corpus import ByteBatches, corpus_bytes
    from examples.provenance import git_commit

    on_gpu = torch.cuda.is_available()
    hidden, layers, heads, seq, batch = SIZES[args.size or ("small" if on_gpu else "tiny")]
    hidden, layers, heads, seq = (args.hidden or hidden, args.layers or layers, args.heads or heads, args.seq or seq)
    config = load_config(args.deepspeed_config)
    batch = args.batch or config.get("train_micro_batch_size_per_gpu", batch)
    config["train_micro_batch_size_per_gpu"] = batch
    config.pop("train_batch_size", None)
    steps = args.steps or (100 if on_gpu else 40)

    torch.manual_seed(args.seed)
    model = build_model(hidden, layers, heads, seq)
    if args.checkpointing:
        enable_checkpointing(model)
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = transformer_flops_per_token(*matmul_params(model, model.transformer.h), layers, hidden, seq,
                                                  args.checkpointing)
    args.deepspeed_config = None  # passed as config= below
    engine, _, _, _ = stronghold.initialize(args=args, model=model, config=config)
    report = engine.stronghold_report()
    print(f"model: GPT-2 {hidden}x{layers} ({n_params / 1e6:.1f} M params), seq {seq}, micro-batch {batch}, "
          f"grad accumulation {engine.gradient_accumulation_steps()}; window {report['window_size']}, "
          f"resident blocks {report['resident_blocks']}, streamed {report['streamed_blocks']}; "
          f"device {engine.device}", flush=True)

    from tqdm import tqdm
    data = ByteBatches(corpus_bytes(), seq, batch, seed=args.seed)
    gas = engine.gradient_accumulation_steps()
    tokens_per_step = batch * seq * gas
    bar = tqdm(range(steps), desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    history = []
    for step in bar:
        start = time.perf_counter()
        for _ in range(gas):
            batch_data = {k: v.to(engine.device) for k, v in next(data).items()}
            loss = engine(**batch_data).loss
            engine.backward(loss)
            engine.step()
        loss_value = loss.item()  # synchronizes with the GPU, so the step time below is real
        seconds = time.perf_counter() - start
        tokens_s = tokens_per_step / seconds
        gpu_gb = torch.cuda.max_memory_allocated() / 1e9 if on_gpu else 0.0
        line = {"step": step + 1, "loss": round(loss_value, 4), "tokens_per_s": round(tokens_s, 1),
                "tflops": round(tokens_s * flops_per_token / 1e12, 3), "peak_gpu_GB": round(gpu_gb, 2),
                "host_GB": round(host_rss_gb(), 2), "lr": engine.get_lr()[0]}
        history.append(line)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_s:.0f}")
        tqdm.write(f"step {line['step']:4d} | loss {line['loss']:.4f} | {line['tokens_per_s']:9.1f} tok/s | "
                   f"{line['tflops']:7.3f} TFLOP/s | GPU {line['peak_gpu_GB']:6.2f} GB | host {line['host_GB']:6.2f} GB",
                   file=sys.stdout)
    timed = history[min(2, len(history) - 1):]
    summary = {"model": f"gpt2-{hidden}x{layers}", "params": n_params, "seq": seq, "batch": batch, "steps": steps,
               "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
               "tokens_per_s": sum(h["tokens_per_s"] for h in timed) / len(timed),
               "peak_gpu_GB": max(h["peak_gpu_GB"] for h in history),
               "peak_host_GB": max(h["host_GB"] for h in history),
               "device": torch.cuda.get_device_name() if on_gpu else f"cpu ({os.cpu_count()} cores)",
               # The measured code: $STRONGHOLD_COMMIT where the tree has no .git (the GPU machine's copy).
               "commit": git_commit() or "unknown", "config": config,
               "stronghold": engine.stronghold_report()}
    print("summary: " + json.dumps(summary), flush=True)
    if args.json is not None:
        with args.json.open("a") as f:
            f.write(json.dumps(summary) + "\n")
    engine.destroy()


if __name__ == "__main__":
    main()
