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


def test_with_the_fused_head_the_loss_part_bounds_what_the_fused_loss_holds():
    """With stronghold_ops' fused linear + cross-entropy installed (as the engine does for large logits), the loss part
    is one chunk of logits and the gradients the fused function holds from its forward to its backward, not every
    token's logits."""
    import stronghold_ops
    from stronghold_ops.linear_cross_entropy import LinearCrossEntropyFunction, default_chunk_tokens, shifted_targets

    model, batch = tiny_llama(4), batches(1)[0]
    enable_checkpointing(model)
    tokens, cfg = batch["input_ids"].numel(), model.config
    logits = ae.loss_bytes(model, tokens, cfg.vocab_size, cfg.hidden_size, 4)
    assert logits == tokens * cfg.vocab_size * sum(f * b for f, b in zip(ae.LOSS_BYTES_PER_LOGIT, (4, 1)))
    plain = ae.checkpointed_decoder_activations(model, tokens, 4)
    stronghold_ops.apply(model, kernels=["fused_linear_cross_entropy"])
    fused = ae.checkpointed_decoder_activations(model, tokens, 4)
    chunk = min(tokens, default_chunk_tokens(cfg.vocab_size, 4))  # the size the patched forward runs with
    torch.manual_seed(0)
    hidden = torch.randn(tokens, cfg.hidden_size, requires_grad=True)
    targets = shifted_targets(batch["labels"]).reshape(-1)
    loss = LinearCrossEntropyFunction.apply(hidden, model.lm_head.weight, targets, torch.tensor(1.0 / tokens), -100,
                                            chunk)
    held = sum(t.numel() * t.element_size() for t in loss.grad_fn.grads) + 4 * tokens  # and the fp32 losses
    assert held + chunk * cfg.vocab_size * 4 <= ae.loss_bytes(model, tokens, cfg.vocab_size, cfg.hidden_size, 4)
    per_hidden, per_mlp = ae.BLOCK_WORKING_SET
    block = tokens * (per_hidden * cfg.hidden_size + per_mlp * cfg.intermediate_size) * 4
    fused_loss = ae.loss_bytes(model, tokens, cfg.vocab_size, cfg.hidden_size, 4)
    # Without the fused head the returned logits may outlive the loss, beside a block's recompute; with it, none exist.
    assert plain.fixed_peak_bytes == int(ae.FRAGMENTATION * max(logits, block + tokens * cfg.vocab_size * 4))
    assert fused.fixed_peak_bytes == int(ae.FRAGMENTATION * max(fused_loss, block))
    assert fused.per_block_bytes == plain.per_block_bytes



def test_the_loss_and_a_recompute_never_hold_their_tensors_at_once():
    """The estimate's fixed part is the larger of the loss's and a block's working set, not their sum: with
    checkpointing, every activation saved outside the blocks (the final norm's, the head's, the loss's) is freed
    before the first recompute runs, except the logits the caller holds (the model's returned output): beside a
    recompute stay only the blocks' inputs (the estimate's per-block part) and the embedding's token ids."""
    import weakref

    model, batch = tiny_llama(4), batches(1)[0]
    model.train()
    enable_checkpointing(model)
    params = {p.data_ptr() for p in model.parameters()}
    saved: list[tuple[weakref.ref, int]] = []
    beside_recompute: list[int] = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append((weakref.ref(t), t.numel() * t.element_size()))
        return t

    def held(exclude: int) -> int:
        return sum(n for ref, n in saved if ref() is not None and ref().untyped_storage().data_ptr() != exclude)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(**batch)
    logits = output.logits.untyped_storage().data_ptr()
    tokens, layers = batch["input_ids"].numel(), len(model.model.layers)
    inputs = layers * tokens * model.config.hidden_size * 4 + tokens * batch["input_ids"].element_size()
    assert held(logits) > inputs  # the loss saved tensors of its own: what the estimate's loss part bounds
    hooks = [block.register_forward_pre_hook(lambda module, args: beside_recompute.append(held(logits)))
             for block in model.model.layers]
    output.loss.backward()
    for hook in hooks:
        hook.remove()
    assert len(beside_recompute) == layers  # each block recomputed once
    assert max(beside_recompute) <= inputs
