"""offload_activations "auto" (long_context.py): the long-sequence decision at the first training forward.

On a GPU the engine installs the decision maker with the placement's budget; here (CPU, no placement) the
tests install it by hand with a chosen budget, which is the only GPU-specific input. Training with what it
enables must match torch AdamW at the bar of test_equivalence.py (1e-5 whole-model relative).
"""
import copy

import pytest
import torch

import stronghold
from stronghold.memory.long_context import (AUTO_OFFLOAD_SHARE, FUSED_HEAD_SHARE, LongContextAuto, batch_tokens,
                                           has_large_logits, hidden_size, is_long_context, vocab_size)

from .helpers import (SEQ, BATCH, VOCAB, batches, ds_config, relative_error, run_steps, tiny_gpt2, tiny_llama,
                      train_reference)

pytestmark = pytest.mark.newest  # the HF models' own code: run on the newest transformers too

LR = 3e-3


def test_the_threshold_is_a_share_of_the_gpu_budget():
    gib = 2 ** 30
    # Llama h2560, 32 blocks, bf16, 32 GiB cap: 160 KiB of block inputs a token. Measured without offload:
    # 57344 tokens trained, 65536 did not; with it, +1% step time at 16384 (H100, 32 GiB cap).
    per_token = 32 * 2560 * 2
    limit = int(AUTO_OFFLOAD_SHARE * 32 * gib) // per_token
    assert not is_long_context(32, limit, 2560, 2, 32 * gib)
    assert is_long_context(32, limit + 1, 2560, 2, 32 * gib)
    assert 16384 < limit < 57344


def test_the_fused_head_threshold_is_a_share_of_the_gpu_budget():
    gib = 2 ** 30
    # bf16 logits and their fp32 copy, 6 bytes a token a vocabulary entry. Llama h2560 GA 8 at 32 GiB (H100):
    # with 128256 entries (2 x 2048 tokens: 9% of the cap) the fused head ran 1.12x; 32000 and GPT-2's 50304
    # (4 x 1024 tokens, 2-4%) made no difference.
    assert has_large_logits(2 * 2048, 128256, 2, 32 * gib)
    assert not has_large_logits(2 * 2048, 32000, 2, 32 * gib)
    assert not has_large_logits(4 * 1024, 50304, 2, 32 * gib)
    edge = int(FUSED_HEAD_SHARE * 32 * gib) // 6
    assert not has_large_logits(edge, 1, 2, 32 * gib) and has_large_logits(edge + 1, 1, 2, 32 * gib)
    assert vocab_size(tiny_llama(1)) == tiny_llama(1).config.vocab_size and vocab_size(torch.nn.Linear(2, 2)) is None


def test_tokens_and_hidden_size_from_the_batch_and_the_model():
    ids = torch.zeros(2, 40, dtype=torch.long)
    assert batch_tokens((), {"input_ids": ids}) == 80 and batch_tokens((ids,), {}) == 80
    assert batch_tokens((), {"inputs_embeds": torch.zeros(3, 5, 8)}) == 15
    assert batch_tokens((), {"labels": torch.zeros(4)}) is None
    assert hidden_size(tiny_gpt2(1)) == 32 and hidden_size(tiny_llama(1)) == 32 and hidden_size(torch.nn.Linear(2, 2)) is None


def _engine(model, budget_bytes: int, **section):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model).train(),
                                            config=ds_config(window=2, resident=1, lr=LR, gas=2, clip=0.1, **section))
    runtime = engine.stronghold_runtime
    runtime.long_context = LongContextAuto(runtime, budget_bytes)
    return engine, runtime


def test_a_long_batch_offloads_and_chunks_and_trains_like_adamw():
    model, data = tiny_llama(4), batches(4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference, _ = train_reference(model, data, lr=LR, gas=2, clip=0.1)
    inputs_bytes = 4 * BATCH * SEQ * 32 * 4  # 4 blocks x tokens x hidden x fp32
    engine, runtime = _engine(model, budget_bytes=int(inputs_bytes / AUTO_OFFLOAD_SHARE) - 1)
    assert runtime.activations is None and runtime.mlp_chunks is None
    run_steps(engine, data)
    decision = engine.stronghold_report()["long_context"]
    assert decision["long_context"] and decision["tokens"] == BATCH * SEQ and decision["block_inputs_bytes"] == inputs_bytes
    assert runtime.activations is not None and engine.stronghold_report()["activations"]["blocks"] == [0, 1, 2]
    assert runtime.mlp_chunks is not None
    assert relative_error(engine.module, reference) <= 1e-5


def test_a_short_batch_installs_nothing_and_the_user_settings_win():
    model, data = tiny_llama(4), batches(2)
    inputs_bytes = 4 * BATCH * SEQ * 32 * 4
    engine, runtime = _engine(model, budget_bytes=int(inputs_bytes / AUTO_OFFLOAD_SHARE))
    run_steps(engine, data)
    assert not engine.stronghold_report()["long_context"]["long_context"]
    assert runtime.activations is None and runtime.mlp_chunks is None
    # A long batch with chunking turned off: offload only.
    engine, runtime = _engine(model, budget_bytes=1, mlp_chunk_tokens=False)
    run_steps(engine, data)
    assert runtime.activations is not None and runtime.mlp_chunks is None


def test_only_the_first_training_forward_decides():
    model = tiny_llama(2)
    engine, runtime = _engine(model, budget_bytes=1)
    with torch.no_grad():
        engine(**batches(1)[0])  # an evaluation forward first: not the decision
    assert runtime.long_context.pending and runtime.activations is None
    run_steps(engine, batches(2))
    assert not runtime.long_context.pending and runtime.activations is not None


class _KernelsOnCpu(LongContextAuto):
    """The decision maker as on a GPU: the Triton kernels run here under Triton's interpreter."""

    def kernels_here(self) -> bool:
        return True


def _head_engine(model, budget_bytes: int):
    engine, runtime = _engine(model, budget_bytes, kernels="auto")  # auto: no kernel at construction off a GPU
    runtime.long_context = _KernelsOnCpu(runtime, budget_bytes)
    return engine, runtime


def test_a_longer_micro_batch_with_large_logits_gets_the_fused_head_and_trains_like_adamw():
    # The first step's micro-batches have half the sequence (a collator padding each batch to its own longest), the
    # second step's the whole: the budget puts the short ones' fp32 logits (8 bytes a token a vocabulary entry on the
    # CPU: fp32 and the loss's fp32 copy) at the threshold and the long ones over it.
    model = tiny_llama(4)
    short, long = BATCH * SEQ // 2, BATCH * SEQ
    budget = int(short * VOCAB * 8 / FUSED_HEAD_SHARE)
    assert not has_large_logits(short, VOCAB, 4, budget) and has_large_logits(long, VOCAB, 4, budget)
    data = [{key: value[:, :SEQ // 2] for key, value in batch.items()} for batch in batches(2)] + batches(2, seed=2)
    reference, _ = train_reference(model, data, lr=LR, gas=2, clip=0.1)
    engine, runtime = _head_engine(model, budget)
    run_steps(engine, data[:2])
    assert "fused_head" not in engine.stronghold_report()["long_context"]
    run_steps(engine, data[2:])
    decision = engine.stronghold_report()["long_context"]
    assert decision["fused_head"] == ["fused_linear_cross_entropy"] and decision["fused_head_tokens"] == long
    assert decision["tokens"] == short and not decision["long_context"]
    assert relative_error(engine.module, reference) <= 1e-5


def test_micro_batches_no_longer_than_the_first_keep_the_head():
    model = tiny_llama(2)
    engine, runtime = _head_engine(model, int(BATCH * SEQ * VOCAB * 8 / FUSED_HEAD_SHARE))
    run_steps(engine, batches(2) + [{key: value[:, :SEQ // 2] for key, value in batch.items()} for batch in batches(2)])
    decision = engine.stronghold_report()["long_context"]
    assert "fused_head" not in decision and runtime.long_context.judged_tokens == BATCH * SEQ
