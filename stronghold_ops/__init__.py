"""stronghold_ops: Triton kernels for the transformer block, applied to HF models in one call.

    report = stronghold_ops.apply(model)   # patch this model's instances in place; print(report)
    stronghold_ops.unapply(model)          # and back

Covers HF GPT-2, Llama, Qwen2 and Mistral: RMSNorm / LayerNorm, the SwiGLU or tanh-GeLU (+bias)
activation, rotary embedding on q and k, and the LM head fused with cross-entropy (with `labels`, the
patched CausalLM returns the loss and `logits=None`; see `hf_forwards`). Each op is also usable on its
own, beside its eager reference (`*_reference`).

Importing this package does not import Triton; the kernels import it at their first call.
"""
from .activation import gelu_tanh, gelu_tanh_reference, swiglu, swiglu_reference
from .linear_cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference
from .norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .patching import KINDS, PatchReport, apply, default_kernels, is_patched, unapply
from .rope import rope, rope_reference

__all__ = [
    "apply", "unapply", "is_patched", "default_kernels", "PatchReport", "KINDS",
    "rms_norm", "rms_norm_reference", "layer_norm", "layer_norm_reference",
    "swiglu", "swiglu_reference", "gelu_tanh", "gelu_tanh_reference",
    "rope", "rope_reference", "fused_linear_cross_entropy", "linear_cross_entropy_reference",
]
