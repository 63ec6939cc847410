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
