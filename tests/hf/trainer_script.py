"""A plain HF Trainer script, as a user launches it under torchrun / accelerate launch: `--one-line` adds
`stronghold.initialize(model)`. Rank 0 saves the trained parameters and the logged losses and norms to `--out`.

Tiny Llama, fp32 on the CPU (gloo), per-device batch 2, accumulation 2, clipping that triggers, linear warmup.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` and `stronghold` of this checkout

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--one-line", action="store_true")
    parser.add_argument("--rest-on-host", action="store_true",
                        help="the one line with the embeddings' and head's states on the host (\"rest_placement\")")
    args = parser.parse_args()
    torch.set_num_threads(1)  # several ranks on a small machine
    from transformers import Trainer

    from tests.engine.helpers import tiny_llama
    from tests.hf.helpers import FAST, TokenDataset, training_args

    model = tiny_llama(4)
    if args.one_line:
        import stronghold
        rest = {"rest_placement": "host"} if args.rest_on_host else {}
        stronghold.initialize(model, config={**FAST, "window_size": 2, "resident_blocks": 1, **rest})
    # use_cpu: accelerate's data parallel on the CPU (without it every rank trains alone); the one line accepts it there.
    arguments = training_args(args.out, per_device_train_batch_size=2, max_steps=3, use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=arguments,
                      train_dataset=TokenDataset(32))
    trainer.train()
    state = trainer.model.state_dict()  # the fp32 masters with stronghold (its state_dict hooks)
    report = trainer.model_wrapped.stronghold_report() if args.one_line else {}
    torch.save({"cores": sorted(os.sched_getaffinity(0)), "report_cores": report.get("cores"),
                "cached_parts": report.get("cached_parts")},
               Path(args.out) / f"rank{trainer.args.process_index}.pt")
    if trainer.args.process_index == 0:
        logs = {key: [e[key] for e in trainer.state.log_history if key in e] for key in ("loss", "grad_norm")}
        torch.save({"params": {k: v.detach().cpu().clone() for k, v in state.items()}, "logs": logs,
                    "world_size": trainer.args.world_size,
                    "engine": type(trainer.model_wrapped).__name__}, Path(args.out) / "result.pt")
    # Left to the interpreter's exit, gloo's threads can abort a rank (SIGABRT, "terminate called without an active
    # exception"), more often on a loaded machine: a script ends its process group first.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
