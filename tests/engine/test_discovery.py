"""Finding the block list of the HF architectures we name, and clear errors otherwise."""
import pytest
import torch
from torch import nn

from stronghold.integrations.discovery import find_blocks

from .helpers import tiny_gpt2, tiny_llama

pytestmark = pytest.mark.newest  # the HF models' own code: run on the newest transformers too


def _tiny(name: str) -> nn.Module:
    import transformers as tf
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=3)
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **common))
    if name == "neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                              num_hidden_layers=3, word_embed_proj_dim=32))
    raise KeyError(name)


@pytest.mark.parametrize("build,path,n", [
    (lambda: tiny_gpt2(3), "transformer.h", 3),
    (lambda: tiny_llama(3), "model.layers", 3),
    (lambda: tiny_llama(3, tie=True, qwen2=True), "model.layers", 3),
    (lambda: _tiny("mistral"), "model.layers", 3),
    (lambda: _tiny("neox"), "gpt_neox.layers", 3),
    (lambda: _tiny("opt"), "model.decoder.layers", 3),
])
def test_known_architectures(build, path, n):
    model = build()
    parts = find_blocks(model)
    assert parts.path == path and len(parts.blocks) == n
    block_names = {name for names in parts.block_param_names for name in names}
    assert block_names.isdisjoint(parts.rest_param_names)
    assert len(block_names) + len(parts.rest_param_names) == len(dict(model.named_parameters()))


def test_tied_head_stays_in_the_rest():
    model = tiny_gpt2(2, tie=True)
    parts = find_blocks(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "transformer.wte.weight" in parts.rest_param_names


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)


def test_explicit_blocks_and_generic_fallback():
    model = Custom()
    assert find_blocks(model, blocks=model.stages).path == "<explicit>"
    assert find_blocks(model).path == "stages"
    assert find_blocks(model, blocks_path="stages").blocks[1] is model.stages[1]


def test_no_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="could not find the transformer block list of Sequential.*blocks="):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match="stronghold.blocks_path: 'nope'"):
        find_blocks(Custom(), blocks_path="nope")


def test_weights_shared_across_blocks_are_rejected():
    model = Custom()
    model.stages[2].weight = model.stages[0].weight
    with pytest.raises(ValueError, match="shared by blocks 0 and 2"):
        find_blocks(model)


def test_block_weight_tied_outside_the_block_is_rejected():
    model = Custom()
    model.head.weight = nn.Parameter(torch.zeros(2, 8))
    model.stages[1].weight = nn.Parameter(torch.zeros(8, 8))
    model.stem.weight = model.stages[1].weight
    with pytest.raises(ValueError, match="tied to a parameter of block 1"):
        find_blocks(model)
