"""A plain Trainer script vs the same script plus `stronghold.initialize(model)`, fp32 on the CPU."""
import threading

import deepspeed
import pytest
import torch
import transformers

import stronghold
from stronghold.engine.collector import INCREMENTAL
from stronghold.integrations import hf
from tests.engine.helpers import relative_error, tiny_gpt2, tiny_llama

from .helpers import FAST, TokenDataset, logged, run_trainer, training_args

TOL = 1e-5


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2(4)


@pytest.fixture(scope="module")
def plain(gpt2, tmp_path_factory):
    """The reference: plain Trainer, gradient accumulation 2, clipping that triggers, linear warmup."""
    return run_trainer(gpt2, tmp_path_factory.mktemp("plain"), one_line=False, eval_dataset=TokenDataset(4, seed=7),
                       eval_strategy="steps", eval_steps=2)


def test_one_line_matches_plain_trainer(gpt2, plain, tmp_path):
    original_init, original_initialize = transformers.Trainer.__init__, deepspeed.initialize
    trainer = run_trainer(gpt2, tmp_path, one_line=True, config={"window_size": 2, "resident_blocks": 1},
                          kernels=True, eval_dataset=TokenDataset(4, seed=7), eval_strategy="steps", eval_steps=2)
    engine = trainer.model_wrapped
    assert isinstance(engine, stronghold.StrongholdEngine) and len(engine.stronghold_runtime.stores) == 3
    assert engine.gradient_accumulation_steps() == 2 and engine.gradient_clipping() == 0.05
    assert relative_error(trainer.model, plain.model) <= TOL
    assert min(logged(plain, "grad_norm")) > 0.05, "clipping must trigger at every step"
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        assert logged(trainer, key) == pytest.approx(logged(plain, key), rel=TOL), key
    assert len(set(logged(trainer, "learning_rate"))) == 3, "warmup then linear decay"
    collected = engine.stronghold_runtime.collector.report
    assert collected.mode == "python" if INCREMENTAL else collected.collections >= 1, "Trainer's steps are boundaries"
    window = engine.stronghold_runtime.window
    window.stats.loads = window.stats.demand_loads = 0
    trainer.evaluate()  # Trainer calls the model, not the engine: the hook starts the window's forward walk
    assert window.stats.loads > 0 and window.stats.demand_loads == 0
    assert transformers.Trainer.__init__ is not original_init and deepspeed.initialize is not original_initialize
    hf.unprepare(trainer.model)
    assert transformers.Trainer.__init__ is original_init and deepspeed.initialize is original_initialize


def test_one_line_with_the_embeddings_and_head_states_on_the_host_matches_plain_trainer(gpt2, plain, tmp_path):
    """"rest_placement": "host": GPT-2's tied embedding (one master, one update) and final norm keep their weights on
    the device and their fp32 states on the host; Trainer's evaluation, which calls the model directly, sees the
    updated weights (the model's forward pre-hook makes them current)."""
    trainer = run_trainer(gpt2, tmp_path, one_line=True,
                          config={"window_size": 2, "resident_blocks": 1, "rest_placement": "host"},
                          eval_dataset=TokenDataset(4, seed=7), eval_strategy="steps", eval_steps=2)
    runtime = trainer.model_wrapped.stronghold_runtime
    assert runtime.cached_parts == {"input", "output"}
    assert relative_error(trainer.model, plain.model) <= TOL
    for key in ("loss", "grad_norm", "eval_loss"):
        assert logged(trainer, key) == pytest.approx(logged(plain, key), rel=TOL), key
    hf.unprepare(trainer.model)


def test_one_line_runs_each_window_block_by_block_and_matches_plain_trainer(gpt2, plain, tmp_path):
    """"block_major_forward" under the blockwise backward: Trainer's window batches reach the engine, each window's
    first forward runs every block for both micro-batches, and training equals the same run with the forwards one by
    one (block_major.py) to rounding, as Trainer clips (two runs of one clipped configuration agree to rounding:
    tests/engine/test_batch_room.py), and is within the bar of plain Trainer. Its evaluation, between steps, runs the
    blocks for real."""
    runs = {}
    for major in (True, False):
        trainer = run_trainer(gpt2, tmp_path / str(major), one_line=True,
                              config={"window_size": 2, "resident_blocks": 1, "blockwise_backward": True,
                                      "block_major_forward": major},
                              eval_dataset=TokenDataset(4, seed=7), eval_strategy="steps", eval_steps=2)
        runs[major] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        blockwise = trainer.model_wrapped.stronghold_runtime.blockwise
        assert blockwise.major.runs == (4 if major else 0) and blockwise.major.dropped == 0
        assert relative_error(trainer.model, plain.model) <= TOL
        for key in ("loss", "grad_norm", "eval_loss"):
            assert logged(trainer, key) == pytest.approx(logged(plain, key), rel=TOL), key
        hf.unprepare(trainer.model)
    assert relative_error(runs[True], runs[False]) <= 1e-6


@pytest.mark.parametrize("reentrant", [True, False])
def test_one_line_runs_each_window_block_by_block_under_trainers_gradient_checkpointing(tmp_path, reentrant):
    """As the benchmarks launch it: a Llama with Trainer's `gradient_checkpointing` (its default reentrant checkpoint,
    and the non-reentrant one), whose layers call the checkpoint function around their forward: every window runs
    ahead, none is dropped, and training ends as with the forwards one by one (to rounding, as Trainer clips)."""
    model, runs = tiny_llama(4), {}
    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for major in (True, False):
        trainer = run_trainer(model, tmp_path / str(major), one_line=True,
                              config={"window_size": 2, "resident_blocks": 1, "blockwise_backward": True,
                                      "block_major_forward": major}, **checkpointing)
        major_forward = trainer.model_wrapped.stronghold_runtime.blockwise.major
        assert (major_forward.runs, major_forward.dropped) == ((4 if major else 0), 0)
        runs[major] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        hf.unprepare(trainer.model)
    assert relative_error(runs[True], runs[False]) <= 1e-6


def test_weight_decay_groups_are_trainers(gpt2, plain, tmp_path):
    trainer = run_trainer(gpt2, tmp_path, one_line=True, train=False)
    trainer.create_optimizer()
    want = {n: g["weight_decay"] for n, p in plain.model.named_parameters()
            for g in plain.optimizer.param_groups if any(p is q for q in g["params"])}
    named = dict(trainer.model.named_parameters())
    got = {n: g["weight_decay"] for n, p in named.items() for g in trainer.optimizer.param_groups
           if any(p is q for q in g["params"])}
    assert got == want
    assert want["transformer.h.0.ln_1.weight"] == 0.0 and want["transformer.h.0.attn.c_attn.bias"] == 0.0
    assert want["transformer.h.0.attn.c_attn.weight"] == 0.1


def test_deepspeed_json_section_is_used(gpt2, plain, tmp_path):
    """TrainingArguments(deepspeed=...) with a stronghold section and an optimizer section of "auto"s."""
    ds = {"zero_optimization": {"stage": 0}, "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "stronghold": {"window_size": 3, "resident_blocks": 0, "pin_memory": "auto"}}
    trainer = run_trainer(gpt2, tmp_path, one_line=True, deepspeed=ds, eval_dataset=TokenDataset(4, seed=7),
                          eval_strategy="steps", eval_steps=2)
    runtime = trainer.model_wrapped.stronghold_runtime
    assert runtime.window_size == 3 and runtime.resident_count == 0
    assert relative_error(trainer.model, plain.model) <= TOL


def test_conflicts_name_both_values(gpt2, tmp_path):
    ds = {"zero_optimization": {"stage": 0}, "stronghold": {"window_size": 3}}
    with pytest.raises(ValueError, match=r"stronghold\.window_size: the DeepSpeed config says 3 .* says 2"):
        run_trainer(gpt2, tmp_path, one_line=True, config={"window_size": 2}, deepspeed=ds, train=False)
    ds = {"zero_optimization": {"stage": 0}, "gradient_clipping": 0.5}
    with pytest.raises(ValueError, match=r"gradient_clipping=0\.5 vs hf max_grad_norm=0\.05"):
        run_trainer(gpt2, tmp_path, one_line=True, deepspeed=ds, train=False)


@pytest.mark.parametrize("overrides,needle", [
    ({"optim": "sgd"}, r"optim='sgd'.*AdamW only"),
    ({"torch_compile": True}, "torch_compile=True"),
])
def test_unsupported_training_arguments(gpt2, tmp_path, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        run_trainer(gpt2, tmp_path, one_line=True, train=False, **overrides)


@pytest.mark.parametrize("config,needle", [
    ({"window_size": 1}, r"stronghold\.window_size"),
    ({"stronghold": {}, "bf16": {"enabled": True}}, r"stronghold section only.*\['bf16'\]"),
])
def test_bad_config_fails_at_the_one_line(gpt2, config, needle):
    with pytest.raises(ValueError, match=needle):
        stronghold.initialize(gpt2, config=config)
    assert not hf.is_prepared(gpt2)


def test_model_is_never_moved_whole(gpt2, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the whole model was moved")

    model = tiny_gpt2(4)
    stronghold.initialize(model, config=FAST)
    monkeypatch.setattr(model, "to", refuse, raising=False)
    monkeypatch.setattr(model, "cuda", refuse, raising=False)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path, max_steps=2),
                                   train_dataset=TokenDataset(16))
    trainer.train()


def test_unprepared_trainer_in_the_same_process_is_plain(gpt2, tmp_path):
    args = training_args(tmp_path, max_steps=2)
    prepared_model, other = tiny_gpt2(4), tiny_gpt2(4)
    stronghold.initialize(prepared_model, config=FAST)
    first = transformers.Trainer(model=prepared_model, args=args, train_dataset=TokenDataset(16))
    first.train()
    assert isinstance(first.model_wrapped, stronghold.StrongholdEngine) and not args.deepspeed
    second = transformers.Trainer(model=other, args=args, train_dataset=TokenDataset(16))
    assert not second.is_deepspeed_enabled
    second.train()
    assert second.model_wrapped is other
    with hf.prepared(tiny_gpt2(2)) as model:
        assert hf.is_prepared(model)
    assert hf.is_prepared(prepared_model)


@pytest.mark.parametrize("layout", ["same", "different"])
def test_resume_from_checkpoint_is_exact(gpt2, tmp_path, layout):
    saved = {"window_size": 2, "resident_blocks": 1}
    loaded = saved if layout == "same" else {"window_size": 3, "resident_blocks": 0}
    steps = dict(max_steps=6, save_strategy="steps", save_steps=3)
    whole = run_trainer(gpt2, tmp_path / "whole", one_line=True, config=saved, **steps)
    assert (tmp_path / "whole" / "checkpoint-3" / "global_step3").is_dir()
    resumed = run_trainer(gpt2, tmp_path / "resumed", one_line=True, config=loaded, train=True,
                          resume=str(tmp_path / "whole" / "checkpoint-3"), **steps)
    assert resumed.state.global_step == 6
    assert relative_error(resumed.model, whole.model) <= 1e-6
    assert logged(resumed, "loss")[-3:] == pytest.approx(logged(whole, "loss")[-3:], rel=1e-6)


def test_save_model_round_trip(gpt2, plain, tmp_path, monkeypatch):
    from stronghold.optim.cpu_optim import CpuOptimizer

    # The last step's CPU updates are still queued when save_model starts: the worker is held, ahead of them, until
    # something drains it (the state_dict hook must). An event, not a delay: the same on every machine.
    finish_step, drain = CpuOptimizer.finish_step, CpuOptimizer.drain
    release, steps = threading.Event(), []

    def held_last_step(self, *args, **kwargs):
        steps.append(True)
        if len(steps) == trainer.args.max_steps:
            self._submit(lambda: release.wait(60) or pytest.fail("the worker was never drained"))
        return finish_step(self, *args, **kwargs)

    def releasing_drain(self):
        release.set()
        return drain(self)

    monkeypatch.setattr(CpuOptimizer, "finish_step", held_last_step)
    monkeypatch.setattr(CpuOptimizer, "drain", releasing_drain)
    trainer = run_trainer(gpt2, tmp_path / "run", one_line=True, train=False)
    trainer.train()
    assert len(steps) == trainer.args.max_steps and not release.is_set(), "the last step's updates are held"
    trainer.save_model(str(tmp_path / "export"))  # no synchronize_host() first: the state_dict hook does it
    trainer.model_wrapped.synchronize_host()
    assert (tmp_path / "export" / "model.safetensors").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "export"))
    trained = dict(trainer.model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, trained[name].detach()), name
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert relative_error(loaded, plain.model) <= TOL


def test_llama_with_explicit_blocks(tmp_path):
    model = tiny_llama(4)
    plain = run_trainer(model, tmp_path / "plain", one_line=False)
    copy_ = __import__("copy").deepcopy(model)
    stronghold.initialize(copy_, blocks=copy_.model.layers[1:], config={**FAST, "resident_blocks": 0})
    trainer = transformers.Trainer(model=copy_, args=training_args(tmp_path / "sh"), train_dataset=TokenDataset(64))
    trainer.train()
    trainer.model_wrapped.synchronize_host()
    assert len(trainer.model_wrapped.stronghold_runtime.stores) == 3
    assert relative_error(trainer.model, plain.model) <= TOL


def test_second_trainer_on_the_same_model_continues_from_its_weights(gpt2, tmp_path):
    """Each Trainer builds a new engine from the model as the previous one left it (fresh AdamW, as plain)."""
    def two_trainers(one_line):
        model = __import__("copy").deepcopy(gpt2)
        if one_line:
            stronghold.initialize(model, config=FAST)
        trainers = [transformers.Trainer(model=model, args=training_args(tmp_path / f"{one_line}{i}", max_steps=2),
                                         train_dataset=TokenDataset(16)) for i in range(2)]
        for trainer in trainers:
            trainer.train()
        return model, trainers

    plain_model, _ = two_trainers(False)
    model, (first, second) = two_trainers(True)
    assert first.model_wrapped is not second.model_wrapped
    assert not first.model_wrapped.stronghold_runtime.hooks.handles, "the first engine was closed"
    second.model_wrapped.synchronize_host()
    assert relative_error(model, plain_model) <= TOL


@pytest.mark.parametrize("scheduler", ["cosine", "constant_with_warmup"])
def test_scheduler_types_with_warmup(gpt2, tmp_path, scheduler):
    settings = dict(lr_scheduler_type=scheduler, warmup_steps=2, max_steps=5, gradient_accumulation_steps=1)
    plain = run_trainer(gpt2, tmp_path / "plain", one_line=False, **settings)
    trainer = run_trainer(gpt2, tmp_path / "sh", one_line=True, **settings)
    assert logged(trainer, "learning_rate") == logged(plain, "learning_rate")
    assert relative_error(trainer.model, plain.model) <= TOL


def test_derived_config_takes_trainers_values():
    """What Trainer fills into the derived config (bf16 cannot be set on a CPU-only TrainingArguments)."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    args = SimpleNamespace(world_size=1, per_device_train_batch_size=3, gradient_accumulation_steps=5,
                           max_grad_norm=0.3, learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6,
                           weight_decay=0.01, save_on_each_node=False, fp16=False, fp16_full_eval=False, bf16=True,
                           bf16_full_eval=False)
    derived = hf.deepspeed_config(None, {"window_size": 3})
    assert "optimizer" not in derived and "scheduler" not in derived, "Trainer's own AdamW and scheduler are used"
    filled = HfTrainerDeepSpeedConfig(derived)
    filled.trainer_config_process(args)
    assert not filled.mismatches
    config = filled.config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (3, 5, 15, 0.3)
    assert config["bf16"] == {"enabled": True} and config["zero_optimization"] == {"stage": 0}
    assert config["stronghold"] == {"window_size": 3}
