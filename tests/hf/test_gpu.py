"""GPU evidence for the Trainer one-liner (run on the device machine: `make test-gpu`)."""
import pytest
import torch

import stronghold
from tests.engine.helpers import SEQ, VOCAB

from .helpers import TokenDataset, logged, training_args

pytestmark = pytest.mark.gpu


def test_trainer_never_puts_the_whole_model_on_the_gpu(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=512, n_head=8, n_positions=SEQ, vocab_size=VOCAB,
                                       bos_token_id=0, eos_token_id=0))
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    # Accumulation on the host: on the GPU the streamed blocks' fp32 accumulators (device_accum.py) would be
    # there by design, 1.5x the fp32 model's bytes of the streamed blocks.
    stronghold.initialize(model, config={"window_size": 2, "resident_blocks": 1, "gpu_accumulation": False})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    trainer = Trainer(model=model, args=training_args(tmp_path, bf16=True, max_grad_norm=1.0, max_steps=3),
                      train_dataset=TokenDataset(32))
    trainer.train()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < 0.5 * fp32_bytes, f"peak {peak / 1e6:.0f} MB vs the model's {fp32_bytes / 1e6:.0f} MB in fp32"
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))
    trainer.save_model(str(tmp_path / "export"))
    masters = trainer.model_wrapped.stronghold_runtime.master_params()
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    trained = dict(trainer.model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, masters[id(trained[name])].float().cpu()), name
