"""Parameter-efficient fine-tuning through the one line: a PEFT LoRA model trains like the same LoRA under plain
Trainer, its frozen base weights stream with no optimizer state anywhere, and only the adapters change."""
import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.engine.helpers import relative_error, tiny_llama
from tests.hf.helpers import logged, run_trainer

TOL = 1e-5


def lora_llama():
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(tiny_llama(4), config)


def test_lora_through_the_one_line_matches_plain_trainer_and_keeps_no_state_for_frozen_weights(tmp_path):
    model = lora_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = run_trainer(model, tmp_path / "plain", one_line=False)
    trainer = run_trainer(model, tmp_path / "one", one_line=True, config={"window_size": 2, "resident_blocks": 1})
    assert relative_error(trainer.model, plain.model) <= TOL
    for key in ("loss", "grad_norm"):
        assert logged(trainer, key) == pytest.approx(logged(plain, key), rel=TOL), key
    runtime = trainer.model_wrapped.stronghold_runtime
    assert runtime.stores, "the test must stream blocks"
    for store in runtime.stores.values():
        adapters = sum(e.numel for e in store.entries if e.group is not None)
        assert 0 < store.trainable_numel == adapters < store.numel
        # fp32 master and both moments for the adapters only; the frozen base has its working copy alone
        assert store.master.numel() == store.exp_avg.numel() == store.exp_avg_sq.numel() == adapters
    for name, param in trainer.model.named_parameters():
        changed = not torch.equal(param.detach().cpu(), start[name])
        assert changed == ("lora_" in name), name


def test_lora_with_activation_checkpointing_keeps_frozen_weights_in_place_until_their_backward(tmp_path, monkeypatch):
    """With non-reentrant checkpointing the recompute saves a frozen weight as the parameter itself, and autograd
    reads it after the block's adapters have their gradients (an input norm's weight, for its input gradient): the
    parameter must still point where the recompute found it then. Pointed back at the host copy, it moved off the
    GPU ("Expected all tensors to be on the same device"); on the CPU the move shows as a changed data pointer."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRMSNorm.forward
    recomputed, checked, moved = {}, [], []

    def forward(self, hidden):
        out = original(self, hidden)
        if torch._C._current_graph_task_id() != -1:  # the recompute, inside backward
            recomputed[id(self)] = self.weight.data_ptr()
        elif out.requires_grad:
            def check(grad, norm=self):  # runs just before the norm's backward reads its weight
                if id(norm) in recomputed:
                    checked.append(id(norm))
                    if norm.weight.data_ptr() != recomputed.pop(id(norm)):
                        moved.append(id(norm))
            out.register_hook(check)
        return out

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    model = lora_llama()
    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = run_trainer(model, tmp_path / "plain", one_line=False, **checkpointing)
    recomputed.clear()
    checked.clear()
    trainer = run_trainer(model, tmp_path / "one", one_line=True, config={"window_size": 2, "resident_blocks": 1},
                          **checkpointing)
    assert trainer.model_wrapped.stronghold_runtime.stores, "the test must stream blocks"
    assert checked and not moved, f"{len(moved)} of {len(checked)} frozen weights moved before their backward read them"
    assert relative_error(trainer.model, plain.model) <= TOL


def test_lora_with_the_blockwise_backward_is_bit_identical_to_host_accumulation():
    """The blockwise backward (its "auto" may choose it) on a PEFT model: the walk carries the gradient through the
    frozen base to the adapters, summed as host accumulation sums them (no clipping: bit for bit)."""
    from tests.engine.helpers import batches, check_bit_identical_to_host
    engine = check_bit_identical_to_host(lora_llama(), batches(8), lr=3e-3, gas=4, blockwise_backward=True)
    assert engine.stronghold_runtime.blockwise.walks == 2 and engine.stronghold_runtime.stores


def test_lora_with_the_forwards_block_by_block_is_bit_identical_to_them_one_by_one():
    """"block_major_forward" on a PEFT model (its forward goes through PEFT's wrapper to the base model's blocks):
    each window runs ahead, and the adapters end bit for bit as with the forwards one by one."""
    from tests.engine.helpers import batches, engine_for, named_params
    data, runs = batches(8), {}
    for major in (True, False):
        engine = engine_for(lora_llama(), lr=3e-3, gas=4, blockwise_backward=True, block_major_forward=major)
        for start in (0, 4):
            engine.window_batches(data[start:start + 4])
            for batch in data[start:start + 4]:
                engine.backward(engine(**batch).loss)
                engine.step()
        engine.synchronize_host()
        assert engine.stronghold_runtime.blockwise.major.runs == (2 if major else 0)
        runs[major] = named_params(engine.module)
        engine.destroy()
    assert all(torch.equal(runs[True][name], runs[False][name]) for name in runs[False])
