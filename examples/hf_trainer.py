"""A standard causal-LM HuggingFace Trainer script, plus the one stronghold line.

    python examples/hf_trainer.py                                  # CPU: a tiny GPT-2 on the embedded corpus
    python examples/hf_trainer.py --hidden 2048 --layers 48 --heads 16 --seq 1024 --batch 4 --bf16 \\
        --gradient-checkpointing --gpu-memory-limit-gb 32 --resident 16 --steps 30 --json hf.jsonl
    python examples/hf_trainer.py ... --no-stronghold              # the same script without the line
    python examples/hf_trainer.py --arch llama --hidden 2560 --layers 32 --heads 20 --vocab 32000 ...  # Llama

The data is the embedded byte-level corpus (examples/corpus.py: this repository's own text), cut into
windows of `--seq` bytes. Without `--no-stronghold` the script is an ordinary Trainer script with
`stronghold.initialize(model, ...)` added before the Trainer is built; everything else (optimizer,
scheduler, accumulation, clipping, logging, saving) is Trainer's. `--json` appends one summary line:
steady-state samples/s (past the first `--warmup-steps` optimizer steps; of all ranks together), the set-up time
(process start to the first training step, and its parts), peak GPU and host memory, device and commit. Under
`torchrun --nproc_per_node N` or `accelerate launch` every rank appends its own line (its `rank` and `world_size`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stronghold  # noqa: E402
from examples.corpus import VOCAB, corpus_bytes  # noqa: E402
from examples.llama import check_shape, default_intermediate, llama_config  # noqa: E402
from examples.provenance import git_commit  # noqa: E402
from examples.train import build_model  # noqa: E402
from stronghold.engine.launch import apply_gpu_memory_limit  # noqa: E402
from stronghold.engine.telemetry import peak_host_gb  # noqa: E402


DEFAULT_WARMUP_STEPS = 3


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive, non-overlapping windows of `seq` bytes; labels are the inputs (the model shifts them)."""

    def __init__(self, data: bytes, seq: int):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.windows = tokens[:len(tokens) // seq * seq].view(-1, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (Trainer logs every step, which synchronizes with the GPU),
    and when the first one began: the end of the set-up (for the one-liner, the engine is built
    inside train(), after on_train_begin)."""

    def __init__(self):
        self.ends: list[float] = []
        self.start = None
        self.first_step_begin = None
        self.setup_s = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step_begin is None:
            self.first_step_begin = time.perf_counter()
            self.setup_s = seconds_since_process_start()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (interpreter start-up and imports included)."""
    return time.time() - psutil.Process().create_time()


def check_options(opts: argparse.Namespace) -> None:
    """ValueError naming the fix for flags that do not make a run."""
    for name in ("hidden", "layers", "heads", "seq", "batch", "accumulation", "steps"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name}={getattr(opts, name)} must be >= 1")
    if opts.warmup_steps is not None and not 0 <= opts.warmup_steps < opts.steps:
        raise ValueError(f"--warmup-steps={opts.warmup_steps} must be >= 0 and below --steps={opts.steps}, "
                         "so that at least one step is timed")
    if opts.vocab is not None and opts.vocab < VOCAB:
        raise ValueError(f"--vocab={opts.vocab} is below the byte corpus's {VOCAB} tokens: pass at least {VOCAB}")
    if not isinstance(opts.stronghold_config, dict):
        raise ValueError(f"--stronghold-config {opts.stronghold_config!r} must be a JSON object, e.g. '{{\"compile\": false}}'")
    if opts.lora is not None and opts.lora < 1:
        raise ValueError(f"--lora={opts.lora} must be a rank >= 1")
    if not opts.max_grad_norm >= 0:  # also NaN
        raise ValueError(f"--max-grad-norm={opts.max_grad_norm} must be >= 0 (0: no clipping)")
    if opts.arch in ("llama", "qwen2"):
        check_shape(opts.hidden, opts.heads, opts.kv_heads or opts.heads,
                    opts.intermediate or default_intermediate(opts.hidden))
    elif opts.intermediate is not None or opts.kv_heads is not None:
        raise ValueError("--intermediate and --kv-heads are for --arch llama or qwen2: add one, or drop them")


def build(opts: argparse.Namespace) -> torch.nn.Module:
    """The model as a user would make it: from a config, with HF's own init, fp32 on the CPU."""
    if opts.arch == "gpt2":
        return build_model(opts.hidden, opts.layers, opts.heads, opts.seq, opts.vocab)  # the main job's GPT-2
    config = llama_config(hidden=opts.hidden, layers=opts.layers, heads=opts.heads, seq=opts.seq,
                          vocab=opts.vocab or VOCAB, intermediate=opts.intermediate, kv_heads=opts.kv_heads,
                          qwen2=opts.arch == "qwen2")
    return AutoModelForCausalLM.from_config(config)


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """PEFT's LoRA adapters of rank `rank` on every linear layer but the output head; the rest frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("--lora needs peft: pip install peft") from None
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0))


def stronghold_section(opts: argparse.Namespace) -> dict:
    """The one line's config from the flags: the cap, --window / --resident if given, then --stronghold-config."""
    section = {key: value for key, value in (("window_size", opts.window), ("resident_blocks", opts.resident),
                                             ("gpu_memory_limit_gb", opts.gpu_memory_limit_gb)) if value is not None}
    return {**section, **opts.stronghold_config}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("gpt2", "llama", "qwen2"), default="gpt2",
                        help="model family (default gpt2; qwen2: the Llama block with q/k/v biases)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, help="llama: key/value heads (default: --heads)")
    parser.add_argument("--intermediate", type=int,
                        help="llama: MLP width (default: int(8/3 x hidden) rounded up to a multiple of 256)")
    parser.add_argument("--vocab", type=int, help=f"vocabulary (default {VOCAB}, the byte corpus's)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="first optimizer steps left out of the steady-state samples/s (allocation, warm-up); "
                             "default 3, fewer if --steps leaves no step to time")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="Trainer's gradient clipping threshold (0: no clipping)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--window", type=int, help="stronghold window_size (default: the engine's)")
    parser.add_argument("--resident", type=int, help="stronghold resident_blocks (default: the engine's)")
    parser.add_argument("--gpu-memory-limit-gb", type=float, help="cap this process's GPU memory (both modes)")
    parser.add_argument("--stronghold-config", type=json.loads, default={}, metavar="JSON",
                        help="more keys of the \"stronghold\" section, e.g. '{\"compile\": false}'")
    parser.add_argument("--lora", type=int, metavar="R",
                        help="LoRA of rank R on every linear layer but the head (needs peft); the base stays frozen")
    parser.add_argument("--no-stronghold", action="store_true", help="plain Trainer: leave out the one line")
    parser.add_argument("--output-dir", default="/tmp/stronghold_hf_trainer")
    parser.add_argument("--save-model", action="store_true", help="trainer.save_model() at the end")
    parser.add_argument("--json", type=Path, help="append a JSON summary line to this file")
    opts = parser.parse_args(argv)
    try:
        check_options(opts)
    except ValueError as e:
        parser.error(str(e))
    if opts.warmup_steps is None:
        opts.warmup_steps = min(DEFAULT_WARMUP_STEPS, opts.steps - 1)
    return opts


def main() -> int:
    opts = parse_args()
    startup_s = seconds_since_process_start()
    on_gpu = torch.cuda.is_available()
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build(opts)
    if opts.lora is not None:
        model = with_lora(model, opts.lora)
    build_s = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(
        output_dir=opts.output_dir, per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.accumulation,
        max_steps=opts.steps, learning_rate=opts.lr, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=opts.max_grad_norm,
        lr_scheduler_type="cosine", warmup_steps=max(1, opts.steps // 10), bf16=opts.bf16,
        gradient_checkpointing=opts.gradient_checkpointing, logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, seed=0)

    section = stronghold_section(opts)
    prepare_s = None
    if opts.no_stronghold:
        if on_gpu:
            apply_gpu_memory_limit(opts.gpu_memory_limit_gb, torch.device("cuda", torch.cuda.current_device()))
    else:
        start = time.perf_counter()
        stronghold.initialize(model, config=section)  # the one line
        prepare_s = time.perf_counter() - start

    timer = StepTimer()
    trainer_start = time.perf_counter()
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(corpus_bytes(), opts.seq), callbacks=[timer])
    shape = {"arch": opts.arch, "hidden": opts.hidden, "layers": opts.layers, "heads": opts.heads,
             "vocab": model.config.vocab_size}
    if opts.arch in ("llama", "qwen2"):
        shape.update(intermediate=model.config.intermediate_size, kv_heads=model.config.num_key_value_heads)
    summary = {"script": "examples/hf_trainer.py", "stronghold": not opts.no_stronghold,
               "model": f"{opts.arch}-{opts.hidden}x{opts.layers}", **shape, "params": n_params, "seq": opts.seq,
               "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad), "lora": opts.lora,
               "micro_batch": opts.batch, "accumulation": opts.accumulation, "bf16": opts.bf16,
               "gradient_checkpointing": opts.gradient_checkpointing, "max_grad_norm": opts.max_grad_norm,
               "steps": opts.steps, "config": section,
               "device": torch.cuda.get_device_name() if on_gpu else "cpu", "commit": git_commit(short=True) or "unknown",
               "world_size": trainer.args.world_size, "rank": trainer.args.process_index}
    try:
        metrics = trainer.train().metrics
    except torch.OutOfMemoryError as err:
        summary.update(trained=False, oom=True, error=str(err).splitlines()[0][:300])
        metrics = None
    if timer.first_step_begin is not None:
        # Set-up: process start to the first training step. trainer_setup_s is Trainer() and train()
        # up to that step: moving the model and making AdamW (plain), building the engine (one-liner).
        summary.update(setup_s=round(timer.setup_s, 3),
                       startup_s=round(startup_s, 3), build_s=round(build_s, 3),
                       prepare_s=None if prepare_s is None else round(prepare_s, 3),
                       trainer_setup_s=round(timer.first_step_begin - trainer_start, 3))
    if metrics is not None:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        step_times = [b - a for a, b in zip([timer.start] + timer.ends, timer.ends)]
        timed = step_times[opts.warmup_steps:]  # steady state: past the warm-up
        # An optimizer step is every micro-batch of it, on every data-parallel rank (torchrun, accelerate launch).
        samples_per_step = opts.batch * opts.accumulation * trainer.args.world_size
        samples_per_s = samples_per_step * len(timed) / sum(timed)
        summary.update(trained=True, oom=False, first_loss=losses[0], last_loss=losses[-1],
                       samples_per_s=round(samples_per_s, 6), tokens_per_s=round(samples_per_s * opts.seq, 1),
                       trainer_samples_per_s=metrics["train_samples_per_second"],
                       step_s=round(sum(timed) / len(timed), 3), warmup_steps=opts.warmup_steps,
                       timed_steps=len(timed), step_s_all=[round(t, 6) for t in step_times])
        if not opts.no_stronghold:
            summary["engine"] = trainer.model_wrapped.stronghold_report()
        if opts.save_model:
            trainer.save_model()
    summary.update(peak_gpu_GB=round(torch.cuda.max_memory_allocated() / 1e9, 2) if on_gpu else 0.0,
                   peak_gpu_reserved_GB=round(torch.cuda.max_memory_reserved() / 1e9, 2) if on_gpu else 0.0,
                   peak_host_GB=round(peak_host_gb(), 2))
    print("summary: " + json.dumps(summary, default=str), flush=True)
    if opts.json is not None:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        with opts.json.open("a") as f:
            f.write(json.dumps(summary, default=str) + "\n")
    return 0 if summary["trained"] else 3


if __name__ == "__main__":
    code = main()
    # A process group left to the interpreter's exit can abort it (SIGABRT, "terminate called without an active
    # exception": gloo's threads still hold work as the interpreter goes away): end it first.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)
