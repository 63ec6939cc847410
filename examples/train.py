"""The main job: train a GPT-2-style byte-level model on the embedded corpus with stronghold.

    deepspeed examples/train.py --deepspeed_config ds_configs/stronghold.json [--size small]
    python examples/train.py --deepspeed_config ds_configs/stronghold_cpu.json   (no launcher needed)
    python examples/train.py --resume runs/<timestamp> --steps 80                  (continue a run)

Uses the GPU if there is one, else the CPU (under the deepspeed launcher, set DS_ACCELERATOR=cpu there).
Prints one line per step (loss, learning rate, samples/s, host memory; on a GPU also TFLOP/s and peak GPU
memory), with a progress bar when stdout is a terminal. Leaves in --output-dir (default runs/<timestamp>):
    config.json     the resolved configuration: model shape, seed, the DeepSpeed config as run, and the
                    stronghold section with its "auto" values as the engine resolved them
    metrics.jsonl   one JSON line per optimizer step (appended to when a run is resumed)
    checkpoint/     the final engine checkpoint (engine.save_checkpoint: checkpoint/global_step<N>, latest)
    summary.json    the run's summary (also printed, and appended to --json if given)
--resume takes a run directory, its checkpoint/ directory or one tag in it, and continues exactly where it
stopped (weights, AdamW states, LR schedule, data position, random state): --steps is the total to reach.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

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
SHAPE_KEYS = ("hidden", "layers", "heads", "seq")
CHECKPOINT_DIR = "checkpoint"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    import deepspeed
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model preset (default: tiny on the CPU, small on a GPU)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int, help="micro-batch size (overrides the config's)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps to reach, counting a resumed run's (default 40 CPU / 100 GPU)")
    parser.add_argument("--grad-checkpointing", "--checkpointing", dest="grad_checkpointing", action="store_true",
                        help="HF gradient (activation) checkpointing: recompute each block in backward")
    parser.add_argument("--seed", type=int, default=None, help="model init and data order (default 0)")
    parser.add_argument("--output-dir", type=Path,
                        help="where config.json, metrics.jsonl, checkpoint/ and summary.json go (default "
                             "runs/<timestamp>; with --resume, the resumed run's directory)")
    parser.add_argument("--resume", type=Path, metavar="DIR_OR_CHECKPOINT",
                        help="continue from a run directory, its checkpoint/ directory or a tag in it")
    parser.add_argument("--no-checkpoint", action="store_true", help="do not save the final checkpoint")
    parser.add_argument("--json", type=Path, help="append a JSON summary line to this file")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def build_model(hidden: int, layers: int, heads: int, seq: int, vocab: int | None = None):
    """GPT-2 of this shape, HF's own init; `vocab` defaults to the byte corpus's 256 (a larger one
    only widens the embedding and the head, for benchmarks that name a model size)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from examples.corpus import VOCAB
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq, vocab_size=vocab or VOCAB,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    # transformers derives the loss from the class name, and "GPT2LMHeadModel" names none (it would warn and
    # fall back to this same causal-LM loss on the first forward).
    model.loss_type = "ForCausalLM"
    return model


def find_checkpoint(path: Path) -> tuple[Path, Optional[str], Optional[Path]]:
    """(save_dir, tag or None for `latest`, the run directory or None) for --resume's argument."""
    if (path / CHECKPOINT_DIR / "latest").is_file():
        return path / CHECKPOINT_DIR, None, path
    if (path / "latest").is_file():
        return path, None, path.parent if (path.parent / "config.json").is_file() else None
    if (path / "manifest.json").is_file() or (path / "meta.pt").is_file():
        run = path.parent.parent
        return path.parent, path.name, run if (run / "config.json").is_file() else None
    raise ValueError(f"--resume {path}: no checkpoint there; give a run directory (with {CHECKPOINT_DIR}/), its "
                     f"{CHECKPOINT_DIR}/ directory or one global_step<N> directory in it")


def settings(args: argparse.Namespace, config: dict, on_gpu: bool, previous: Optional[dict]) -> dict:
    """Model shape, micro-batch and seed: a resumed run's own (flags may repeat them, not change them),
    else the flags over the config's micro-batch over the size preset."""
    if previous is not None:
        chosen = {**previous["model"], "batch": previous["batch"], "seed": previous["seed"]}
        for key in (*SHAPE_KEYS, "batch", "seed"):
            given = getattr(args, key)
            if given is not None and given != chosen[key]:
                raise ValueError(f"--{key} {given}: the resumed run has {key} {chosen[key]}; leave the flag out")
        return chosen
    hidden, layers, heads, seq, batch = SIZES[args.size or ("small" if on_gpu else "tiny")]
    preset = dict(zip((*SHAPE_KEYS, "batch"), (hidden, layers, heads, seq, batch)))
    chosen = {key: getattr(args, key) or preset[key] for key in SHAPE_KEYS}
    chosen["batch"] = args.batch or config.get("train_micro_batch_size_per_gpu") or preset["batch"]
    chosen["seed"] = args.seed if args.seed is not None else 0
    return chosen


def step_line(m: dict) -> str:
    line = (f"step {m['step']:5d} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | {m['samples_per_s']:8.2f} samples/s | "
            f"host {m['host_GB']:6.2f} GB")
    if "peak_gpu_GB" in m:
        line += f" | {m['tflops']:7.2f} TFLOP/s | GPU {m['peak_gpu_GB']:6.2f} GB"
    return line


def main(argv: Optional[list[str]] = None) -> dict:
    from stronghold.engine.launch import single_process_env
    single_process_env()  # `python examples/train.py` works without the launcher
    args = parse_args(argv)
    import stronghold
    from stronghold.config import parse_stronghold_section
    from stronghold.engine.flops import transformer_flops_per_token
    from stronghold.engine.launch import load_config
    from stronghold.engine.telemetry import host_rss_gb, matmul_params
    from stronghold.integrations.hf_compat import enable_checkpointing
    from examples.corpus import ByteBatches, corpus_bytes
    from examples.provenance import git_commit

    on_gpu = torch.cuda.is_available()
    save_dir, tag, run_dir, previous = None, None, None, None
    if args.resume is not None:
        save_dir, tag, run_dir = find_checkpoint(args.resume)
        previous = json.loads((run_dir / "config.json").read_text()) if run_dir is not None else None
        if previous is None:
            raise ValueError(f"--resume {args.resume}: its run directory's config.json (the model shape) is missing; "
                             "give the run directory")
        args.grad_checkpointing = args.grad_checkpointing or previous["grad_checkpointing"]
    if args.deepspeed_config is None:
        if previous is None:
            raise SystemExit("pass --deepspeed_config ds_configs/stronghold.json (GPU) or stronghold_cpu.json (CPU)")
        config = previous["deepspeed"]
    else:
        config = load_config(args.deepspeed_config)
    chosen = settings(args, config, on_gpu, previous)
    hidden, layers, heads, seq, batch = (chosen[key] for key in (*SHAPE_KEYS, "batch"))
    config["train_micro_batch_size_per_gpu"] = batch
    config.pop("train_batch_size", None)
    steps = args.steps or (previous["steps"] if previous is not None else 100 if on_gpu else 40)
    out = args.output_dir or run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")

    torch.manual_seed(chosen["seed"])
    model = build_model(hidden, layers, heads, seq)
    if args.grad_checkpointing:
        enable_checkpointing(model)
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = transformer_flops_per_token(*matmul_params(model, model.transformer.h), layers, hidden, seq,
                                                  args.grad_checkpointing)
    args.deepspeed_config = None  # passed as config= below
    engine, _, _, _ = stronghold.initialize(args=args, model=model, config=config)
    rank0 = engine.global_rank == 0
    data = ByteBatches(corpus_bytes(), seq, batch, seed=chosen["seed"])
    if save_dir is not None:
        loaded, client_state = engine.load_checkpoint(save_dir, tag=tag)
        data.generator.set_state(client_state["data_generator"])
        if rank0:
            print(f"resumed from {loaded} at step {engine.global_steps}", flush=True)
    report = engine.stronghold_report()
    gas = engine.gradient_accumulation_steps()
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        section = parse_stronghold_section(config).model_dump()
        section.update({key: report[key] for key in ("window_size", "resident_blocks", "lean_blocks",
                                                     "gpu_accumulation")})
        resolved = {"model": dict(zip(SHAPE_KEYS, (hidden, layers, heads, seq)), vocab=model.config.vocab_size),
                    "batch": batch, "seed": chosen["seed"], "grad_checkpointing": args.grad_checkpointing,
                    "steps": steps, "deepspeed": config, "stronghold_resolved": section}
        (out / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    print(f"model: GPT-2 {hidden}x{layers} ({n_params / 1e6:.1f} M params), seq {seq}, micro-batch {batch}, "
          f"grad accumulation {gas}; window {report['window_size']}, resident blocks {report['resident_blocks']}, "
          f"streamed {report['streamed_blocks']}; device {engine.device}; output {out}", flush=True)

    from tqdm import tqdm
    first = engine.global_steps
    samples_per_step = batch * gas * engine.world_size
    # A bar only on a terminal: in a log file its redraws would interleave with the step lines.
    bar = tqdm(total=steps, initial=first, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout,
               disable=not sys.stdout.isatty() or not rank0)
    history = []
    metrics = (out / "metrics.jsonl").open("a") if rank0 else None
    for step in range(first, steps):
        lr = engine.get_lr()[0]  # this step's: the scheduler moves it on at the step's end
        start = time.perf_counter()
        for _ in range(gas):
            batch_data = {k: v.to(engine.device) for k, v in next(data).items()}
            loss = engine(**batch_data).loss
            engine.backward(loss)
            engine.step()
        loss_value = loss.item()  # synchronizes with the GPU, so the step time below is real
        seconds = time.perf_counter() - start
        m = {"step": step + 1, "loss": loss_value, "lr": lr, "step_s": round(seconds, 4),
             "samples_per_s": round(samples_per_step / seconds, 2),
             "tokens_per_s": round(samples_per_step * seq / seconds, 1), "host_GB": round(host_rss_gb(), 3)}
        if on_gpu:
            # Significant digits, not decimals: a small model's first step (with the blocks' compile) is under 1e-3.
            m["tflops"] = float(f"{m['tokens_per_s'] / engine.world_size * flops_per_token / 1e12:.4g}")
            m["peak_gpu_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        history.append(m)
        if rank0:
            metrics.write(json.dumps(m) + "\n")
            metrics.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
            tqdm.write(step_line(m), file=sys.stdout)
    bar.close()
    if metrics is not None:
        metrics.close()
    if history and not args.no_checkpoint:
        engine.save_checkpoint(out / CHECKPOINT_DIR, client_state={"data_generator": data.generator.get_state()})
    summary = summarize(history, engine, config, hidden, layers, n_params, seq, batch, steps, on_gpu, git_commit)
    if rank0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print("summary: " + json.dumps(summary), flush=True)
        if args.json is not None:
            with args.json.open("a") as f:
                f.write(json.dumps(summary) + "\n")
    engine.destroy()
    return summary


def summarize(history, engine, config, hidden, layers, n_params, seq, batch, steps, on_gpu, git_commit) -> dict:
    timed = history[min(2, len(history) - 1):]
    return {"model": f"gpt2-{hidden}x{layers}", "params": n_params, "seq": seq, "batch": batch, "steps": steps,
            "first_loss": history[0]["loss"] if history else None,
            "last_loss": history[-1]["loss"] if history else None,
            "tokens_per_s": sum(h["tokens_per_s"] for h in timed) / len(timed) if timed else None,
            "peak_gpu_GB": max((h.get("peak_gpu_GB", 0.0) for h in history), default=0.0),
            "peak_host_GB": max((h["host_GB"] for h in history), default=0.0),
            "device": torch.cuda.get_device_name() if on_gpu else f"cpu ({os.cpu_count()} cores)",
            # The measured code: $STRONGHOLD_COMMIT where the tree has no .git (the GPU machine's copy).
            "commit": git_commit() or "unknown", "config": config,
            "stronghold": engine.stronghold_report()}


if __name__ == "__main__":
    main()
    # A process group left to the interpreter's exit can abort it (SIGABRT, "terminate called without an active
    # exception": gloo's threads still hold work as the interpreter goes away): end it first.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
