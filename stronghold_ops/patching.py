"""`apply(model)` / `unapply(model)`: swap the block compute of an HF model's instances for the kernels.

Only the instances inside the model passed are touched: each patched module gets an instance-level
`forward` (from `hf_forwards`) that shadows its class's. Classes, other models in the process and
torch/transformers globals are left alone. Parameters are not moved, copied, renamed or wrapped, so
`state_dict` keys, optimizer state, checkpoints and the engine's `param.data` swaps are unaffected.
`unapply(model)` deletes those instance attributes again (restoring any instance-level forward that
was there before, such as an accelerate hook).
"""
import dataclasses
import inspect
import logging
import types

from torch import nn

from . import _runtime as rt
from . import hf_forwards as fw

logger = logging.getLogger("stronghold_ops")

# The forward each kind of patch binds onto a module; its keys, in this order, are the kinds.
_FORWARDS = {
    "rms_norm": fw.rms_norm_forward,
    "layer_norm": fw.layer_norm_forward,
    "swiglu": fw.swiglu_mlp_forward,
    "gelu_tanh": fw.gelu_mlp_forward,
    "rope": fw.rotary_attention_forward,
    "fused_linear_cross_entropy": fw.causal_lm_forward,
}
KINDS = tuple(_FORWARDS)

# Instance attribute naming the kind of patch a module carries.
PATCH_MARK = "_stronghold_ops_patch"

_SILU_ACTS = ("silu", "swish")
_GELU_TANH_ACTS = ("gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class _Family:
    """Which module classes of one HF model family get which kernel (matched by class name)."""

    rms_norm: tuple[str, ...] = ()
    layer_norm: bool = False  # every torch.nn.LayerNorm in the model
    swiglu: tuple[str, ...] = ()
    gelu_tanh: tuple[str, ...] = ()
    rope: tuple[str, ...] = ()
    fused_linear_cross_entropy: tuple[str, ...] = ()  # the CausalLM classes
    kept: tuple[tuple[str, str], ...] = ()  # (class name, why it keeps HF's forward)
    defaults: tuple[str, ...] = ()
    """The kinds `apply(model, kernels="auto")` patches: those that won inside the engine's training step
    for this family (the end-to-end A/B, `python -m examples.bench kernels`), not in a kernel micro-benchmark."""


# Defaults per family, from the end-to-end A/B inside the engine on an H100 (two runs on two machines, the second
# with 8 timed steps and each set twice in one run; docs/results.md). A set is on by default only if it made the
# training step >= 1.05x faster than no kernels; none did:
# GPT-2 (h2048, 32 GiB cap): all 0.86x, the fused LM head + cross-entropy alone 1.00x, tanh-GeLU 0.95x;
# Llama (h2560, seq 2048, accumulation 8): all 0.99x and 1.05x in two runs, the fused head alone 0.93x,
# each other kernel alone 0.79-0.91x.
GPT2_DEFAULTS = ()
LLAMA_DEFAULTS = ()
# Long sequences (the engine's sign: activations offloaded to the host) get every kernel of the family,
# the set with which a Llama 2.7 B reached seq 131072 under a 32 GiB cap (H100): the fused head never
# materialises the logits (seq x vocab in bf16 plus an fp32 upcast, 23 GiB at seq 131072), and the fused
# activation keeps one MLP intermediate fewer. Memory, not speed.


def _llama_like(prefix: str) -> _Family:
    return _Family(
        rms_norm=(f"{prefix}RMSNorm",), swiglu=(f"{prefix}MLP",), rope=(f"{prefix}Attention",),
        fused_linear_cross_entropy=(f"{prefix}ForCausalLM",), defaults=LLAMA_DEFAULTS,
    )


FAMILIES = {
    "llama": _llama_like("Llama"),
    "mistral": _llama_like("Mistral"),
    "qwen2": _llama_like("Qwen2"),
    "gpt2": _Family(
        layer_norm=True, gelu_tanh=("GPT2MLP",), fused_linear_cross_entropy=("GPT2LMHeadModel",),
        kept=(("GPT2Attention", "GPT-2 has no rotary embedding; attention stays HF's"),), defaults=GPT2_DEFAULTS,
    ),
}


@dataclasses.dataclass
class PatchReport:
    """What `apply` did: module names per kernel kind, and what it left alone and why."""

    model_class: str
    model_type: str
    patched: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    not_patched: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def num_patched(self) -> int:
        return sum(len(names) for names in self.patched.values())

    def __str__(self) -> str:
        lines = [f"stronghold_ops.apply({self.model_class}, model_type={self.model_type!r}): "
                 f"{self.num_patched} modules patched"]
        for kind, names in sorted(self.patched.items(), key=lambda item: KINDS.index(item[0])):
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            lines.append(f"  patched  {kind:<27} x{len(names):<4} {shown}")
        for what, why in self.not_patched:
            lines.append(f"  not patched  {what}: {why}")
        lines.append("  everything else (linear layers, embeddings, attention scores) runs HF's code")
        return "\n".join(lines)


def _skip_reason(kind: str, module: nn.Module, model: nn.Module) -> str | None:
    """Why this module, though of a matching class, cannot take the kernel (None: it can)."""
    if kind == "rms_norm":
        ok = isinstance(getattr(module, "weight", None), nn.Parameter) and hasattr(module, "variance_epsilon")
        return None if ok else "no `weight` Parameter or `variance_epsilon`"
    if kind == "layer_norm":
        if module.weight is None or len(module.normalized_shape) != 1:
            return "LayerNorm without affine weight, or over more than the last dim"
        return None
    if kind == "swiglu":
        act = getattr(module.config, "hidden_act", None)
        return None if act in _SILU_ACTS else f"hidden_act={act!r} is not SiLU"
    if kind == "gelu_tanh":
        act = getattr(model.config, "activation_function", None)
        return None if act in _GELU_TANH_ACTS else f"activation_function={act!r} is not tanh-GeLU"
    if kind == "rope":
        return None
    # The CausalLM module itself: the model passed, or a submodule of a wrapper that carries its config.
    head = module.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return "the output head is not a bias-free nn.Linear"
    returns = inspect.signature(fw.original_forward(module)).return_annotation
    if not (dataclasses.is_dataclass(returns) and {"loss", "logits"} <= {f.name for f in dataclasses.fields(returns)}):
        return f"forward's return annotation {returns!r} is not a ModelOutput with loss and logits"
    return None


def _kind_of(module: nn.Module, family: _Family) -> str | None:
    name = type(module).__name__
    if family.layer_norm and isinstance(module, nn.LayerNorm):
        return "layer_norm"
    for kind in ("rms_norm", "swiglu", "gelu_tanh", "rope", "fused_linear_cross_entropy"):
        if name in getattr(family, kind):
            return kind
    return None


def _with_signature_of(impl, module: nn.Module):
    """A copy of `impl` that reports the signature of the forward it replaces: callers that inspect
    `model.forward` (HF Trainer keeps only the dataset columns it names) see the original arguments."""
    copy_ = types.FunctionType(impl.__code__, impl.__globals__, impl.__name__, impl.__defaults__,
                               impl.__closure__)
    copy_.__kwdefaults__ = impl.__kwdefaults__
    copy_.__doc__ = impl.__doc__
    original = inspect.signature(type(module).forward)
    params = list(original.parameters.values())
    if "return_logits" in inspect.signature(impl).parameters and "return_logits" not in original.parameters:
        extra = inspect.Parameter("return_logits", inspect.Parameter.KEYWORD_ONLY, default=False)
        tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD] + [extra] + tail
    copy_.__signature__ = original.replace(parameters=params)
    return copy_


def _patch(module: nn.Module, kind: str) -> None:
    module.__dict__[fw.SAVED_FORWARD] = module.__dict__.get("forward")
    module.__dict__[PATCH_MARK] = kind
    if kind == "fused_linear_cross_entropy":
        module.__dict__[fw.CALL_SPEC] = fw.call_spec(module)  # after SAVED_FORWARD, which it inspects
    # A bound method in the instance dict: shadows the class's forward for this instance only, and
    # copy.deepcopy rebinds it to the copy.
    module.__dict__["forward"] = types.MethodType(_with_signature_of(_FORWARDS[kind], module), module)


def apply(model: nn.Module, kernels=None, strict: bool = False) -> PatchReport:
    """Patch `model`'s modules in place with the Triton kernels; returns a printable report.

    kernels: the kinds to apply (a subset of `KINDS`); all by default; "auto": the family's defaults
        (`default_kernels(model)`).
    strict: raise ValueError when the model family is unsupported or the kernels cannot run here,
        instead of logging a warning and returning a report with nothing patched.
    """
    kinds = set(KINDS if kernels is None else default_kernels(model) if kernels == "auto" else kernels)
    if kinds - set(KINDS):
        raise ValueError(f"stronghold_ops.apply: unknown kernels {sorted(kinds - set(KINDS))}; choose from {KINDS}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    report = PatchReport(type(model).__name__, str(model_type))
    family = FAMILIES.get(model_type)
    problem = rt.unavailable_reason()
    if family is None:
        problem = (f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))}); "
                   f"the model runs unchanged")
    if problem is not None:
        report.not_patched.append(("all modules", problem))
        if strict:
            raise ValueError(str(report))
        logger.warning("%s", report)
        return report
    kept = dict(family.kept)
    for name, module in model.named_modules():
        label = name or "<model>"
        if type(module).__name__ in kept:
            report.not_patched.append((label, kept[type(module).__name__]))
            continue
        kind = _kind_of(module, family)
        if kind is None:
            continue
        if kind not in kinds:
            report.not_patched.append((label, f"{kind} not requested"))
        elif PATCH_MARK in module.__dict__:
            report.not_patched.append((label, f"already patched ({module.__dict__[PATCH_MARK]})"))
        elif (reason := _skip_reason(kind, module, model)) is not None:
            report.not_patched.append((label, reason))
        else:
            _patch(module, kind)
            report.patched.setdefault(kind, []).append(label)
    logger.info("%s", report)
    return report


def default_kernels(model: nn.Module, long_context: bool = False) -> tuple[str, ...]:
    """The kernels on by default for this model's family (none for a family stronghold_ops does not cover);
    with `long_context` (the engine passes it when activations are offloaded to the host) every kernel
    the family has, for their memory savings (see the defaults table above)."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is None:
        return ()
    if long_context:
        return tuple(kind for kind in KINDS if getattr(family, kind))
    return family.defaults


def unapply(model: nn.Module) -> list[str]:
    """Undo `apply` on every module of `model`; returns the names of the modules restored."""
    restored = []
    for name, module in model.named_modules():
        if PATCH_MARK not in module.__dict__:
            continue
        saved = module.__dict__.pop(fw.SAVED_FORWARD)
        del module.__dict__[PATCH_MARK]
        module.__dict__.pop(fw.CALL_SPEC, None)
        if saved is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = saved
        restored.append(name or "<model>")
    return restored


def is_patched(module: nn.Module) -> bool:
    return any(PATCH_MARK in m.__dict__ for m in module.modules())
