"""Trainer's accumulation windows handed to the engine: Trainer fetches each window's batches before its micro-steps
(`get_batch_samples`), and the engine can run their blocks ahead (engine/block_major.py, "block_major_forward")."""
from __future__ import annotations

import functools
import weakref


def hand_over_window_batches(trainer) -> None:
    """Trainer fetches each accumulation window's batches before its micro-steps (`get_batch_samples`): they go to the
    engine too (`window_batches`), which runs the blocks for all of them block by block where "block_major_forward"
    is on (engine/block_major.py). Set on the instance: the class and other Trainers are untouched."""
    original, owner = trainer.get_batch_samples, weakref.ref(trainer)

    @functools.wraps(original)
    def get_batch_samples(*args, **kwargs):
        batch_samples, *rest = original(*args, **kwargs)
        held = owner()
        engine = getattr(held, "model_wrapped", None) if held is not None else None
        if (hasattr(engine, "window_batches") and all(isinstance(batch, dict) for batch in batch_samples)
                and len(batch_samples) <= engine.gradient_accumulation_steps()):
            engine.window_batches(list(batch_samples))
        return (batch_samples, *rest)

    trainer.get_batch_samples = get_batch_samples
