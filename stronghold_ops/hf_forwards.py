"""Forward functions that `stronghold_ops.apply` binds onto HF module instances.

Each is a drop-in `forward` for one HF module class, computing what HF's does with the Triton ops.
They read every weight from the module's Parameters at call time (the engine swaps `param.data`
between host and GPU storage, so nothing derived from a weight may be kept between calls) and keep
HF's call signatures and return values, so the enclosing HF code, gradient checkpointing included,
does not notice the swap.

The CausalLM forward changes one documented thing: with `labels`, the loss comes from the fused
head + cross-entropy and `logits` is None (never materialising [tokens, vocab] is the point). Without
`labels`, or with `return_logits=True` (a keyword this forward consumes), or with a non-zero
`logits_to_keep`, HF's own forward runs and returns logits as usual.
"""
import dataclasses
import functools
import inspect
import sys
from typing import NamedTuple

import torch

from .activation import gelu_tanh, swiglu
from .linear_cross_entropy import fused_linear_cross_entropy
from .norm import layer_norm, rms_norm
from .rope import rope

# Instance attribute holding the `forward` found in the instance's __dict__ before patching (an
# accelerate hook, say), or None when the class's forward was in effect. `unapply` restores from it.
SAVED_FORWARD = "_stronghold_ops_saved_forward"
# Instance attribute holding the `CallSpec` of a patched CausalLM module (set by `apply`, removed by
# `unapply`).
CALL_SPEC = "_stronghold_ops_call_spec"


def original_forward(module):
    """The forward that was in effect before `apply`, bound to `module`."""
    saved = module.__dict__.get(SAVED_FORWARD)
    return saved if saved is not None else type(module).forward.__get__(module)


def rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def layer_norm_forward(self, hidden_states):
    return layer_norm(hidden_states, self.weight, self.bias, self.eps)


def swiglu_mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def gelu_mlp_forward(self, hidden_states):
    """GPT2MLP: c_fc (a Conv1D, weight [in, out]) without its bias, which the GeLU kernel adds."""
    pre_activation = torch.matmul(hidden_states, self.c_fc.weight)
    return self.dropout(self.c_proj(gelu_tanh(pre_activation, self.c_fc.bias)))


@functools.lru_cache(maxsize=None)
def _attention_lookup(module_class):
    """`implementation name -> attention function` for the attention modules of `module_class`, whose
    family's modeling file defines the eager fallback. Resolved once per class: this runs per layer and
    step. Only the name is looked up per call, as the model's attention implementation can be switched."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[module_class.__module__].eager_attention_forward
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # transformers with AttentionInterface.get_interface
        return lambda implementation: ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
    return lambda implementation: eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]


@functools.lru_cache(maxsize=None)
def _cache_takes_kwargs(module_class) -> bool:
    """Whether HF's attention forward of `module_class` takes the KV cache as `cache` and hands the attention
    kwargs to `Cache.update` (transformers 5.24 on; before, `past_key_values` and no kwargs). Resolved once per
    class, from the class's own forward (its deprecation wrapper keeps the wrapped signature)."""
    return "cache" in inspect.signature(module_class.forward).parameters


def rotary_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                             past_key_values=None, cache=None, **kwargs):
    """LlamaAttention / Qwen2Attention / MistralAttention with the rotary embedding as one kernel. The KV cache
    comes as `cache` from transformers 5.24 on and as `past_key_values` before: either is taken."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = rope(query, key, cos, sin)
    cache = cache if cache is not None else past_key_values
    if cache is not None:
        if _cache_takes_kwargs(type(self)):
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        else:
            key, value = cache.update(key, value, self.layer_idx)
    # Qwen2 sets a per-layer window on the module, Mistral reads its config, Llama has neither.
    window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
    if window is not None:
        kwargs["sliding_window"] = window
    output, weights = _attention_lookup(type(self))(self.config._attn_implementation)(
        self, query, key, value, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
    )
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class CallSpec(NamedTuple):
    """What `causal_lm_forward` needs of the original forward's signature, inspected once by `apply`
    (inspecting on every call is host time on every training step)."""

    signature: inspect.Signature
    var_keyword: str | None  # the name of its **kwargs parameter, if it has one
    output_type: type  # the ModelOutput dataclass it returns
    output_fields: tuple[str, ...]


def call_spec(module) -> CallSpec:
    """The CallSpec of `module`'s original forward (`_skip_reason` has checked its return annotation)."""
    signature = inspect.signature(original_forward(module))
    var_keyword = next((name for name, parameter in signature.parameters.items()
                        if parameter.kind is inspect.Parameter.VAR_KEYWORD), None)
    output_type = signature.return_annotation
    return CallSpec(signature, var_keyword, output_type, tuple(f.name for f in dataclasses.fields(output_type)))


def causal_lm_forward(self, *args, return_logits=False, **kwargs):
    """HF CausalLM forward with the loss from the fused head + cross-entropy (see the module doc)."""
    forward = original_forward(self)
    spec = self.__dict__[CALL_SPEC]
    # Bound on every call: `labels` and the rest may come positionally.
    arguments = dict(spec.signature.bind(*args, **kwargs).arguments)
    extra = dict(arguments.pop(spec.var_keyword, {})) if spec.var_keyword is not None else {}
    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    head = self.get_output_embeddings()
    if labels is None or return_logits or not (isinstance(logits_to_keep, int) and logits_to_keep == 0) \
            or head.bias is not None:
        return forward(*args, **kwargs)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    # HF hands its **kwargs to both the base model and the loss; so does this.
    outputs = self.base_model(**arguments, **extra)
    hidden = outputs.last_hidden_state
    shift_labels = extra.get("shift_labels")
    loss = fused_linear_cross_entropy(
        hidden.to(head.weight.dtype), head.weight,
        labels if shift_labels is None else shift_labels.to(labels.device),
        shift=shift_labels is None, ignore_index=extra.get("ignore_index", -100),
        num_items_in_batch=extra.get("num_items_in_batch"),
    )
    fields = {name: getattr(outputs, name, None) for name in spec.output_fields}
    result = spec.output_type(**{**fields, "loss": loss, "logits": None})
    return result if return_dict else result.to_tuple()
