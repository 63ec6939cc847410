"""The Llama shape shared by the benchmark harness and the HF Trainer script.

One place for the two Llama-only numbers, the MLP width and the key/value head count, so that
`python -m examples.bench ... --arch llama` and `examples/hf_trainer.py --arch llama` build the
same model from the same flags. transformers is imported only when a config is made: the
benchmark's parent process validates points without importing it.
"""
from __future__ import annotations

# Meta's Llama sizes its SwiGLU MLP at 2/3 of GPT's 4 x hidden (three matrices instead of two, so
# about the same parameters) rounded up to a multiple of 256 ("multiple_of" in Meta's model.py):
# hidden 4096 -> 11008 (Llama-7B), 2560 -> 6912.
FFN_MULTIPLE = 256


def default_intermediate(hidden: int) -> int:
    """Llama's MLP width for `hidden`: int(8/3 x hidden) rounded up to a multiple of 256."""
    width = 8 * hidden // 3
    return -(-width // FFN_MULTIPLE) * FFN_MULTIPLE


def check_shape(hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
    """ValueError naming the fix for a Llama shape transformers would refuse or silently misbuild."""
    if kv_heads < 1 or intermediate < 1:
        raise ValueError(f"kv_heads={kv_heads} and intermediate={intermediate} must be >= 1")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}: pick heads that divide it")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}: grouped-query attention "
                         "shares each key/value head among heads/kv_heads query heads; pick kv_heads that divides heads")


def llama_config(*, hidden: int, layers: int, heads: int, seq: int, vocab: int, intermediate: int | None = None,
                 kv_heads: int | None = None, qwen2: bool = False):
    """A transformers LlamaConfig of this shape (untied LM head, as LlamaConfig's default and Llama 2), or with
    `qwen2` a Qwen2Config (the Llama block with biases on q, k and v; untied, as Qwen2.5-7B)."""
    from transformers import LlamaConfig, Qwen2Config

    intermediate = default_intermediate(hidden) if intermediate is None else intermediate
    kv_heads = heads if kv_heads is None else kv_heads
    check_shape(hidden, heads, kv_heads, intermediate)
    return (Qwen2Config if qwen2 else LlamaConfig)(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=seq, vocab_size=vocab, use_cache=False,
        tie_word_embeddings=False,
    )
