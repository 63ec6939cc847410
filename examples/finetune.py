"""Fine-tune a local HuggingFace causal-LM checkpoint: a plain Trainer script plus the one stronghold line.

    python examples/finetune.py --model path/to/checkpoint --data notes.txt --steps 200 --bf16
    python examples/finetune.py --model path/to/checkpoint --data docs.jsonl --output-dir runs/ft --save-steps 50
    python examples/finetune.py --model path/to/checkpoint --data docs.jsonl --output-dir runs/ft --resume
    python examples/finetune.py ... --no-stronghold        # the same script without the line, for comparison

--model is a directory written by `save_pretrained` (safetensors) or the name of a model already in the local
HuggingFace cache: nothing is downloaded. --data is plain text (the whole file is one document) or JSON Lines
(`.jsonl`: one object with a "text" field per line). The tokenizer is the checkpoint's own; where the checkpoint
has none, the tokens are the UTF-8 bytes (the model's vocabulary must have at least 256 entries). The documents
are joined, each ended by the tokenizer's end-of-sequence token (with bytes, a newline), and cut into windows of
--seq tokens; the labels are the inputs (the model shifts them).

Trainer writes its checkpoints to --output-dir/checkpoint-<step> every --save-steps steps and at the end;
the same command with --resume continues from the newest of them, exactly where it stopped (a larger --steps
extends the run, and Trainer's cosine schedule with it). The trained model goes to
--output-dir/final, which `from_pretrained` loads. Without a GPU it runs on the CPU, in fp32.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback,
                          TrainingArguments, default_data_collator)
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stronghold  # noqa: E402
from examples.corpus import VOCAB as BYTE_VOCAB  # noqa: E402
from examples.hf_trainer import ByteWindows  # noqa: E402
from stronghold.engine.launch import apply_gpu_memory_limit, default_accelerator  # noqa: E402

# What a tokenizer's `save_pretrained` writes; a checkpoint directory without either has no tokenizer.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


class TokenWindows(ByteWindows):
    """ByteWindows over token ids: consecutive, non-overlapping windows of `seq` tokens."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        self.windows = tokens[:len(tokens) // seq * seq].view(-1, seq)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="PATH_OR_NAME",
                        help="a save_pretrained directory, or a model name already in the local HuggingFace cache")
    parser.add_argument("--data", required=True, type=Path, metavar="FILE",
                        help='plain text, or JSON Lines (.jsonl) with a "text" field on every line')
    parser.add_argument("--output-dir", type=Path,
                        help="checkpoints and final/ (default runs/finetune-<timestamp>; with --resume, required)")
    parser.add_argument("--steps", type=int, default=100,
                        help="optimizer steps in all, a resumed run's included (default 100)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per training window (default 512)")
    parser.add_argument("--batch", type=int, default=4, help="windows per micro-batch (per device; default 4)")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--lr", type=float, default=2e-5,
                        help="peak learning rate, cosine decay after warm-up (default 2e-5)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 compute (GPU only); with stronghold the checkpoint is also loaded in bf16")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each block's activations in backward: less memory, about 1/3 more compute")
    parser.add_argument("--save-steps", type=int, default=100, help="a Trainer checkpoint every N steps (default 100)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint-<step> in --output-dir")
    parser.add_argument("--gpu-memory-limit-gb", type=float, help="cap this process's GPU memory (both modes)")
    parser.add_argument("--no-stronghold", action="store_true", help="plain Trainer: leave out the one line")
    parser.add_argument("--seed", type=int, default=0, help="data order and Trainer's random state (default 0)")
    opts = parser.parse_args(argv)
    for name in ("steps", "seq", "batch", "accumulation", "save_steps"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(opts, name)} must be >= 1")
    if opts.lr <= 0:
        parser.error(f"--lr={opts.lr} must be > 0")
    return opts


def model_directory(name: str) -> Path:
    """The checkpoint directory for --model: the path itself, or the cached snapshot of a model name."""
    path = Path(name).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download
        try:
            path = Path(snapshot_download(name, local_files_only=True))
        except (OSError, ValueError):  # not cached, or not a valid model name
            raise ValueError(f"--model {name}: no such directory, and no model of that name in the local HuggingFace "
                             "cache (nothing is downloaded); give a directory written by save_pretrained") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name}: {path} has no config.json; give a directory written by save_pretrained")
    return path


def read_json_lines(path: Path) -> list[str]:
    """The "text" field of every non-blank line of a JSON Lines file."""
    documents = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--data {path} line {number}: not JSON ({err.msg}); every line must be an object "
                                 'like {"text": "..."}') from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'--data {path} line {number}: no "text" field holding a string; every line must '
                                 'be an object like {"text": "..."}')
            documents.append(record["text"])
    return documents


def read_documents(path: Path) -> list[str]:
    """The documents of --data: the whole file as one, or for .jsonl one a line."""
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file; give a text file or a .jsonl file with a \"text\" field")
    documents = read_json_lines(path) if path.suffix == ".jsonl" else [path.read_text(encoding="utf-8")]
    if not any(document.strip() for document in documents):
        raise ValueError(f"--data {path}: no text in it; give a file with text (for .jsonl, lines with a \"text\" "
                         "field)")
    return documents


def tokenize(documents: list[str], tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """The documents' tokens, one after the other; the UTF-8 bytes where there is no tokenizer."""
    if tokenizer is None:
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"the checkpoint has no tokenizer, and its vocabulary ({vocab_size}) is too small for "
                             f"byte tokens ({BYTE_VOCAB}); save the model's tokenizer into the checkpoint directory")
        data = "\n".join(documents).encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    # The end-of-sequence token between documents, so that the model learns where one ends.
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids = [i for document in documents for i in tokenizer(document, verbose=False)["input_ids"] + end]
    tokens = torch.tensor(ids, dtype=torch.long)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ValueError(f"the tokenizer makes token {int(tokens.max())}, beyond the model's vocabulary "
                         f"({vocab_size}); the checkpoint's tokenizer and model do not belong together")
    return tokens


def dataset(opts: argparse.Namespace, model_dir: Path, config: Any) -> tuple[torch.utils.data.Dataset, Any]:
    """(the training windows, the tokenizer or None for bytes)."""
    tokenizer = None
    if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokens = tokenize(read_documents(opts.data), tokenizer, config.vocab_size)
    if len(tokens) < opts.seq:
        raise ValueError(f"--data {opts.data}: {len(tokens)} tokens, fewer than one window of --seq {opts.seq}; "
                         "give more text or a smaller --seq")
    return TokenWindows(tokens, opts.seq), tokenizer


def checkpoint_to_resume(opts: argparse.Namespace, out: Path) -> Optional[str]:
    """The newest checkpoint-<step> in `out` for --resume (None without it). A fresh run refuses a directory that
    holds checkpoints already: they would mix with its own, and --resume would pick the wrong one."""
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    if opts.resume and last is None:
        raise ValueError(f"--resume: no checkpoint-<step> directory in {out}; give the --output-dir of a run that "
                         "saved one, or leave --resume out to start a new run")
    if not opts.resume and last is not None:
        raise ValueError(f"--output-dir {out} already holds {Path(last).name}; add --resume to continue that run, "
                         "or give another --output-dir")
    return last


def main(argv: Optional[Sequence[str]] = None, callbacks: Sequence[TrainerCallback] = ()) -> Path:
    """Fine-tune as the flags say; returns the directory of the saved model. `callbacks`: extra TrainerCallbacks."""
    # DeepSpeed's CPU accelerator where there is no GPU, set before anything imports DeepSpeed (accelerate does,
    # for the plain Trainer too); the one line sets up the rest of a launcher-less process itself.
    default_accelerator()
    opts = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if opts.bf16 and not on_gpu:
        raise ValueError("--bf16 needs a GPU (Trainer refuses bf16 on the CPU); leave it out to train in fp32")
    if opts.resume and opts.output_dir is None:
        raise ValueError("--resume continues the run in --output-dir: give that directory")
    out = opts.output_dir or Path("runs") / time.strftime("finetune-%Y%m%d-%H%M%S")
    resume = checkpoint_to_resume(opts, out)
    # Everything that can fail on the flags or the data fails here, before the (large) model is loaded.
    model_dir = model_directory(opts.model)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and opts.seq > positions:
        raise ValueError(f"--seq {opts.seq} is longer than the model's {positions} positions; pass --seq {positions} "
                         "or less")
    train_data, tokenizer = dataset(opts, model_dir, config)

    # A bf16 checkpoint loads as it is stored: no fp32 copy of the whole model is made in host memory, since the
    # engine makes its fp32 masters block by block. The plain Trainer keeps fp32 weights (its bf16 is autocast),
    # so that both train with fp32 masters. transformers 5 names the argument `dtype` (`torch_dtype` is its old
    # alias) in every release stronghold supports.
    dtype = torch.bfloat16 if opts.bf16 and not opts.no_stronghold else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {model_dir} ({n_params / 1e6:.1f} M parameters, {dtype}); data {opts.data}: {len(train_data)} "
          f"windows of {opts.seq} {'tokens' if tokenizer is not None else 'bytes'}; output {out}", flush=True)

    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.accumulation,
        max_steps=opts.steps, learning_rate=opts.lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, opts.steps // 20), max_grad_norm=1.0, bf16=opts.bf16,
        gradient_checkpointing=opts.gradient_checkpointing, logging_steps=10, save_strategy="steps",
        # A checkpoint holds the fp32 weights and both AdamW moments (12 bytes a parameter and more): keep two.
        save_steps=opts.save_steps, save_total_limit=2, report_to=[], seed=opts.seed,
        dataloader_pin_memory=on_gpu)  # pinning needs a GPU (torch warns on the CPU)
    if opts.no_stronghold:
        if on_gpu:
            apply_gpu_memory_limit(opts.gpu_memory_limit_gb, torch.device("cuda", torch.cuda.current_device()))
    else:
        limit = {} if opts.gpu_memory_limit_gb is None else {"gpu_memory_limit_gb": opts.gpu_memory_limit_gb}
        stronghold.initialize(model, config=limit)  # the one line
    # The windows are all --seq long: stacked as they are (with a tokenizer, Trainer's default collator would pad).
    trainer = Trainer(model=model, args=args, train_dataset=train_data, data_collator=default_data_collator,
                      processing_class=tokenizer, callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    # With the line, the model's state_dict waits for the CPU optimizer and holds the fp32 masters, so this writes
    # the trained weights; the tokenizer (processing_class) is saved beside them.
    final = out / "final"
    trainer.save_model(str(final))
    print(f"saved the fine-tuned model to {final} (load it with from_pretrained)", flush=True)
    return final


if __name__ == "__main__":
    main()
    # A process group left to the interpreter's exit can abort it (SIGABRT, "terminate called without an active
    # exception": gloo's threads still hold work as the interpreter goes away): end it first.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
