"""The cached tier of the parts outside the blocks (streaming/cached.py, "rest_placement"), fp32 on the CPU against
plain PyTorch AdamW: every part in every tier, tied and untied, with gradient accumulation and clipping that triggers.

The model is a tiny Llama whose vocabulary is large for its width (1024 x 16: the embeddings and the head are 78% of
it, as a 128k vocabulary is a large share of an 8 B model), so the parts outside the blocks carry most of the global
gradient norm. Bar: 1e-5 whole-model relative error, the equivalence tests' (a cached part's update is the CPU
kernel's, as a streamed block's, against torch's AdamW: fp32 rounding).
"""
import copy
import math
import statistics

import pytest
import torch

import stronghold

from .helpers import caught_up, ds_config, relative_error, run_steps, train_reference, train_stronghold
from .test_step_state import Boom, _raise_in_backward_of

LR = 3e-3
TOL = 1e-5
VOCAB, HIDDEN, SEQ = 1024, 16, 16


def big_vocab_llama(n_layer: int = 4, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ,
                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def vocab_batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def step_norms(model, data, gas: int) -> list[float]:
    """Plain PyTorch's global gradient norm at each optimizer step of an unclipped run."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    norms = []
    for i, batch in enumerate(data):
        (model(**batch).loss / gas).backward()
        if (i + 1) % gas == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return norms


PLACEMENTS = {"both": "host", "input": {"input": "host", "output": "gpu"}, "output": {"output": "host"}}
CACHED = {"both": {"input", "output"}, "input": {"input"}, "output": {"output"}}


def _check_layout(engine, model_tied: bool) -> None:
    """Each cached parameter is in exactly one host store and in no resident chunk; its value is on the device."""
    runtime = engine.stronghold_runtime
    in_stores = [id(e.param) for s in runtime.host_stores() for e in s.entries]
    assert len(in_stores) == len(set(in_stores))
    resident = {id(p) for chunk in runtime.resident.chunks for p in chunk.params}
    cached = {id(e.param) for s in runtime.cached.stores.values() for e in s.entries}
    assert not resident & cached
    embed = engine.module.model.embed_tokens.weight
    if model_tied:
        assert engine.module.lm_head.weight is embed
    for unit in runtime.cached.units.values():
        buffer = unit.device.buffer
        for entry in unit.store.entries:
            assert entry.param.data.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("resident", [1, 4], ids=["streamed_blocks", "resident_blocks"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_part_in_every_tier_matches_pytorch_adamw(placement, tie, resident):
    """Accumulation 2 over four steps; the clip limit is the median step norm, so some steps clip and some do not."""
    model, data, gas = big_vocab_llama(4, tie=tie), vocab_batches(8), 2
    norms = step_norms(model, data, gas)
    clip = statistics.median(norms)
    assert min(norms) < clip < max(norms)
    reference, ref_losses = train_reference(model, data, lr=LR, gas=gas, clip=clip)
    engine, losses = train_stronghold(model, data, ds_config(window=2, resident=resident, lr=LR, gas=gas, clip=clip,
                                                             rest_placement=PLACEMENTS[placement]))
    runtime = engine.stronghold_runtime
    assert runtime.cached_parts == CACHED[placement]
    assert len(runtime.stores) == 4 - resident
    _check_layout(engine, tie)
    report = engine.stronghold_report()
    assert report["cached_parts"] == sorted(CACHED[placement]) and report["cached"]["loads_per_step"] >= 1
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert relative_error(engine.module, reference) <= TOL


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_cached_parts_without_spare_gradient_buffers_match_pytorch_adamw(tie):
    """Where host memory is short the blocks drop their spare gradient buffers ("gradient_spares": false) and the
    cached parts drop theirs with them: every micro-step's gradients are added as they land, exactly."""
    model, data, gas = big_vocab_llama(4, tie=tie), vocab_batches(8), 2
    clip = statistics.median(step_norms(model, data, gas))
    reference, ref_losses = train_reference(model, data, lr=LR, gas=gas, clip=clip)
    engine, losses = train_stronghold(model, data, ds_config(window=2, resident=1, lr=LR, gas=gas, clip=clip,
                                                             rest_placement="host", gradient_spares=False))
    runtime = engine.stronghold_runtime
    assert runtime.cached.units and all(s.grad_spare is None and s.accum is not None
                                        for s in [*runtime.stores.values(), *runtime.cached.stores.values()])
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert relative_error(engine.module, reference) <= TOL


def test_an_early_update_of_a_cached_part_is_redone_when_the_rest_clips():
    """The head's gradient arrives first and alone stays under the limit: it is updated during backward, then the
    embeddings and blocks push the global norm over the limit and step() redoes it with the clip coefficient."""
    model, data = big_vocab_llama(4), vocab_batches(3)
    head = copy.deepcopy(model)
    head(**data[0]).loss.backward()
    head_norm = float(torch.cat([head.lm_head.weight.grad.flatten(), head.model.norm.weight.grad]).norm())
    clip = head_norm / 0.85  # within speculation.SPECULATE_FRACTION of the limit
    assert step_norms(model, data[:1], 1)[0] > clip
    reference, _ = train_reference(model, data, lr=LR, clip=clip)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, clip=clip, rest_placement="host"))
    run_steps(engine, data, before_step=lambda e, i: caught_up(e))
    assert engine.stronghold_runtime.cpu.stats.redo_blocks > 0
    assert relative_error(engine.module, reference) <= TOL


def test_bf16_cached_parts_keep_fp32_masters_and_the_device_copy_is_their_rounding():
    """bf16: the CPU kernel writes each cached part's bf16 weights beside its fp32 master, and the device copy is
    loaded from them. Masters against plain PyTorch's bf16 policy (fp32 masters and accumulation) at 1e-4, the bound of
    test_exactness's bf16 test (an fp32 rounding difference can flip a bf16 weight by one ulp)."""
    from .test_exactness import _bf16_reference, _master_error
    model = big_vocab_llama(4).to(torch.bfloat16)
    data = vocab_batches(6)
    _, masters_ref = _bf16_reference(model, data, 2, clip=1.0)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, gas=2, clip=1.0, bf16=True, rest_placement="host"))
    run_steps(engine, data)
    runtime = engine.stronghold_runtime
    masters = runtime.master_params()
    for store in runtime.cached.stores.values():
        for entry in store.trainable:
            assert masters[id(entry.param)].dtype == torch.float32
            assert torch.equal(entry.param.detach(), masters[id(entry.param)].to(torch.bfloat16))
    assert _master_error(engine, masters_ref) <= 1e-4


def _nan_in_embeddings(engine, batch):
    return engine(**batch).loss + float("nan") * engine.module.model.embed_tokens.weight.sum()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_non_finite_gradient_in_a_cached_part_skips_the_step_everywhere(clip):
    """Only the input embeddings' gradient is NaN: the head (cached, first in backward) and the streamed blocks may
    have been updated early; the step is skipped and every early update undone."""
    model, data, bad = big_vocab_llama(4), vocab_batches(5), 2
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, clip=clip, rest_placement="host"))
    for i, batch in enumerate(data):
        engine.backward(_nan_in_embeddings(engine, batch) if i == bad else engine(**batch).loss)
        engine.step()
    assert engine.skipped_steps == 1
    engine.synchronize_host()
    reference, _ = train_reference(model, data[:bad] + data[bad + 1:], lr=LR, clip=clip)
    assert relative_error(engine.module, reference) <= TOL


@pytest.mark.parametrize("where", ["embeddings", "block"])
def test_an_exception_in_backward_leaves_the_cached_parts_as_before(where):
    """Accumulation 2; the boundary micro-step fails after the head's gradients went to the host (in the embeddings,
    the last of backward, or in block 2): the micro-batch is dropped, the next one takes its place."""
    model, data, failed = big_vocab_llama(4), vocab_batches(6), 3
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, gas=2, clip=1.0, rest_placement="host"))
    run_steps(engine, data[:failed])
    module = engine.module.model.embed_tokens if where == "embeddings" else engine.module.model.layers[2]
    handle = _raise_in_backward_of(module)
    loss = engine(**data[failed]).loss
    with pytest.raises(Boom):
        engine.backward(loss)
    handle.remove()
    run_steps(engine, data[failed + 1:])
    assert engine.global_steps == 2
    reference, _ = train_reference(model, data[:failed] + data[failed + 1:], lr=LR, gas=2, clip=1.0)
    assert relative_error(engine.module, reference) <= TOL


@pytest.mark.parametrize("before,after", [("host", "gpu"), ("gpu", "host")])
def test_a_checkpoint_loads_across_the_tiers_of_the_parts(tmp_path, before, after):
    """Saved with the parts in one tier, resumed with them in the other: the same as the uninterrupted run (masters,
    moments and step counters by parameter name, as for blocks)."""
    model, data = big_vocab_llama(4), vocab_batches(6)
    reference, _ = train_reference(model, data, lr=LR, clip=1.0)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, clip=1.0, rest_placement=before))
    run_steps(engine, data[:3])
    assert len(engine.optimizer.state_dict()["state"]) == len(list(model.parameters()))
    engine.save_checkpoint(str(tmp_path), tag="t")
    resumed, _, _, _ = stronghold.initialize(model=big_vocab_llama(4, seed=7), config=ds_config(
        window=2, resident=1, lr=LR, clip=1.0, rest_placement=after))
    resumed.load_checkpoint(str(tmp_path), tag="t")
    run_steps(resumed, data[3:])
    assert relative_error(resumed.module, reference) <= TOL


def test_promoting_every_block_keeps_the_cpu_optimizer_for_the_cached_parts():
    model, data = big_vocab_llama(4, tie=True), vocab_batches(6)
    reference, _ = train_reference(model, data, lr=LR, clip=0.5)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, clip=0.5, rest_placement="host"))
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:3])
    runtime.promote(4, 2)
    assert runtime.window is None and not runtime.stores and runtime.cpu is not None
    run_steps(engine, data[3:])
    assert relative_error(engine.module, reference) <= TOL


def test_a_part_with_nothing_to_train_stays_resident():
    """A frozen embedding (as under LoRA) gains nothing in the cached tier: it stays where it was."""
    model, data = big_vocab_llama(4), vocab_batches(3)
    model.model.embed_tokens.weight.requires_grad_(False)
    reference, _ = train_reference(model, data, lr=LR, clip=1.0)
    engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=LR, clip=1.0, rest_placement="host"))
    assert engine.stronghold_runtime.cached_parts == {"output"}
    assert relative_error(engine.module, reference) <= TOL


def test_a_forward_waits_for_a_cached_part_whose_update_is_still_running():
    """Clipping defers every update to step() (the limit is far below the norm), and a job parked on the CPU worker
    before step() holds them back until the next forward asks to wait for a cached part's update (the units' wait
    releases it): the copy at the end of step() is not issued, and the forward's copy must follow the update. Without
    that wait the forward would run on the old weights (the parked job holds the update back for 10 s)."""
    import threading
    model, data = big_vocab_llama(4), vocab_batches(3)
    reference, _ = train_reference(model, data, lr=LR, clip=0.05)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        window=2, resident=1, lr=LR, clip=0.05, rest_placement="host"))
    runtime = engine.stronghold_runtime
    release = threading.Event()

    def wait(event, what):
        release.set()
        runtime.cpu.wait(event, what)

    runtime.cached.wait = wait
    for batch in data:
        engine.backward(engine(**batch).loss)
        release.clear()
        runtime.cpu.submit_after(lambda: release.wait(10))
        engine.step()
    assert runtime.cached.stats.waits >= len(data) - 1  # at every forward after the first step
    release.set()  # no forward after the last step
    engine.synchronize_host()
    assert relative_error(engine.module, reference) <= TOL
