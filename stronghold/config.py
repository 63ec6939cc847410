"""The `"stronghold"` section of ds.json and the settings the rest of stronghold reads (the checks on DeepSpeed's own
keys: deepspeed_keys.py).

The section is validated the way DeepSpeed validates its own sections (a pydantic model derived from
`DeepSpeedConfigModel`, so unknown keys are rejected), and every failure becomes a `ValueError` that
names the key path and what is allowed. Optimizer, scheduler, clipping, accumulation and precision
come from the usual DeepSpeed keys, with DeepSpeed's defaults (fp16's loss scaling: loss_scale.py).

`resolve` turns the validated section into `Settings` for one device, and is the only place that reads the string
"auto": what can be decided from the section and the device alone is decided there (the CPU defaults), and what
needs measurements (the placement on a GPU, a long sequence at the first forward) becomes None, which the module
that decides it later reads as "stronghold's choice" (tests/test_package.py checks that no other module compares
with "auto").
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Literal, Mapping, Optional, Union

import torch
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError


SECTION = "stronghold"


class StrongholdConfig(DeepSpeedConfigModel):
    """Knobs of the working-window engine (the `"stronghold"` section of ds.json)."""

    window_size: Union[Literal["auto"], Annotated[int, Field(ge=2)]] = "auto"
    """Streamed blocks that may be on the GPU at once (GPU slots). Larger hides more transfer
    latency at the cost of `window_size` x (largest block's bytes) of GPU memory. "auto": the
    planner's choice (placement.py): the fewest slots that hide one block's load behind compute,
    within GPU memory. A number is honoured, clamped with a warning to the streamed block count."""

    resident_blocks: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"
    """Leading blocks whose params, grads and optimizer states stay on the GPU and are updated
    there by a fused optimizer. Their backward runs last, so they hide the CPU optimizer's tail.
    Equal to the block count means no offload at all. "auto": as many as the GPU holds beside the
    activations measured in the first step (placement.py). A number is honoured and checked
    against the GPU budget."""

    pin_memory: bool = True
    """Page-lock the host buffers that the GPU copies from and to (working copies, gradients).
    Without it transfers are synchronous and much slower; only turn off where pinning fails."""

    cpu_optimizer_threads: Optional[int] = Field(None, ge=1)
    """Threads of the CPU AdamW; None means all cores this process may use but one (left to the
    thread that launches GPU work). With several ranks on a node each uses its share of the node's
    cores (engine/cores.py), so None means that share but one."""

    gpu_memory_limit_gb: Optional[float] = Field(None, gt=0)
    """Cap this process's GPU memory (GiB) with torch.cuda.set_per_process_memory_fraction, to
    emulate a smaller card. None leaves the card as it is."""

    host_memory_limit_gb: Optional[float] = Field(None, gt=0)
    """Plan the host memory as if this job had at most this much (GiB, counting what the process already
    holds): to emulate a smaller host, or to leave room for other work (data loaders, another job). The
    budget is the least of this and the memory available. None: the memory available."""

    kernels: Union[StrictBool, Literal["auto"], list[str]] = "auto"
    """Swap the blocks' compute for stronghold_ops' Triton kernels (norms, activations, rotary, fused
    linear + cross-entropy): "auto" (the model family's defaults, those that won end to end in the
    training step: stronghold_ops.default_kernels), true (all that apply to the model), false, or a list
    of kernel names.
    Applied when training on a GPU only: on the CPU, Triton's interpreter is for tests, far too slow
    to train with (call stronghold_ops.apply(model) yourself to force it)."""

    @field_validator("kernels", mode="before")
    @classmethod
    def _known_kernels(cls, value):
        # Before the union's own validation, so a wrong value is one message with the valid names rather
        # than one line per alternative of the union.
        from stronghold_ops import KINDS
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise ValueError(f"unknown kernels {unknown}; pick from {list(KINDS)}")
            return value
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"should be true, false, \"auto\" or a list of kernel names from {list(KINDS)}")

    compile: Union[StrictBool, Literal["auto"]] = "auto"
    """Compile each transformer block's forward with torch.compile (integrations/compile.py): regional compilation,
    one compiled code shared by every block, so compile time does not grow with depth; Inductor fuses the blocks'
    elementwise work into Triton kernels. "auto": on a CUDA GPU for the block families whose compiled step
    measured faster end to end (compile.AUTO_BLOCKS: Llama, GPT-2), eager otherwise and on the CPU; true: on, on the
    CPU too; false: eager. Where compiling fails the blocks run eager, with a warning that says why. The first step
    pays the compile (reported as "compile" in the engine's report); Inductor's on-disk cache
    (TORCHINDUCTOR_CACHE_DIR) shortens it in later runs. Compiled blocks under HF's default non-reentrant
    checkpointing are checkpointed reentrantly (integrations/reentrant.py): the forward runs the compiled inference
    graph."""

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_setting(cls, value):
        # One message with the allowed values rather than one line per alternative of the union.
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError("should be true, false or \"auto\"")

    stall_timeout_s: float = Field(600.0, gt=0)
    """Seconds a wait on the CPU optimizer (a block's update, its gradients landing on the host, its
    gradient buffer coming free) may take before it fails with a TimeoutError naming the block and the
    stage, instead of hanging. One block's update takes well under a second on any machine measured;
    raise it only for a very slow or oversubscribed host."""

    garbage_collection: Union[Literal["auto", "python"], Annotated[StrictInt, Field(ge=1)]] = "auto"
    """When Python's full garbage collections run (collector.py). "auto": at optimizer-step boundaries, on every
    data-parallel rank at the same step, as often as keeps them to about 1% of the step time (timed at the second
    step) and at most 30 s apart; the interpreter's own full collections are off meanwhile (its young ones run as
    always). A number: at every that many optimizer steps. "python": the interpreter's own, which pause a rank at
    steps of their choosing (0.2-0.7 s on a large model), a step lost for every rank in data parallel. A script that
    disabled the collector itself is left alone; from Python 3.14 (incremental collection) "auto" is "python"."""

    offload_activations: Union[StrictBool, Literal["auto"], Annotated[StrictInt, Field(ge=0)]] = "auto"
    """Move the blocks' saved activations (with checkpointing: each block's input) to host memory in
    forward and back ahead of each block's backward (activations.py), for sequences whose activations
    do not fit the GPU. A number N: the first N blocks; true: every block but the last; false or 0:
    none. "auto": on a GPU, decided at the first training forward from the batch (long_context.py):
    every block but the last once the blocks' inputs would take over a fifth of the GPU budget, with
    chunked MLPs and the long-context kernels where those keys are "auto" too; otherwise none."""

    mlp_chunk_tokens: Union[Literal["auto"], Annotated[StrictInt, Field(ge=1)], StrictBool] = "auto"
    """Compute each block's MLP over the sequence in chunks of this many tokens (mlp_chunks.py), so one
    block's backward holds one chunk's MLP intermediates: for long sequences. "auto": only in runs that
    offload activations, and only for calls whose MLP intermediate exceeds 1 GiB (chunks of <= 256 MiB);
    false: never."""

    @field_validator("mlp_chunk_tokens")
    @classmethod
    def _chunks_off_or_sized(cls, value):
        if value is True:
            raise ValueError("true names no chunk size: give a number of tokens, \"auto\" or false")
        return value

    lean_blocks: Union[Literal["auto"], Annotated[StrictInt, Field(ge=0)]] = "auto"
    """Streamed blocks (the first ones after the resident blocks) whose gradients land in their host working
    copy instead of a separate buffer: 14 host bytes per parameter instead of 16, for models whose streamed
    blocks do not fit host memory otherwise. Their CPU updates wait for step() (overlapping the next
    forward rather than backward). "auto": the fewest that make the plan fit host memory, none when it
    fits (on a GPU; none on the CPU). Needs bf16/fp16 without gradient accumulation on one rank."""

    gradient_spares: Union[Literal["auto"], StrictBool] = "auto"
    """With gradient accumulation on the host: a second gradient buffer per streamed block (2 host bytes per
    parameter in bf16), so that one micro-step's gradients wait in it while the next one's land and the CPU adds
    both in one pass over the fp32 accumulator. "auto": kept where the plan fits host memory with them, dropped
    where it fits only without them (on a GPU; kept on the CPU)."""

    compact_master: Union[Literal["auto"], StrictBool] = "auto"
    """bf16 only: the streamed blocks keep their fp32 master as its low 16 bits beside the bf16 working copy, which
    holds the high ones (2 host bytes per parameter less; the update runs on the halves, a redo or undo merges and
    splits them, and an exact rounding tie moves the master one ulp). "auto": only where the plan fits host memory in no
    other way (on a GPU; off on the CPU). Not with lean blocks."""

    pooled_grads: Union[Literal["auto"], StrictBool] = "auto"
    """With gradient accumulation on the host: the streamed blocks share four landing buffers of the largest block's
    gradients instead of one each (2 host bytes per parameter less in bf16; backward then runs at most four blocks
    ahead of the CPU's sums, and a backward that fails after some blocks were summed skips its window's step).
    "auto": only where the plan fits host memory in no other way, after compact masters (on a GPU; off on the CPU).
    Needs one process; no gradient spares."""

    gpu_accumulation: Union[Literal["auto"], StrictBool] = "auto"
    """With gradient accumulation: sum the streamed blocks' gradients on the GPU (an fp32 accumulator, 4
    bytes per streamed parameter, plus their gradients until each backward ends) and send them to the host
    once per optimizer step, instead of every micro-step to be summed by the CPU (device_accum.py). "auto":
    on a GPU, off for the first step, then the planner's choice with the rates measured in it (on where its
    plan predicts the faster step; so off when both "resident_blocks" and "window_size" are numbers, which
    leave nothing to re-plan); off on the CPU. Needs accumulation > 1 and one process."""

    blockwise_backward: Union[Literal["auto"], StrictBool] = "auto"
    """With gradient accumulation: each micro-step's forward keeps every block's input and stops backward at the last
    block's output; the accumulation boundary then runs backward block by block, each block over every micro-batch in
    turn, its gradients summed in fp32 on the GPU and sent to the host once (blockwise.py). The streamed blocks'
    gradients leave the GPU once a step with one block's sums on the GPU at a time, where "gpu_accumulation" holds every
    block's. Keeps the blocks' inputs of every micro-batch (hidden size x tokens x 2 bytes a block and a micro-batch in
    bf16), on a GPU in page-locked host memory (kept_inputs.py). Needs accumulation > 1, one process, an input
    embedding not tied to the head where it is in the cached tier, no "gpu_accumulation", NVMe tier, lean blocks,
    pooled gradients or activation offload. "auto": on a GPU, off for the first step, then on where the plan after it
    keeps the gradients on the host and predicts the blockwise step far enough under host accumulation's
    (planning/schedule_choice.py) and nothing above rules it out; off on the CPU."""

    block_major_forward: Union[Literal["auto"], StrictBool] = "auto"
    """Under the blockwise backward, given the accumulation window's micro-batches before its first forward (the
    Trainer line hands them over; a loop of its own calls `engine.window_batches`): that forward runs each block for
    every micro-batch in turn, so each block is loaded once a window, and the later forwards skip the blocks
    (block_major.py). Keeps the last block's output of every micro-batch on the device until its forward. Models with
    dropout draw their masks in another order than plain training's. "auto": on a GPU wherever the blockwise backward
    runs (so off with "blockwise_backward" false), off on the CPU; true: also on the CPU."""

    weights_first: Union[Literal["auto"], StrictBool] = "auto"
    """When clipping defers the streamed blocks' CPU updates to step(), write each block's new compute-dtype weights
    first (the next forward waits only for those) and its fp32 state in a second pass (weights_first.py): more CPU
    work, a shorter wait. "auto": with gradient accumulation, on for a step when the CPU had the room in the step
    before; true / false: always / never (for A/B measurements). No effect in fp32 (the master is the working copy)."""

    rest_placement: Union[Literal["auto", "gpu", "host"],
                          dict[Literal["input", "output"], Literal["auto", "gpu", "host"]]] = "auto"
    """Where the parameters outside the transformer blocks keep their fp32 master and AdamW moments: "gpu" (with their
    weights and gradients, updated on the GPU), "host" (weights and gradients stay on the GPU, the master and moments
    live on the host and the CPU AdamW updates them, as a streamed block's: in bf16 12 bytes a parameter less on the
    GPU, 16 with gradient accumulation), or
    "auto": on a GPU the planner's choice per part, on the host only where the GPU plan does not fit or is predicted
    slower; "gpu" on the CPU. A mapping sets it per part: "input" (the input embeddings and what runs before the
    blocks) and "output" (final norm, LM head, what runs after); a part left out is "auto". A tied LM head is the
    input embedding's weight: one master, one update, in the "input" part. With data parallel each rank keeps its
    shard of the host states, as of a streamed block's."""

    @field_validator("rest_placement", mode="before")
    @classmethod
    def _placement_per_part(cls, value):
        tiers, parts = ("auto", "gpu", "host"), ("input", "output")
        ok = value in tiers if isinstance(value, str) else isinstance(value, Mapping) and all(
            part in parts and tier in tiers for part, tier in value.items())
        if not ok:
            raise PydanticCustomError("rest_placement", "Input should be \"auto\", \"gpu\", \"host\" or a mapping of "
                                      "\"input\" / \"output\" to one of them")
        return value

    nvme_path: Optional[str] = None
    """A directory on an NVMe drive for the NVMe tier (streaming/nvme.py): the fp32 master (bf16/fp16) and AdamW
    moments of the last streamed blocks live in files there (a directory of the run's own, removed when the engine
    is destroyed or the process exits), read ahead into a few host staging buffers and written back behind the CPU
    AdamW: 12 host bytes a parameter less in bf16 (8 in fp32), for models whose states do not fit host memory. The
    drive's read and write rates are measured once (cached in the directory) for the planner's floor term. None: no
    tier. Needs one process (no data parallel)."""

    nvme_blocks: Union[Literal["auto"], Annotated[StrictInt, Field(ge=0)]] = "auto"
    """Streamed blocks (the last ones) whose states go to `nvme_path`. "auto": the fewest that make the plan fit
    host memory (none when it fits, and none without `nvme_path`); a number N: the last N streamed blocks (clamped to
    the streamed count), which needs `nvme_path`."""

    nvme_buffers: Union[Literal["auto"], Annotated[StrictInt, Field(ge=2)]] = "auto"
    """Host staging buffers of the NVMe tier, each the largest NVMe block's state file (10-12 bytes a parameter in
    bf16): one held by the CPU update, one written back behind it, the rest read ahead. More hide a slower drive's
    latency at that cost in host memory. "auto": 4, or fewer (down to 2) where that keeps a block's states off the
    drive (each drive block costs its states' read and write every step)."""

    @model_validator(mode="after")
    def _nvme_blocks_need_a_path(self):
        if self.nvme_path is None and self.nvme_blocks not in ("auto", 0):
            raise ValueError(f"nvme_blocks {self.nvme_blocks} puts blocks' states on a drive but nvme_path is not set; "
                             "set \"nvme_path\" to a directory on the drive, or \"nvme_blocks\" to \"auto\" or 0")
        return self

    @model_validator(mode="after")
    def _pooled_grads_have_no_spares(self):
        if self.pooled_grads is True and self.gradient_spares is True:
            raise ValueError("pooled_grads shares the landing buffers that gradient_spares doubles per block: set "
                             "\"gradient_spares\" to \"auto\" or false, or \"pooled_grads\" to \"auto\" or false")
        return self

    @model_validator(mode="after")
    def _block_major_needs_the_blockwise_backward(self):
        if self.block_major_forward is True and self.blockwise_backward is False:
            raise ValueError("block_major_forward runs the forwards of the blockwise backward's accumulation window, "
                             "which blockwise_backward false turns off: set \"blockwise_backward\" to \"auto\" or "
                             "true, or \"block_major_forward\" to false")
        return self

    @model_validator(mode="after")
    def _compact_master_is_never_lean(self):
        if self.compact_master is True and self.lean_blocks not in ("auto", 0):
            raise ValueError(f"compact_master keeps a master's high half in the working copy, where lean blocks' "
                             f"gradients land: set \"lean_blocks\" to \"auto\" or 0 (got {self.lean_blocks}), or "
                             "\"compact_master\" to \"auto\" or false")
        return self

    blocks_path: Optional[str] = None
    """Dotted path of the transformer block list inside the model (e.g. "model.layers"), for
    models the automatic discovery does not know. None means discover."""


_AUTO_KEYS = ("garbage_collection", "window_size", "resident_blocks", "offload_activations", "mlp_chunk_tokens", "lean_blocks",
              "gradient_spares", "compact_master", "pooled_grads", "gpu_accumulation", "weights_first", "nvme_blocks")


CPU_DEFAULTS = (1, 4)
"""(resident_blocks, window_size) for "auto" on a CPU device: there is no device memory to plan, and these keep the
streaming path (one resident block, a window over the rest) that the CPU tests exercise."""


@dataclass(frozen=True)
class Settings:
    """The "stronghold" section as the rest of stronghold reads it: every "auto" resolved for one device (`resolve`).
    None means stronghold's choice, made later from measurements by the module named; the other keys are the
    section's values."""

    resident_blocks: Optional[int]
    """None: planned (GPU: initial_plan.py, then placement.py); CPU_DEFAULTS on the CPU."""
    window_size: Optional[int]
    """None: planned (GPU); CPU_DEFAULTS on the CPU."""
    auto_window: bool
    """The window is stronghold's choice (clamped to the streamed blocks without the warning a given number gets)."""
    lean_blocks: Optional[int]
    """None: the fewest that make the plan fit host memory (GPU); 0 on the CPU."""
    gradient_spares: Optional[bool]
    """None: kept where the plan fits host memory with them (GPU); kept on the CPU."""
    compact_master: Optional[bool]
    """None: only where the plan fits host memory in no other way (GPU); off on the CPU."""
    pooled_grads: Optional[bool]
    """None: only where the plan fits host memory in no other way (GPU); off on the CPU."""
    gpu_accumulation: Optional[bool]
    """None: off for the first step, then the planner's choice (GPU); off on the CPU."""
    nvme_blocks: Optional[int]
    """None: the fewest that make the plan fit host memory."""
    weights_first: Optional[bool]
    """None: decided each step by the CPU optimizer (weights_first.py)."""
    rest_placement: Mapping[str, Optional[str]]
    """Per part ("input", "output"): "gpu", "host", or None (the planner's choice, GPU); "gpu" on the CPU."""
    offload_activations: Union[None, bool, int]
    """None: none until the first training forward, where a long sequence turns it on (GPU: long_context.py)."""
    mlp_chunk_tokens: Union[None, Literal[False], int]
    """None: chunk long calls in runs that offload activations (mlp_chunks.py); False: never."""
    kernels: Union[None, bool, tuple[str, ...]]
    """None: the model family's defaults (stronghold_ops.default_kernels; kernels.py); True: all; False: none."""
    compile: Optional[bool]
    """None: by the block classes (compile.py; GPU); off on the CPU."""
    pin_memory: bool
    cpu_optimizer_threads: Optional[int]
    gpu_memory_limit_gb: Optional[float]
    host_memory_limit_gb: Optional[float]
    stall_timeout_s: float
    garbage_collection: Union[None, int, Literal["python"]]
    """None: at step boundaries, the interval timed (collector.py); a number of optimizer steps; "python": the
    interpreter's own collector."""
    nvme_path: Optional[str]
    nvme_buffers: Optional[int]
    """None: "auto" (the planner's choice; the NVMe tier's default without a plan)."""
    blocks_path: Optional[str]
    blockwise_backward: Optional[bool] = False
    """Backward block by block at the accumulation boundary (blockwise.py). None: off for the first step, then the
    placement's choice (GPU; schedule_choice.py); off on the CPU."""
    block_major_forward: bool = False


def resolve(config: StrongholdConfig, device: torch.device) -> Settings:
    """`config` as the settings of an engine on `device` (see `Settings`)."""
    gpu = device.type == "cuda"

    def chosen(value, on_cpu=None):
        # "auto": None on a GPU (decided later, from measurements), `on_cpu` on a CPU device (None: decided later
        # there too).
        return value if value != "auto" else None if gpu else on_cpu

    placement = config.rest_placement
    parts = {part: placement if isinstance(placement, str) else placement.get(part, "auto")
             for part in ("input", "output")}
    return Settings(
        resident_blocks=chosen(config.resident_blocks, CPU_DEFAULTS[0]),
        window_size=chosen(config.window_size, CPU_DEFAULTS[1]),
        auto_window=config.window_size == "auto",
        lean_blocks=chosen(config.lean_blocks, 0),
        gradient_spares=chosen(config.gradient_spares, True),
        compact_master=chosen(config.compact_master, False),
        pooled_grads=chosen(config.pooled_grads, False),
        gpu_accumulation=chosen(config.gpu_accumulation, False),
        nvme_blocks=chosen(config.nvme_blocks),
        weights_first=chosen(config.weights_first),
        rest_placement=MappingProxyType({part: chosen(tier, "gpu") for part, tier in parts.items()}),
        offload_activations=chosen(config.offload_activations),
        mlp_chunk_tokens=chosen(config.mlp_chunk_tokens),
        kernels=tuple(config.kernels) if isinstance(config.kernels, list) else chosen(config.kernels),
        compile=chosen(config.compile, False),
        pin_memory=config.pin_memory, cpu_optimizer_threads=config.cpu_optimizer_threads,
        gpu_memory_limit_gb=config.gpu_memory_limit_gb, host_memory_limit_gb=config.host_memory_limit_gb,
        stall_timeout_s=config.stall_timeout_s, garbage_collection=None if config.garbage_collection == "auto" else config.garbage_collection,
        nvme_path=config.nvme_path,
        nvme_buffers=None if config.nvme_buffers == "auto" else config.nvme_buffers,
        blocks_path=config.blocks_path, blockwise_backward=chosen(config.blockwise_backward, False),
        block_major_forward=(gpu and config.blockwise_backward is not False if config.block_major_forward == "auto"
                             else config.block_major_forward))


def without_auto(section: Mapping[str, Any]) -> dict:
    """The section's keys set to something other than "auto" (a key at "auto" says what leaving it out says)."""
    return {key: value for key, value in section.items() if value != "auto"}


def _key_path(loc: tuple) -> str:
    return ".".join([SECTION, *[str(part) for part in loc]])


def parse_stronghold_section(ds_config: Mapping[str, Any]) -> StrongholdConfig:
    """Validate the `"stronghold"` section of a ds.json dict (absent means all defaults)."""
    section = ds_config.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"'{SECTION}' must be a JSON object of stronghold settings, got {type(section).__name__}")
    try:
        return StrongholdConfig(**section)
    except ValidationError as err:
        problems: dict[str, str] = {}
        for item in err.errors():
            loc = item["loc"]
            if item["type"] == "extra_forbidden":
                allowed = ", ".join(sorted(StrongholdConfig.model_fields))
                problems[_key_path(loc)] = f"{_key_path(loc)}: unknown key; allowed keys are {allowed}"
                continue
            # A key that takes "auto" or a number fails once per alternative: one line with both.
            key = loc[0] if len(loc) > 1 and loc[0] in _AUTO_KEYS else loc
            path = _key_path(key if isinstance(key, tuple) else (key,))
            if item["type"] == "value_error":  # our validators' messages say what is allowed themselves
                problems[path] = f"{path}: {item['msg'].removeprefix('Value error, ')} (got {item.get('input')!r})"
                continue
            message = item["msg"].removeprefix("Input should be ").removeprefix("input should be ")
            if path in problems:
                problems[path] = problems[path].replace(" (got", f" or {message} (got", 1)
            else:
                problems[path] = f"{path}: should be {message} (got {item.get('input')!r})"
        problems = list(problems.values())
        raise ValueError("invalid stronghold configuration:\n  " + "\n  ".join(problems)) from None
