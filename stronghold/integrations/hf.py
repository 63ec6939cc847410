"""The one-line HuggingFace Trainer integration: `stronghold.initialize(model)` before building the Trainer.

`prepare(model, config=None, blocks=None)` (what that line calls) records the model in a registry and
installs two patches of third-party entry points. Both act only on recorded models and pass every
other call through unchanged:
1. `transformers.Trainer.__init__`: a Trainer for a recorded model is built with a copy of its
   TrainingArguments whose `deepspeed=` is the config stronghold needs (`deepspeed_config`), so
   Trainer takes its DeepSpeed path: it leaves the model where it is (no `.to(device)`), and
   accelerate hands the model, Trainer's AdamW and batch settings to `deepspeed.initialize`.
2. `deepspeed.initialize` (accelerate looks it up at call time): for a recorded model it builds a
   StrongholdEngine (`stronghold.initialize`) instead of a DeepSpeedEngine.
The Trainer so built also hands each accumulation window's batches to the engine (hf_batches.py).
`unprepare(model)` forgets the model, removes its hooks and, once no recorded model is left, restores
both entry points; `with prepared(model): ...` does the same on leaving the block.

The engine also puts three hooks on the model: before `state_dict()` it waits for the CPU optimizer
and brings every block back to the host; after it, the values of trainable parameters are replaced by
the fp32 masters (so `trainer.save_model()` writes fp32 weights even in a bf16 run; frozen parameters
keep their stored dtype); and a forward under `no_grad` that bypasses the engine (Trainer's evaluation
loop calls the model directly) starts a forward walk of the window first.

Config: hf_config.py (TrainingArguments are the source of truth).
The caller's TrainingArguments object is not changed (`trainer.args` is the copy; without a GPU its
`dataloader_pin_memory` is off, as pinning needs one). Without a launcher, the single-process variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) are set as DeepSpeed's launcher would.

Several ranks (torchrun, `accelerate launch --multi_gpu`, DeepSpeed's launcher): every rank runs the line and
the engine trains data parallel; Trainer shards the data as for DDP. Without a GPU, accelerate's DeepSpeed path
counts one process, so the line counts every rank itself (`_count_cpu_ranks`), and `use_cpu=True`, which a plain
script needs there for DDP, is accepted (the device is the CPU either way).

Limits: `trainer.evaluate()` before `train()` fails as it does on Trainer's DeepSpeed path (it needs
ZeRO-3); Trainers built with `model_init` or around a wrapper of the prepared model (PEFT) are plain.
A second Trainer for the same model builds a new engine from the model as the first left it (fresh
AdamW, as plain Trainer; in a bf16 run its masters restart from the bf16 weights).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from stronghold.config import SECTION, parse_stronghold_section, resolve
from stronghold.engine.launch import deepspeed_comm_without_shm, load_config, single_process_env
from stronghold.integrations import compile as compile_module
from stronghold.integrations.hf_batches import hand_over_window_batches
from stronghold.integrations.hf_config import deepspeed_config, merge_sections, section_of

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# Set by accelerate's Accelerator for a DeepSpeed plugin and never unset; it would turn the next plain
# TrainingArguments into DeepSpeed ones, so it is restored after a stronghold Trainer is built.
ACCELERATE_FLAG = "ACCELERATE_USE_DEEPSPEED"


@dataclass
class Preparation:
    """What `prepare` recorded for one model, and what the engine built for it attached."""

    section: dict
    """The stronghold keys given to `prepare(config=...)` ("auto" values dropped)."""
    blocks: Optional[list[nn.Module]]
    trainer: Optional[weakref.ref] = None
    engine: Optional[weakref.ref] = None
    handles: list = field(default_factory=list)

    def release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


_REGISTRY: "weakref.WeakKeyDictionary[nn.Module, Preparation]" = weakref.WeakKeyDictionary()
_PATCHES: list["_Patch"] = []
_OUR_PLUGINS: list[weakref.ref] = []
"""accelerate DeepSpeedPlugins built for stronghold Trainers (DeepSpeedPlugin is unhashable)."""


def check_training_arguments(args) -> None:
    """Reject TrainingArguments that stronghold cannot honour, before anything is built."""
    if args.fp16 or args.fp16_full_eval:
        raise ValueError("TrainingArguments(fp16=True): stronghold's Trainer integration runs bf16 (bf16=True) or "
                         "fp32; fp16 with loss scaling is supported through stronghold.initialize with a ds.json "
                         "\"fp16\" section, not yet through Trainer. Use bf16=True")
    if args.bf16_full_eval:
        raise ValueError("TrainingArguments(bf16_full_eval=True) casts the whole model and moves it to the GPU for "
                         "evaluation, which is what stronghold avoids; use bf16=True (evaluation then runs in bf16)")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW_OPTIMS:
        raise ValueError(f"TrainingArguments(optim={optim!r}): stronghold implements AdamW only; use optim="
                         f"'adamw_torch' or 'adamw_torch_fused'")
    if args.torch_compile:
        raise ValueError("TrainingArguments(torch_compile=True) is not supported with stronghold, whose hooks move "
                         "blocks in and out of the GPU; set torch_compile=False")
    if args.use_cpu and torch.cuda.is_available():
        raise ValueError("TrainingArguments(use_cpu=True) turns accelerate's DeepSpeed path off; leave it False "
                         "(without a GPU stronghold runs on the CPU anyway)")
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        raise ValueError("ACCELERATE_USE_CPU is set (`accelerate launch --cpu`), which turns accelerate's DeepSpeed "
                         "path off; launch with `accelerate launch --multi_gpu --num_processes N` or torchrun (both "
                         "run on the CPU where there is no GPU)")


def _stronghold_arguments(args, prep: Preparation):
    """A copy of `args` with deepspeed= set; its construction sets up accelerate's DeepSpeed state."""
    check_training_arguments(args)
    config = deepspeed_config(load_config(args.deepspeed) if args.deepspeed else None, prep.section)
    single_process_env()  # accelerate takes its DeepSpeed path only with LOCAL_RANK set
    # Without a GPU there is nothing to pin for (torch's DataLoader ignores the flag there, with a warning); and
    # use_cpu=True (what a plain script needs for accelerate's CPU data parallel) changes no device.
    pin = {} if torch.cuda.is_available() else {"dataloader_pin_memory": False}
    new = dataclasses.replace(args, deepspeed=config, use_cpu=False, **pin)
    _count_cpu_ranks(new)
    mismatches = new.hf_deepspeed_config.mismatches
    if mismatches:
        raise ValueError("TrainingArguments and the DeepSpeed config disagree:\n" + "\n".join(mismatches) +
                         "\nTrainer's arguments are used where a key is absent or \"auto\"; remove the key from the "
                         "DeepSpeed config or make the two equal")
    _OUR_PLUGINS[:] = [ref for ref in _OUR_PLUGINS if ref() is not None] + [weakref.ref(new.deepspeed_plugin)]
    return new


def _count_cpu_ranks(args) -> None:
    """Make `args` count every rank of a launch without a GPU. accelerate's DeepSpeed path there finds no
    accelerator backend: its state says one process (num_processes 1), although DeepSpeed's init_distributed,
    which accelerate ran, joined every rank. Trainer would then neither shard the data nor count the world in
    the batch size (DeepSpeed refuses the config: "train_batch_size is not equal to micro_batch_per_gpu *
    gradient_acc_step * world_size"). The state's process counts are set from torch.distributed and the
    DeepSpeed config is filled again, as Trainer does when a hyperparameter search changes the arguments."""
    import torch.distributed as dist
    state = args.distributed_state
    if state is None or not dist.is_initialized() or state.num_processes == dist.get_world_size():
        return
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    state.backend = dist.get_backend()
    state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))
    args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(args.deepspeed)
    args.hf_deepspeed_config.trainer_config_process(args)
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)


def _leave_stronghold_state(args) -> None:
    """accelerate keeps one process-wide state. If a stronghold Trainer left it in DeepSpeed mode, redo the
    device setup of `args` (as their construction did) so this other Trainer starts from a plain state."""
    from accelerate.state import AcceleratorState
    plugins = AcceleratorState._shared_state.get("deepspeed_plugins")
    if args is None or plugins is None or not any(ref() is plugins for ref in _OUR_PLUGINS):
        return
    args.__dict__.pop("_setup_devices", None)
    args._setup_devices  # noqa: B018 - the cached property resets and rebuilds accelerate's state


# Patches ----------------------------------------------------------------------------------------------
class _Patch:
    """One reversible replacement of an attribute of a third-party module or class."""

    def __init__(self, owner: Any, name: str, wrap):
        self.owner, self.name = owner, name
        self.original = vars(owner)[name]
        self.replacement = wrap(self.original)
        setattr(owner, name, self.replacement)

    def undo(self) -> None:
        if vars(self.owner).get(self.name) is not self.replacement:
            warnings.warn(f"stronghold: {self.owner.__name__}.{self.name} was replaced again after stronghold "
                          "patched it; leaving the newer replacement in place")
            return
        setattr(self.owner, self.name, self.original)


def _lookup(model: Any) -> Optional[Preparation]:
    return _REGISTRY.get(model) if isinstance(model, nn.Module) else None


def _wrap_trainer_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        prep = _lookup(bound.arguments.get("model"))
        if prep is None:
            _leave_stronghold_state(bound.arguments.get("args"))
            return original(self, *args, **kwargs)
        from transformers import TrainingArguments
        flag = os.environ.get(ACCELERATE_FLAG)
        try:
            # accelerate sets up DeepSpeed's communication backend in here (launch.deepspeed_comm_without_shm).
            with deepspeed_comm_without_shm():
                bound.arguments["args"] = _stronghold_arguments(
                    bound.arguments.get("args") or TrainingArguments(output_dir="tmp_trainer"), prep)
                original(*bound.args, **bound.kwargs)
        finally:
            if flag is None:
                os.environ.pop(ACCELERATE_FLAG, None)
            else:
                os.environ[ACCELERATE_FLAG] = flag
        if not self.is_deepspeed_enabled:
            raise ValueError("Trainer did not take its DeepSpeed path for the stronghold model (an accelerate state "
                             "configured elsewhere, e.g. accelerator_config use_configured_state=True?); build the "
                             "Trainer without a pre-configured accelerate state")
        prep.trainer = weakref.ref(self)
        hand_over_window_batches(self)

    return __init__


def _trainer_groups(trainer, model: nn.Module, params: list) -> list[dict]:
    """Trainer's decay groups over a flat parameter list (what its create_optimizer would form)."""
    decay = set(trainer.get_decay_parameter_names(model))
    name = {id(p): n for n, p in model.named_parameters()}
    return [{"params": [p for p in params if name[id(p)] in decay]},
            {"params": [p for p in params if name[id(p)] not in decay], "weight_decay": 0.0}]


def _wrap_deepspeed_initialize(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        model = arguments.get("model")
        prep = _lookup(model)
        if prep is None:
            return original(*args, **kwargs)
        if arguments.pop("mesh_param", None) is not None:
            raise ValueError("deepspeed.initialize(mesh_param=...): tensor / sequence parallel meshes are not "
                             "supported by stronghold")
        key = "config" if arguments.get("config") is not None else "config_params"
        config = load_config(arguments[key]) if arguments.get(key) is not None else {}
        config[SECTION] = merge_sections(config.get(SECTION), prep.section)
        arguments[key] = config
        params = arguments.get("model_parameters")
        trainer = prep.trainer() if prep.trainer is not None else None
        if trainer is not None and "optimizer" in config and params is not None:
            params = list(params)
            if params and not isinstance(params[0], dict):
                arguments["model_parameters"] = _trainer_groups(trainer, model, params)
        previous = prep.engine() if prep.engine is not None else None
        if previous is not None:  # Trainer re-initializes DeepSpeed on a second train(): one engine per model
            prep.release()
            previous.destroy()
        from stronghold.engine.launch import initialize_engine
        result = initialize_engine(**arguments, blocks=prep.blocks)
        _attach(prep, model, result[0])
        return result

    return initialize


def _attach(prep: Preparation, model: nn.Module, engine) -> None:
    ref = weakref.ref(engine)

    def synchronize(module, prefix, keep_vars):
        if ref() is not None:
            ref().synchronize_host()

    def masters(module, state_dict, prefix, local_metadata):
        if ref() is None:
            return
        values = ref().stronghold_runtime.master_params()
        for name, param in module.named_parameters(remove_duplicate=False):
            if prefix + name in state_dict and id(param) in values:
                state_dict[prefix + name] = values[id(param)].detach()

    def eval_forward(module, args):
        # Not the engine's own collecting pass through the model (engine/block_major.py), which runs without grad too.
        if ref() is not None and not torch.is_grad_enabled() and not ref().stronghold_runtime.blocks_inert:
            ref().stronghold_runtime.begin_forward(training=False)

    prep.handles = [model.register_state_dict_pre_hook(synchronize), model.register_state_dict_post_hook(masters),
                    model.register_forward_pre_hook(eval_forward)]
    prep.engine = ref


def _install() -> None:
    if _PATCHES:
        return
    import deepspeed
    import transformers
    _PATCHES.append(_Patch(transformers.Trainer, "__init__", _wrap_trainer_init))
    _PATCHES.append(_Patch(deepspeed, "initialize", _wrap_deepspeed_initialize))


def _uninstall() -> None:
    while _PATCHES:
        _PATCHES.pop().undo()


# Public API ---------------------------------------------------------------------------------------------
def prepare(model: nn.Module, config: Any = None, blocks: Optional[Sequence[nn.Module]] = None) -> nn.Module:
    """Make a Trainer built afterwards for `model` train through a StrongholdEngine (see the module docstring).

    `config`: stronghold section keys (dict or StrongholdConfig, or a ds.json with only that section);
    `blocks`: the transformer blocks, for models that discovery does not know. Returns `model`."""
    from stronghold.integrations.discovery import find_blocks

    if not isinstance(model, nn.Module):
        raise ValueError(f"stronghold.initialize(model) needs an nn.Module, got {type(model).__name__}")
    section = section_of(config)
    block_list = list(blocks) if blocks is not None else None
    found = find_blocks(model, block_list, section.get("blocks_path"))  # a model we cannot split fails here
    previous = _REGISTRY.get(model)
    if previous is not None:
        previous.release()
    _REGISTRY[model] = Preparation(section, block_list)
    _install()
    _start_compiler_early(found.blocks, section)
    return model


def _start_compiler_early(blocks: Sequence[nn.Module], section: dict) -> None:
    """Where the engine will compile the blocks (on this rank's GPU, the "compile" key left to stronghold or on),
    start the compiler's set-up now (compile.start_set_up): the engine is built only in Trainer's `train()`, and the
    user's script builds its Trainer and data meanwhile."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        compile_module.start_set_up(blocks, resolve(parse_stronghold_section({SECTION: section}), device).compile,
                                    device)


def unprepare(model: nn.Module) -> None:
    """Forget `model`: remove its hooks and, when no prepared model is left, restore Trainer.__init__ and
    deepspeed.initialize. An engine already built keeps training; call this when done with it."""
    prep = _REGISTRY.pop(model, None)
    if prep is not None:
        prep.release()
    if not _REGISTRY:
        _uninstall()


def is_prepared(model: nn.Module) -> bool:
    return _lookup(model) is not None


@contextlib.contextmanager
def prepared(model: nn.Module, config: Any = None, blocks: Optional[Sequence[nn.Module]] = None) -> Iterator[nn.Module]:
    """`prepare` on entry, `unprepare` on exit."""
    prepare(model, config=config, blocks=blocks)
    try:
        yield model
    finally:
        unprepare(model)
