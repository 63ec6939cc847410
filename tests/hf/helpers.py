"""Trainer runs for the HF tests: the same script with and without the one line `stronghold.initialize(model)`."""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

import stronghold
from tests.engine.helpers import batches

LR = 3e-3
# stronghold_ops kernels off unless a test asks: under TRITON_INTERPRET they are slow, and tests/ops covers
# them (test_one_line_matches_plain_trainer runs the one line on a model patched with them).
FAST = {"kernels": False}


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM samples (input_ids, labels) from the engine tests' random batches."""

    def __init__(self, n: int, seed: int = 1):
        rows = batches(n, seed=seed, batch=1)
        self.items = [{"input_ids": b["input_ids"][0], "labels": b["labels"][0]} for b in rows]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def training_args(output_dir, **overrides):
    from transformers import TrainingArguments
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=4, learning_rate=LR, weight_decay=0.1, max_grad_norm=0.05, lr_scheduler_type="linear",
                    warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


def run_trainer(model, output_dir, *, one_line: bool, config: Any = None, train: bool = True,
                resume: Optional[str] = None, eval_dataset=None, kernels: bool = False, **overrides):
    """A standard Trainer script on a copy of `model`; `one_line` adds `stronghold.initialize(model)`.
    `kernels` patches the copy with stronghold_ops first (what the engine's "kernels" key does on a GPU)."""
    from transformers import Trainer
    model = copy.deepcopy(model)
    if kernels:
        import stronghold_ops
        stronghold_ops.apply(model, strict=True)
    if one_line:
        stronghold.initialize(model, config={**FAST, **(config or {})})
    trainer = Trainer(model=model, args=training_args(output_dir, **overrides), train_dataset=TokenDataset(64),
                      eval_dataset=eval_dataset)
    if train:
        trainer.train(resume_from_checkpoint=resume)
        if one_line:
            trainer.model_wrapped.synchronize_host()
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]
