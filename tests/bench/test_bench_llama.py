"""The Llama point (--arch llama, --intermediate, --kv-heads) and --accumulation: identity, the
command-line round trip, old GPT-2 keys unchanged, and the parameter and FLOP formulas against
the HF model built on the meta device (no memory, no weights)."""
import argparse
import json

import pytest
import torch
from bench_fakes import ROOT

from examples.bench.__main__ import build_parser
from examples.bench.flops import block_matmul_params, flops_per_step, param_count
from examples.bench.point import Point, add_point_args, point_from_args
from examples.bench.store import read_records
from examples.llama import default_intermediate

# The acceptance shape: Llama hidden 2560, 20 heads, 32 layers, seq 2048, micro-batch 2, GA 8.
ACCEPTANCE = ["--arch", "llama", "--hidden", "2560", "--heads", "20", "--layers", "32", "--seq", "2048",
              "--batch", "2", "--accumulation", "8", "--vocab", "32000"]


def parse(argv):
    parser = argparse.ArgumentParser()
    add_point_args(parser)
    return point_from_args(parser.parse_args(argv))


def meta_model(point):
    from examples.bench.model import hf_config, model_class

    with torch.device("meta"):
        return model_class(point)(hf_config(point))


def test_llama_rule_for_the_mlp_width():
    assert default_intermediate(4096) == 11008, "Llama-7B"
    assert default_intermediate(2560) == 6912
    assert default_intermediate(256) == 768


def test_gpt2_keys_are_unchanged():
    """The key a GPT-2 point without accumulation was stored under before arch/accumulation existed."""
    old = ('{"batch": 4, "checkpointing": true, "gpu_cap_GB": 32.0, "heads": 16, "hidden": 2048, "layers": 32, '
           '"seq": 1024, "stronghold": {"resident_blocks": 20, "window_size": 4}, "system": "stronghold", '
           '"vocab": 50304}')
    p = Point(system="stronghold", layers=32, stronghold={"window_size": 4, "resident_blocks": 20})
    assert p.key() == old
    assert parse(["--system", "stronghold", "--layers", "32", "--window-size", "4", "--resident-blocks", "20"]).key() == old


def test_stored_results_keep_their_keys():
    """Every stored record's point, rebuilt from its fields, has the key it was stored under."""
    records = read_records(ROOT / "results" / "bench")
    if not records:
        pytest.skip("no stored results in this checkout")
    for r in records:
        p = Point(system=r["system"], layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=r["seq"],
                  batch=r["batch"], vocab=r["vocab"], gpu_cap_GB=r["gpu_cap_GB"], checkpointing=r["checkpointing"],
                  stronghold=r.get("stronghold_knobs") or {}, arch=r.get("arch", "gpt2"),
                  accumulation=r.get("accumulation", 1), repeat=r.get("repeat", 0),
                  cpu_checkpointing=r.get("cpu_checkpointing", False))
        assert p.key() == r["key"]


def test_acceptance_point_from_the_command_line():
    p = parse(["--system", "stronghold", *ACCEPTANCE])
    assert (p.arch, p.intermediate_size, p.num_kv_heads, p.accumulation, p.gpu_cap_GB, p.stronghold) == \
        ("llama", 6912, 20, 8, 32.0, {})
    assert param_count(p) == 2_701_560_320, "2.70 B, the issue's size"
    key = json.loads(p.key())
    assert (key["arch"], key["intermediate"], key["kv_heads"], key["accumulation"]) == ("llama", 6912, 20, 8)
    assert p.key() == p.with_(intermediate=6912, kv_heads=20).key(), "the rule's width named or implied: one point"
    assert p.key() != p.with_(accumulation=1).key() and p.key() != p.with_(kv_heads=4).key()
    one = build_parser().parse_args(["one", "--system", "no_offload", "--gpu-cap-gb", "none", *ACCEPTANCE])
    assert point_from_args(one) == p.with_(system="no_offload", gpu_cap_GB=None)


@pytest.mark.parametrize("point", [
    Point(system="stronghold", layers=6, arch="llama", hidden=64, heads=4, kv_heads=2, intermediate=200, seq=32,
          batch=2, accumulation=3, vocab=300, gpu_cap_GB=None, stronghold={"window_size": 2}, warmup_steps=1,
          timed_steps=2),
    Point(system="zero_offload", layers=2, accumulation=4),
])
def test_argv_round_trip(point):
    assert parse(point.to_argv()) == point


@pytest.mark.parametrize("kwargs, words", [
    (dict(arch="bert"), "unknown arch"),
    (dict(intermediate=512), "for Llama and Qwen2 only"),
    (dict(kv_heads=4), "for Llama and Qwen2 only"),
    (dict(arch="llama", heads=16, kv_heads=5), "not a multiple of kv_heads=5"),
    (dict(arch="llama", intermediate=0), "intermediate=0"),
    (dict(accumulation=0), "accumulation=0"),
])
def test_bad_llama_and_accumulation_flags_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Point(system="no_offload", layers=4, **kwargs)


LLAMAS = [
    Point(system="no_offload", layers=3, arch="llama", hidden=64, heads=8, seq=32, vocab=300),
    Point(system="no_offload", layers=2, arch="llama", hidden=64, heads=8, kv_heads=2, intermediate=100, seq=32,
          vocab=300),
    # Qwen2: Llama's block with biases on q, k and v (peers.sh's qwen7b point).
    Point(system="no_offload", layers=2, arch="qwen2", hidden=64, heads=8, kv_heads=2, intermediate=100, seq=32,
          vocab=300),
]


@pytest.mark.parametrize("point", LLAMAS)
def test_llama_param_count_matches_the_hf_model(point):
    model = meta_model(point)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[point.arch]
    assert model.config.intermediate_size == point.intermediate_size
    assert model.config.num_key_value_heads == point.num_kv_heads
    assert sum(t.numel() for t in model.parameters()) == param_count(point)


@pytest.mark.parametrize("point", [*LLAMAS, Point(system="no_offload", layers=2, hidden=64, heads=4, seq=32)])
def test_matmul_weights_match_the_hf_model(point):
    """The FLOP formula's per-block weights are the blocks' Linear (GPT-2: Conv1D) weights, and the
    head's are V x h: count them in the model."""
    model = meta_model(point)
    blocks = model.transformer.h if point.arch == "gpt2" else model.model.layers
    weights = sum(m.weight.numel() for m in blocks.modules()
                  if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
    assert weights == point.layers * block_matmul_params(point)
    assert model.get_output_embeddings().weight.numel() == point.vocab * point.hidden


def test_llama_flops_formula():
    """Hand count: h 8, 2 heads (head dim 4), 1 kv head, I 12, L 2, s 4, V 10, micro-batch 3, GA 2."""
    p = Point(system="no_offload", layers=2, arch="llama", hidden=8, heads=2, kv_heads=1, intermediate=12, seq=4,
              batch=3, accumulation=2, vocab=10)
    tokens = 3 * 2 * 4
    weights = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 12  # q, o; k, v (one head of 4); gate, up, down
    block_fwd = 2 * weights + 4 * 4 * 8
    model = tokens * (3 * 2 * block_fwd + 6 * 10 * 8)
    assert flops_per_step(p) == (model + tokens * 2 * block_fwd, model)


def test_accumulation_multiplies_the_step():
    p = Point(system="no_offload", layers=2, arch="llama", hidden=64, heads=4, seq=32)
    hw, model = flops_per_step(p)
    assert flops_per_step(p.with_(accumulation=8)) == (8 * hw, 8 * model)


@pytest.mark.parametrize("point", LLAMAS[1:])
def test_built_llama_has_real_rotary_frequencies_and_a_sane_loss(point):
    """build_model materialises from the meta device; RoPE's computed buffers must be recomputed."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from examples.bench.model import build_model, random_batches

    point = point.with_(vocab=256)
    model = build_model(point, torch.device("cpu"), torch.float32)
    expected = LlamaRotaryEmbedding(model.config).inv_freq
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "untied head"
    with torch.no_grad():
        loss = float(model(**random_batches(point, 1, torch.device("cpu"))[0]).loss)
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.5
