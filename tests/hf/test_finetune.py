"""examples/finetune.py, run in this process through its main(argv): a tiny Llama checkpoint fine-tuned on a text
file (byte tokens) and on a JSON Lines file (the checkpoint's own tokenizer) writes a final/ model that from_pretrained
loads; an interrupted run resumed with --resume ends where the uninterrupted run ends; bad input fails naming the
fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from examples.finetune import main
from tests.engine.helpers import SEQ, relative_error, tiny_llama

WORDS = "the a model trains streams blocks on one GPU host memory and fits weights".split()
TEXT = "Fine-tuning a model whose weights do not fit the GPU: stream its blocks from host memory.\n" * 8
TOL = 1e-5  # of what training changed, fp32 on the CPU (the resumed run is bit-equal here; plain AdamW ~5e-7 off)


def save_llama(directory: Path, *, byte_vocab: bool, tokenizer: bool = False) -> torch.nn.Module:
    """A tiny fp32 Llama written with save_pretrained: a 256-entry vocabulary for byte tokens, or the helpers' own
    with a word-level tokenizer beside it (the checkpoint of a model that has one)."""
    model = tiny_llama(4)
    if byte_vocab:
        model.resize_token_embeddings(256, mean_resizing=False)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {"</s>": 0, "<unk>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
        words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        # Token 0 ends, begins and pads, as in the model's config.
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>", bos_token="</s>",
                                pad_token="</s>").save_pretrained(directory)
    return model


def jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def word_records(n: int) -> list[dict]:
    return [{"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(7 + i % 5))} for i in range(n)]


def args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--data", str(data), "--output-dir", str(out), "--seq", str(SEQ), "--batch", "2",
            "--lr", "1e-3", *extra]


def load(final: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(final, local_files_only=True)


def update_error(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module) -> float:
    """How far `a`'s training moved its weights from `b`'s, relative to what `b`'s training changed."""
    begin = dict(start.named_parameters())
    moved = [{name: p.detach() - begin[name].detach() for name, p in m.named_parameters()} for m in (a, b)]
    return relative_error(*moved)


class Steps(TrainerCallback):
    """Counts the optimizer steps a run takes, and stops the process (an exception) after the save at step `crash`."""

    def __init__(self, crash: int | None = None):
        self.crash, self.taken = crash, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.taken += 1

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.crash:
            raise KeyboardInterrupt(f"interrupted after the checkpoint of step {self.crash}")


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_fine_tunes_and_writes_a_loadable_model(tmp_path, kind):
    tokenized = kind == "jsonl"
    start = save_llama(tmp_path / "ckpt", byte_vocab=not tokenized, tokenizer=tokenized)
    if tokenized:
        data = jsonl(tmp_path / "data.jsonl", word_records(40))
    else:
        data = tmp_path / "data.txt"
        data.write_text(TEXT)
    steps = Steps()
    final = main(args(tmp_path / "ckpt", data, tmp_path / "out", "--steps", "3"), callbacks=[steps])
    assert steps.taken == 3 and final == tmp_path / "out" / "final"
    assert (tmp_path / "out" / "checkpoint-3").is_dir(), "Trainer's checkpoint at the end, for --resume"
    tuned = load(final)
    assert tuned.dtype == torch.float32 and tuned.config.vocab_size == start.config.vocab_size
    before = dict(start.named_parameters())
    for name, param in tuned.named_parameters():
        assert torch.isfinite(param).all(), name
        assert not torch.equal(param, before[name]), f"{name} did not train"
    if tokenized:  # the checkpoint's tokenizer is saved with the model
        assert AutoTokenizer.from_pretrained(final, local_files_only=True)("the model")["input_ids"] == [2, 4]
    else:  # the same script without the line trains the same model
        plain = main(args(tmp_path / "ckpt", data, tmp_path / "plain", "--steps", "3", "--no-stronghold"))
        assert update_error(tuned, load(plain), start) <= TOL


def test_resume_continues_exactly(tmp_path):
    start = save_llama(tmp_path / "ckpt", byte_vocab=True)
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    common = ("--steps", "6", "--accumulation", "2")
    whole = main(args(tmp_path / "ckpt", data, tmp_path / "whole", *common))

    first = Steps(crash=3)
    interrupted = args(tmp_path / "ckpt", data, tmp_path / "run", *common, "--save-steps", "3")
    with pytest.raises(KeyboardInterrupt, match="step 3"):
        main(interrupted, callbacks=[first])
    assert first.taken == 3 and not (tmp_path / "run" / "final").exists()
    second = Steps()
    resumed = main([*interrupted, "--resume"], callbacks=[second])
    assert second.taken == 3, "the resumed run starts at the checkpoint, not from the start"
    state = json.loads((tmp_path / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert update_error(load(resumed), load(whole), start) <= TOL


def error_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(argv, the message expected) for one kind of bad input; each fails before any training."""
    model, text, out = tmp_path / "ckpt", tmp_path / "data.txt", tmp_path / "out"
    save_llama(model, byte_vocab=case != "small_vocab")
    text.write_text(TEXT)
    if case == "missing_model":
        return args(tmp_path / "nowhere", text, out), "no such directory.*give a directory written by save_pretrained"
    if case == "no_config":
        (model / "config.json").unlink()
        return args(model, text, out), "has no config.json; give a directory written by save_pretrained"
    if case == "missing_data":
        return args(model, tmp_path / "absent.txt", out), "absent.txt: no such file; give a text file"
    if case == "empty_data":
        text.write_text(" \n")
        return args(model, text, out), "data.txt: no text in it; give a file with text"
    if case == "short_data":
        text.write_text("too short")
        return args(model, text, out), "9 tokens, fewer than one window of --seq 16; give more text"
    if case == "jsonl_without_text":
        data = jsonl(tmp_path / "data.jsonl", [{"text": "fine"}, {"body": "no text"}])
        return args(model, data, out), 'line 2: no "text" field holding a string; every line must be an object'
    if case == "jsonl_not_json":
        data = tmp_path / "data.jsonl"
        data.write_text('{"text": "fine"}\n\n{"text": unquoted}\n')
        return args(model, data, out), r"line 3: not JSON \(.*\); every line must be an object"
    if case == "small_vocab":
        return args(model, text, out), r"no tokenizer, and its vocabulary \(96\) is too small for byte tokens"
    if case == "resume_without_checkpoint":
        return args(model, text, out, "--resume"), "--resume: no checkpoint-<step> directory in .*leave --resume out"
    if case == "resume_without_output_dir":
        return ["--model", str(model), "--data", str(text), "--resume"], "--resume continues the run in --output-dir"
    if case == "checkpoints_without_resume":
        (out / "checkpoint-4").mkdir(parents=True)
        return args(model, text, out), "already holds checkpoint-4; add --resume to continue that run"
    assert case == "seq_beyond_positions"
    return args(model, text, out, "--seq", "64"), "--seq 64 is longer than the model's 16 positions; pass --seq 16"


@pytest.mark.parametrize("case", ["missing_model", "no_config", "missing_data", "empty_data", "short_data",
                                  "jsonl_without_text", "jsonl_not_json", "small_vocab", "resume_without_checkpoint",
                                  "resume_without_output_dir", "checkpoints_without_resume", "seq_beyond_positions"])
def test_bad_input_names_the_fix(tmp_path, case):
    argv, message = error_case(tmp_path, case)
    with pytest.raises(ValueError, match=message):
        main(argv)


@pytest.mark.parametrize("flag", ["--steps", "--seq", "--batch", "--accumulation", "--save-steps"])
def test_counts_below_one_are_refused_by_the_parser(tmp_path, capsys, flag):
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--data", str(tmp_path / "x.txt"), flag, "0"])
    assert f"{flag}=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_bf16_without_a_gpu_says_to_leave_it_out(tmp_path):
    with pytest.raises(ValueError, match="--bf16 needs a GPU.*leave it out"):
        main(["--model", str(tmp_path), "--data", str(tmp_path / "x.txt"), "--bf16"])
