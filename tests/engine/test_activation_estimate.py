"""The first forward's activation estimate (planning/activation_estimate.py) is an upper bound of what a checkpointed
decoder keeps: measured by the bytes autograd saves in its forward, with checkpointing (the blocks' inputs and the
loss) and without it (every block's working set), on a tiny Llama on the CPU."""
import torch

from stronghold.integrations.hf_compat import enable_checkpointing
from stronghold.planning import activation_estimate as ae

from .helpers import batches, tiny_llama


def _saved_bytes(model, batch) -> int:
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss
    return sum(sizes)


def test_estimate_bounds_a_checkpointed_llamas_saved_activations():
    model, batch = tiny_llama(4), batches(1)[0]
    model.train()
    tokens = batch["input_ids"].numel()
    assert ae.checkpointed_decoder_activations(model, tokens, 4) is None  # no checkpointing: no estimate
    without = _saved_bytes(model, batch)
    enable_checkpointing(model)
    estimate = ae.checkpointed_decoder_activations(model, tokens, 4)
    with_checkpointing = _saved_bytes(model, batch)
    total = estimate.fixed_peak_bytes + 4 * estimate.per_block_bytes
    assert 0 < with_checkpointing <= total
    # Without checkpointing every block keeps what one block's recompute holds: the four blocks' working sets
    # (each within the estimate's block part) and the loss bound it too.
    cfg = model.config
    per_hidden, per_mlp = ae.BLOCK_WORKING_SET
    block = tokens * (per_hidden * cfg.hidden_size + per_mlp * cfg.intermediate_size) * 4
    scaled, fp32 = ae.LOSS_BYTES_PER_LOGIT
    loss = tokens * cfg.vocab_size * (scaled * 4 + fp32)
    assert without <= 4 * block + loss
    assert ae.checkpointed_decoder_activations(model, None, 4) is None
