"""The HF Trainer one line in a plain `python` process: no launcher, no mpi4py, no warnings of ours."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch
    import stronghold
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.arange(16) * (i + 1) % 96
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=16, vocab_size=96,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name names no loss; transformers warns otherwise
    stronghold.initialize(model, config={"window_size": 2, "resident_blocks": 1, "kernels": False})
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=2, report_to=[],
                             save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    print("trained", trainer.state.global_step, "steps with", type(trainer.model_wrapped).__name__)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (the GPU machine has its own launch tests)")
def test_one_line_trains_in_a_plain_process_without_warnings(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "PYTHONPATH": str(ROOT)}
    if "STRONGHOLD_CACHE" in os.environ:
        env["STRONGHOLD_CACHE"] = os.environ["STRONGHOLD_CACHE"]
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "trained 2 steps with StrongholdEngine" in done.stdout
    assert "shm_comm" not in output
    noisy = [line for line in output.splitlines() if "warn" in line.lower()]
    assert noisy == []
