"""The input table's gradient as the rows of the window's tokens in the blockwise walk (embedding_rows.py).

Each micro-batch's rows come from the embedding's own backward kernel over the window's distinct tokens, summed in fp32
in micro-batch order, so without clipping the masters end bit-identical to the whole-table sum and to host
accumulation. With clipping the norm is reduced over the rows, not the whole table: rounding-level, 1e-6.
"""
import dataclasses
import logging

import pytest
import torch

from stronghold.integrations import discovery

from .helpers import (SEQ, batches, engine_for, named_params, relative_error, run_steps, tiny_gpt2, tiny_llama,
                      train_reference)

LR = 3e-3


def _wide_llama(vocab: int = 1000) -> torch.nn.Module:
    """A tiny Llama whose vocabulary is far larger than the tokens of a window (the data's ids are below 96)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                        max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0))


def _train(model, data, monkeypatch=None, whole_table=False, **cfg):
    """(the parameters after training, the report's embedding_rows)."""
    if whole_table:
        monkeypatch.setattr(discovery, "row_table", lambda *args: None)
    engine = engine_for(model, lr=LR, gas=4, **{"rest_placement": "host", **cfg})
    run_steps(engine, data)
    report = engine.stronghold_report()["embedding_rows"]
    params = named_params(engine.module)
    engine.destroy()
    if whole_table:
        monkeypatch.undo()
    return params, report


def _equal(a: dict, b: dict) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("bf16", [False, True])
def test_the_rows_alone_end_bit_identical_to_the_whole_table_and_to_host_accumulation(bf16, monkeypatch):
    """Without clipping; the padding token (0) is among the data's, its row's gradient zero as the kernel makes it."""
    model, data = _wide_llama(), batches(8)
    assert any((b["input_ids"] == 0).any() for b in data)
    rows, report = _train(model, data, blockwise_backward=True, bf16=bf16)
    whole, whole_report = _train(model, data, monkeypatch, whole_table=True, blockwise_backward=True, bf16=bf16)
    host, _ = _train(model, data, blockwise_backward=False, bf16=bf16)
    assert report["walks"] == 2 and report["whole_table_walks"] == 0
    assert 0 < report["last_rows"] <= 96 < 1000  # the window's distinct tokens, not the vocabulary
    assert whole_report is None
    _equal(rows, whole)
    _equal(rows, host)


def test_with_clipping_matches_pytorch():
    model, data = _wide_llama(), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=4, clip=0.05)
    rows, report = _train(model, data, blockwise_backward=True, clip=0.05)
    assert report["walks"] == 2
    assert relative_error(rows, dict(reference.named_parameters())) <= 1e-5


def test_a_scale_between_the_table_and_the_first_block_takes_the_gradient_at_the_tables_output(monkeypatch):
    """As Gemma scales its embeddings: the graph has an op between, no other parameter."""
    model, data = _wide_llama(), batches(8)
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: out * 1.5)
    rows, report = _train(model, data, blockwise_backward=True)
    whole, _ = _train(model, data, monkeypatch, whole_table=True, blockwise_backward=True)
    assert report["walks"] == 2 and report["whole_table_walks"] == 0
    _equal(rows, whole)


class _TimesNorm:
    """A forward hook that multiplies the table's output by the final norm's weight: an object, not a closure, so a
    copy of the model (the engine's, the reference's) multiplies by its own norm."""

    def __init__(self, norm: torch.nn.Module):
        self.norm = norm

    def __call__(self, module, args, out):
        return out * self.norm.weight


def test_another_parameter_on_the_tables_graph_takes_the_whole_table_with_a_warning(caplog):
    model, data = _wide_llama(), batches(8)
    # The output part on the GPU, resident: the norm's gradient from this graph goes into its resident sum.
    model.model.embed_tokens.register_forward_hook(_TimesNorm(model.model.norm))
    reference, _ = train_reference(model, data, lr=LR, gas=4)
    with caplog.at_level(logging.WARNING, logger="stronghold.engine.embedding_rows"):
        params, report = _train(model, data, blockwise_backward=True, rest_placement={"input": "host", "output": "gpu"})
    assert report["walks"] == 0 and report["whole_table_walks"] == 2
    assert "sums its whole gradient" in caplog.text
    assert relative_error(params, dict(reference.named_parameters())) <= 1e-5


def test_only_a_plain_untied_table_is_summed_by_rows():
    llama = tiny_llama(2)
    blocks = list(llama.model.layers)
    table = llama.model.embed_tokens
    assert discovery.row_table(llama, [table.weight], blocks) is table
    assert discovery.row_table(llama, [table.weight, llama.model.norm.weight], blocks) is None
    tied = tiny_llama(2, tie=True)
    assert discovery.row_table(tied, [tied.model.embed_tokens.weight], list(tied.model.layers)) is None
    gpt2 = tiny_gpt2(2, tie=False)
    assert discovery.row_table(gpt2, [gpt2.transformer.wte.weight], list(gpt2.transformer.h)) is gpt2.transformer.wte
    table.max_norm = 1.0
    assert discovery.row_table(llama, [table.weight], blocks) is None


def test_the_walks_estimate_counts_the_windows_rows_alone():
    from stronghold.planning import activation_estimate
    from stronghold.planning.plan_types import FP32_BYTES, Activations, BlockSpec, ModelSpec, PartSpec

    def spec(rows: bool) -> ModelSpec:
        return ModelSpec(blocks=(BlockSpec(numel=120, trainable_numel=110),), rest_numel=1100,
                         rest_trainable_numel=1100, compute_bytes=2, accumulation_steps=8,
                         rest_parts=(PartSpec(name="input", numel=1000, trainable_numel=1000, row_gradients=rows),
                                     PartSpec(name="output", numel=100, trainable_numel=100)))

    checkpointed = Activations(fixed_peak_bytes=1000, per_block_bytes=16)  # 8 elements a micro-batch's block input
    cached = frozenset({"input"})
    whole = activation_estimate.blockwise(checkpointed, spec(False), cached, on_host=False)
    rows = activation_estimate.blockwise(checkpointed, spec(True), cached, on_host=False)
    assert whole.fixed_peak_bytes == 1000 + 1000 * (FP32_BYTES + 2) + 110 * (FP32_BYTES - 2)
    assert rows.fixed_peak_bytes == 1000 + 8 * 8 * (FP32_BYTES + 2) + 110 * (FP32_BYTES - 2)


def test_the_walks_estimate_drops_the_allocator_gap_the_tables_gradient_left():
    """A measured step of host accumulation reserved beside the table's whole gradient while it waited for its D2H
    (Activations.allocator_gap_bytes): the rows walk never makes that gradient, so the gap comes off, at most the
    gradient's compute-dtype bytes; the whole-table walk keeps it."""
    from stronghold.planning import activation_estimate, schedule_choice
    from stronghold.planning.plan_types import Activations, BlockSpec, ModelSpec, PartSpec

    def spec(rows: bool) -> ModelSpec:
        return ModelSpec(blocks=(BlockSpec(numel=120, trainable_numel=110),), rest_numel=1100,
                         rest_trainable_numel=1100, compute_bytes=2, accumulation_steps=8,
                         rest_parts=(PartSpec(name="input", numel=1000, trainable_numel=1000, row_gradients=rows),
                                     PartSpec(name="output", numel=100, trainable_numel=100)))

    cached, table = frozenset({"input"}), 1000 * 2
    for gap, unheld in ((500, 500), (3000, table)):
        measured = Activations(fixed_peak_bytes=5000, per_block_bytes=16, allocator_gap_bytes=gap)
        for on_host in (False, True):
            whole = activation_estimate.blockwise(measured, spec(False), cached, on_host)
            rows = activation_estimate.blockwise(measured, spec(True), cached, on_host)
            plain = activation_estimate.blockwise(dataclasses.replace(measured, allocator_gap_bytes=0), spec(True),
                                                  cached, on_host)
            assert whole.allocator_gap_bytes == gap
            assert (rows.fixed_peak_bytes, rows.allocator_gap_bytes) == (plain.fixed_peak_bytes - unheld, gap - unheld)
        # Through the choice's own conversion of a measured step (the checkpointed inputs come off with on_host).
        through = schedule_choice.blockwise_activations(measured, spec(True), 16, cached, True)
        kept = schedule_choice.blockwise_activations(dataclasses.replace(measured, allocator_gap_bytes=0), spec(True),
                                                     16, cached, True)
        assert through.fixed_peak_bytes == kept.fixed_peak_bytes - unheld


def test_a_table_update_that_step_claims_writes_its_rows_before_reading_them():
    """The CPU worker held (test_claims.Backlog): step() claims the table's update job and reads its sum itself, so
    the rows go into the gradient buffer there (UpdateRecord.unpack); bit-identical to the worker's own run."""
    from .test_claims import Backlog
    model, data = _wide_llama(), batches(8)
    runs = {}
    for held in (True, False):
        engine = engine_for(model, lr=LR, gas=4, bf16=True, rest_placement="host", blockwise_backward=True)
        if held:
            Backlog(engine)
        run_steps(engine, data)
        runs[held] = named_params(engine.module)
        if held:
            assert engine.stronghold_runtime.cpu.stats.claimed_blocks > 0
        engine.destroy()
    _equal(runs[True], runs[False])


class _Switch(_TimesNorm):
    """`_TimesNorm` while `on`."""

    on = False

    def __call__(self, module, args, out):
        return super().__call__(module, args, out) if self.on else out


def test_rows_after_a_whole_table_step_clear_the_whole_buffer(monkeypatch):
    """Step 1 by rows (tokens 0-47), step 2 the whole table (another parameter on the graph; tokens 48-95), step 3 by
    rows (0-47): step 3's rows must clear step 2's whole gradient, not only step 1's rows."""
    model, data = _wide_llama(), batches(12)
    for i, batch in enumerate(data):
        batch["input_ids"] = batch["input_ids"] % 48 + (48 if 4 <= i < 8 else 0)
        batch["labels"] = batch["input_ids"].clone()
    model.model.embed_tokens.register_forward_hook(_Switch(model.model.norm))
    runs = {}
    for whole in (False, True):
        if whole:
            monkeypatch.setattr(discovery, "row_table", lambda *args: None)
        engine = engine_for(model, lr=LR, gas=4, blockwise_backward=True,
                            rest_placement={"input": "host", "output": "gpu"})
        switch = next(iter(engine.module.model.embed_tokens._forward_hooks.values()))
        for step in range(3):
            switch.on = step == 1
            run_steps(engine, data[4 * step:4 * step + 4])
        runs[whole] = named_params(engine.module)
        if not whole:
            report = engine.stronghold_report()["embedding_rows"]
            assert (report["walks"], report["whole_table_walks"]) == (2, 1) and 0 < report["last_rows"] <= 48
        engine.destroy()
    _equal(runs[False], runs[True])


def test_the_table_keeps_no_whole_gradient_buffer_and_its_update_runs_in_pieces(monkeypatch):
    """The table's store has no whole-table gradient buffer: its update reads the landed rows in runs of 7 rows (a
    piece size that divides neither the vocabulary nor the runs between the data's tokens), with clipping too."""
    from stronghold.engine import embedding_rows
    from stronghold.streaming.cached import INDEX_OF

    model, data = _wide_llama(), batches(8)
    whole, _ = _train(model, data, monkeypatch, whole_table=True, blockwise_backward=True, clip=0.05)
    monkeypatch.setattr(embedding_rows, "PIECE_BYTES", 7 * 32 * 4)
    engine = engine_for(model, lr=LR, gas=4, rest_placement="host", blockwise_backward=True, clip=0.05)
    store = engine.stronghold_runtime.cached.units[INDEX_OF["input"]].store
    assert store.grad is None and store.row_grads is not None
    assert store.private_bytes() == 2 * 4 * store.trainable_numel  # the two moments alone beside the working copy
    pieces = []
    monkeypatch.setattr(embedding_rows.EmbeddingRows, "pieces", _counted(embedding_rows.EmbeddingRows.pieces, pieces))
    run_steps(engine, data)
    assert engine.stronghold_report()["embedding_rows"]["whole_table_walks"] == 0
    assert store.grad is None and len(pieces) == 2 * -(-1000 // 7)  # two updates of the whole table, 7 rows a piece
    rows = named_params(engine.module)
    engine.destroy()
    for name in whole:  # the norm over the rows against the whole table's: rounding-level
        assert relative_error({name: rows[name]}, {name: whole[name]}) <= 1e-6, name


def _counted(pieces, seen: list):
    def counting(self, segments):
        for piece in pieces(self, segments):
            seen.append(piece[1])
            yield piece
    return counting
