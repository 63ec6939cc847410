"""Config validation: every bad input names the key and what is allowed."""
import copy

import pytest
import torch

import stronghold
from stronghold.config import parse_stronghold_section, resolve
from stronghold.deepspeed_keys import check_deepspeed_keys

from .helpers import batches, ds_config, tiny_gpt2, train_stronghold


def test_defaults_and_auto_values():
    cfg = parse_stronghold_section({})
    assert cfg.window_size == "auto" and cfg.resident_blocks == "auto" and cfg.pin_memory
    # DeepSpeed's convention: "auto" means "use the default" (HF Trainer fills these); for the
    # placement keys the default is "auto" itself (placement.py chooses).
    assert parse_stronghold_section({"stronghold": {"window_size": "auto"}}).window_size == "auto"
    assert parse_stronghold_section({"stronghold": {"pin_memory": "auto"}}).pin_memory is True


def test_resolve_leaves_auto_to_stronghold_on_a_gpu_and_takes_the_cpu_defaults_on_the_cpu():
    from stronghold.config import CPU_DEFAULTS

    cfg = parse_stronghold_section({})
    gpu, cpu = resolve(cfg, torch.device("cuda")), resolve(cfg, torch.device("cpu"))
    assert (gpu.resident_blocks, gpu.window_size, gpu.lean_blocks, gpu.gradient_spares, gpu.gpu_accumulation,
            gpu.compile) == (None,) * 6 and gpu.auto_window
    assert dict(gpu.rest_placement) == {"input": None, "output": None}
    assert (cpu.resident_blocks, cpu.window_size) == CPU_DEFAULTS and cpu.auto_window
    assert (cpu.lean_blocks, cpu.gradient_spares, cpu.gpu_accumulation, cpu.compile) == (0, True, False, False)
    assert dict(cpu.rest_placement) == {"input": "gpu", "output": "gpu"}
    for settings in (gpu, cpu):  # decided later on either device
        assert (settings.nvme_blocks, settings.weights_first, settings.offload_activations, settings.mlp_chunk_tokens,
                settings.kernels) == (None,) * 5
    given = parse_stronghold_section({"stronghold": {
        "resident_blocks": 0, "window_size": 3, "lean_blocks": 2, "gradient_spares": False, "gpu_accumulation": True,
        "compile": True, "rest_placement": {"output": "host"}, "offload_activations": 0, "mlp_chunk_tokens": False,
        "kernels": ["rope"], "pin_memory": False, "stall_timeout_s": 5.0}})
    for device in ("cuda", "cpu"):
        settings = resolve(given, torch.device(device))
        assert (settings.resident_blocks, settings.window_size, settings.auto_window, settings.lean_blocks,
                settings.gradient_spares, settings.gpu_accumulation, settings.compile) == (0, 3, False, 2, False, True,
                                                                                           True)
        assert (settings.offload_activations, settings.mlp_chunk_tokens, settings.kernels) == (0, False, ("rope",))
        assert not settings.pin_memory and settings.stall_timeout_s == 5.0
    assert dict(resolve(given, torch.device("cuda")).rest_placement) == {"input": None, "output": "host"}
    assert dict(resolve(given, torch.device("cpu")).rest_placement) == {"input": "gpu", "output": "host"}


@pytest.mark.parametrize("section,needle", [
    ({"windowsize": 3}, "stronghold.windowsize: unknown key; allowed keys are"),
    ({"window_size": 1}, "stronghold.window_size"),
    ({"resident_blocks": -1}, "stronghold.resident_blocks"),
    ({"cpu_optimizer_threads": 0}, "stronghold.cpu_optimizer_threads"),
    ({"pin_memory": "sometimes"}, "stronghold.pin_memory"),
    ({"gpu_memory_limit_gb": -3}, "stronghold.gpu_memory_limit_gb"),
    ({"host_memory_limit_gb": 0}, "stronghold.host_memory_limit_gb"),
    ({"stall_timeout_s": 0}, "stronghold.stall_timeout_s"),
    ({"gradient_spares": "sometimes"}, "stronghold.gradient_spares"),
])
def test_bad_section_names_the_key(section, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        parse_stronghold_section({"stronghold": section})


def test_section_must_be_an_object():
    with pytest.raises(ValueError, match="'stronghold' must be a JSON object"):
        parse_stronghold_section({"stronghold": [4]})


@pytest.mark.parametrize("patch,needle", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type"),
])
def test_unsupported_deepspeed_keys(patch, needle):
    cfg = {**ds_config(), **patch}
    with pytest.raises(ValueError, match=needle):
        check_deepspeed_keys(cfg)


def test_initialize_rejects_bad_config_before_touching_the_model():
    model = tiny_gpt2(2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="stronghold.window_size"):
        stronghold.initialize(model=model, config=ds_config(window=0))
    assert all(p.device.type == "cpu" and p.equal(before[n]) for n, p in model.named_parameters())


def test_optimizer_is_required():
    cfg = ds_config()
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="stronghold needs an optimizer"):
        stronghold.initialize(model=tiny_gpt2(2), config=cfg)


def test_unsupported_optimizer_params():
    cfg = ds_config()
    cfg["optimizer"]["params"]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        stronghold.initialize(model=tiny_gpt2(2), config=cfg)


def test_window_larger_than_streamed_blocks_is_clamped_with_a_warning():
    with pytest.warns(UserWarning, match="window_size 8 is more than the 3 streamed blocks; using 3"):
        engine, _ = train_stronghold(tiny_gpt2(4), batches(1), ds_config(window=8, resident=1))
    assert engine.stronghold_report()["window_size"] == 3


def test_all_blocks_resident_means_no_streaming():
    engine, _ = train_stronghold(tiny_gpt2(2), batches(2), ds_config(window=2, resident=5))
    report = engine.stronghold_report()
    assert report["streamed_blocks"] == 0 and report["resident_blocks"] == 2
    assert report["h2d_bytes_per_step"] == 0


def test_config_dict_is_not_modified():
    cfg = ds_config()
    original = copy.deepcopy(cfg)
    train_stronghold(tiny_gpt2(2), batches(1), cfg)
    assert cfg == original


def test_kernels_the_engine_applies_per_family_and_context():
    """What "kernels" asks stronghold_ops for: "auto" is the family's defaults, or all of its kernels when
    activations are offloaded (long sequences); true is every kernel (None), false none, a list itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stronghold.integrations.kernels import kernels_to_apply

    def kinds(model, **section):
        return kernels_to_apply(model, resolve(parse_stronghold_section({"stronghold": section}), torch.device("cuda")))

    gpt2 = tiny_gpt2(2)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=64))
    assert kinds(gpt2) == [] and kinds(llama) == []
    every = ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]
    assert kinds(llama, offload_activations=True) == every and kinds(llama, offload_activations=2) == every
    assert kinds(llama, offload_activations=False) == [] and kinds(llama, offload_activations=0) == []
    assert kinds(llama, kernels=True) is None and kinds(llama, kernels=False) == []
    assert kinds(llama, kernels=["rope"], offload_activations=True) == ["rope"]
    # Large logits (decided at the first forward, long_context.py) add the fused head to "auto" alone.
    def large(model, **section):
        return kernels_to_apply(model, resolve(parse_stronghold_section({"stronghold": section}), torch.device("cuda")),
                                large_logits=True)
    assert large(llama) == ["fused_linear_cross_entropy"] == large(gpt2)
    assert large(llama, offload_activations=True) == every and large(llama, kernels=False) == []
    assert large(llama, kernels=["rope"]) == ["rope"]


def test_kernel_names_are_checked():
    assert parse_stronghold_section({}).kernels == "auto"
    with pytest.raises(ValueError, match="stronghold.kernels"):
        parse_stronghold_section({"stronghold": {"kernels": "all"}})
    assert parse_stronghold_section({"stronghold": {"kernels": ["rms_norm", "rope"]}}).kernels == ["rms_norm", "rope"]
    with pytest.raises(ValueError, match="stronghold.kernels.*unknown kernels \\['flash'\\]"):
        parse_stronghold_section({"stronghold": {"kernels": ["flash"]}})


@pytest.mark.parametrize("value", ["bogus", 3, {"rope": True}, ["rope", 3]])
def test_a_wrong_kernels_value_is_one_line_with_the_valid_names(value):
    from stronghold_ops import KINDS
    with pytest.raises(ValueError) as err:
        parse_stronghold_section({"stronghold": {"kernels": value}})
    header, *lines = str(err.value).splitlines()
    assert header == "invalid stronghold configuration:"
    assert len(lines) == 1 and lines[0].strip().startswith("stronghold.kernels: should be true, false, \"auto\"")
    assert all(name in lines[0] for name in KINDS) and repr(value) in lines[0]


@pytest.mark.parametrize("key", ["stronghld", "Stronghold", "strong_hold", "STRONGHOLD", "strongholds"])
def test_a_misspelt_section_warns_with_the_name(key, caplog):
    """DeepSpeed ignores unknown top-level keys, so the section's settings would be dropped without a word;
    stronghold.initialize warns, naming the key and the spelling it reads."""
    model = tiny_gpt2(3)
    config = {**ds_config(), key: {"window_size": 2}}
    with caplog.at_level("WARNING", logger="stronghold"):
        engine, *_ = stronghold.initialize(model=model, config=config)
    engine.destroy()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and repr(key) in warned[0] and "did you mean 'stronghold'" in warned[0]


def test_deepspeed_keys_and_the_section_itself_do_not_warn(caplog):
    from stronghold.deepspeed_keys import warn_near_section
    with caplog.at_level("WARNING", logger="stronghold"):
        warn_near_section({**ds_config(), "steps_per_print": 10, "sparse_attention": {}, "wall_clock_breakdown": False,
                           "flops_profiler": {}, "comms_logger": {}, "tensorboard": {}, "checkpoint": {}})
    assert caplog.records == []
