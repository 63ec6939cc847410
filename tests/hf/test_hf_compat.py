"""hf_compat: activation checkpointing through whichever method the installed transformers names (this file runs in the
main suite on the pinned transformers and again on the newest, scripts/test_newest.sh)."""
import warnings

import torch

from stronghold.integrations.hf_compat import enable_checkpointing, is_checkpointing
from tests.engine.helpers import batches, tiny_llama


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointing_turns_on_without_deprecation_and_keeps_the_gradients():
    model = tiny_llama(2)
    model.train()
    batch = batches(1)[0]
    plain = _grads(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.24 deprecates the gradient_checkpointing names
        assert not is_checkpointing(model)
        enable_checkpointing(model, use_reentrant=False)
        assert is_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    # The recompute runs the same CPU kernels on the same inputs: the same gradients, bit for bit.
    checkpointed = _grads(model, batch)
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)
    assert not is_checkpointing(torch.nn.Linear(2, 2))
