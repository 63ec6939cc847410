"""Regional compilation: each transformer block's forward through torch.compile, one compiled code for all blocks.

What is compiled: the block class's `forward` function (not the module's `__call__`), installed as the block's
instance `forward` (detach restores it). So the module's hooks stay outside the compiled region: the window's forward
pre-hook (which moves the block's weights into a slot) and post-hook run eagerly around it, and HF's checkpointing,
which wraps the block's `__call__`, wraps the compiled forward too. Every block of a class runs the same compiled
function: Dynamo lifts the block's parameters into graph inputs and guards on their dtype, shape, stride, device
and requires_grad, never on their storage, so one graph serves every block wherever the window put its weights, and
a step never recompiles. Autograd's saved-tensor hooks (the window's references to slot memory, activation offload,
checkpointing) apply to what the compiled function saves at run time, as they do to eager ops.

Calls that carry a KV cache run eager: the cache is a different object per layer whose state each layer changes,
which would make every layer its own compile (generation, or a training call that passes use_cache=True). A
training call that leaves use_cache out gets use_cache=False (`training_call`): HF models keep a cache by default.
HF's non-reentrant checkpointing of the compiled blocks runs reentrant (reentrant.py), set up at each training call.

Failure: the first compiled call of each grad mode is a probe (`_probe`): the compiled forward, and with grad on its
backward (torch.autograd.grad, which leaves `.grad` and the gradient hooks alone), on detached copies of the call's
inputs, under saved-tensor hooks of its own and a forked RNG, so nothing the step keeps sees it. Where it raises,
every block runs eager from then on, with one warning naming the reason, and the step goes on unchanged. A later
recompile that fails (a new input shape) falls back the same way when Dynamo raises before running anything.

Compile time: the probe's seconds and those of later calls that compiled a graph, in the engine's report ("compile")
and logged once; the probes' by the regions torch's compiler times itself ("parts_s"). The process's one-time part
(Inductor's imports and cache keys, and on a GPU a rehearsal that compiles a block in miniature: compile_rehearsal.py)
runs on a thread from construction to the first training call or compiled call, whichever comes first
(compiler_setup.py; "set_up_s" and "set_up_rehearsal_s" in the report). Inductor keeps its compiled kernels and graphs
on disk (TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>), so a later run of the same model compiles in
a fraction of the first run's time.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import types
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from stronghold.integrations import compiler_setup, forwards
from stronghold.integrations.compiler_setup import CompilerSetUp
from stronghold.integrations.reentrant import ReentrantCheckpoints

logger = logging.getLogger(__name__)

BACKEND: Union[str, Callable] = "inductor"
"""torch.compile's backend; a seam for tests (aot_eager, a counting backend, one that raises)."""
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
"""Inductor keeps a fused chain of bf16 ops in fp32 unless told otherwise; this rounds to bf16 between the ops where
eager does, so compiled training is eager's up to the order of fp32 sums (the GPU tests hold stronghold to an eager
bf16 reference within a few times the noise of two AdamWs). The conversions sit in registers of memory-bound kernels."""
FORWARD = "_stronghold_compiled_forward"  # the block's own instance forward before compiling, if it had one
PART_MIN_S = 0.001
"""The report's compile parts leave out regions under this many seconds (passes that run in microseconds)."""
REASON_CHARS = 300
"""The fallback's reason keeps this much of the error's first line (Dynamo's can hold a whole traceback)."""
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


AUTO_BLOCKS = ("LlamaDecoderLayer", "GPT2Block")
"""Block classes that "auto" compiles on a GPU: those whose compiled step measured faster end to end than eager
(docs/results.md: Llama GA 8, GPT-2 1.72 B, where a third of the eager step's GPU time is launch gaps); other
families stay eager until measured."""


def compile_wanted(setting: Optional[bool], device: torch.device, blocks: list[nn.Module] = ()) -> bool:
    """The "compile" key as resolved (config.resolve) as a decision. None ("auto"): on when training on a CUDA GPU
    and every block is of a class in AUTO_BLOCKS; off on the CPU, where Inductor's compile takes longer than the tests'
    whole training."""
    if setting is None:
        return device.type == "cuda" and bool(blocks) and all(type(b).__name__ in AUTO_BLOCKS for b in blocks)
    return bool(setting)


def _carries_cache(args: tuple, kwargs: dict) -> bool:
    if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
        return True
    cache_utils = sys.modules.get("transformers.cache_utils")  # imported by any model that has a cache
    return cache_utils is not None and any(isinstance(arg, cache_utils.Cache) for arg in args)


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _compiler_seconds() -> dict[str, float]:
    """Seconds so far in each region torch's compiler times (Dynamo's tracing and guards, AOT autograd's cache,
    Inductor's code loading, ...), summed over its compiles; {} where this torch keeps no such table. The regions
    nest, and some run on Inductor's compile threads at once, so they do not add up to the compile."""
    table = getattr(torch._dynamo.utils, "compilation_time_metrics", None) or {}
    return {name: sum(times) for name, times in table.items()}


class CompiledBlocks:
    """Installs the compiled forward on `blocks` (instance attributes; `detach` restores them)."""

    def __init__(self, blocks: list[nn.Module], rank0: bool = True):
        self.blocks, self.rank0 = blocks, rank0
        self.backend = BACKEND
        self.installed: list[nn.Module] = []
        self.checkpoints = ReentrantCheckpoints(blocks)
        self._compiled: dict[Any, Callable] = {}
        """One compiled function per underlying forward function (one for a model whose blocks share a class)."""
        self._probed: set[bool] = set()
        """The grad modes whose first compiled call was probed."""
        self.fallback: Optional[str] = None
        """Why the blocks run eager, once compiling failed; None while compiled."""
        self.compile_s = 0.0
        """Seconds spent in calls that compiled (the probes, and later calls that compiled a graph)."""
        self.graphs = 0
        """Graphs Dynamo compiled during these blocks' calls."""
        self.parts_s: dict[str, float] = {}
        """The probes' compile (each grad mode's first call: the first step's compile) by the compiler's own timed
        regions (`_compiler_seconds`)."""
        self.eager_cache_calls = 0
        self.set_up: Optional[CompilerSetUp] = None
        """The compiler's process-wide work, on a thread from construction to the first compiled call
        (compiler_setup.py)."""
        self._logged = False
        self._cache_warned = False

    def attach(self) -> None:
        for block in self.blocks:
            if forwards.install(block, FORWARD, self._forward()):
                self.installed.append(block)

    def detach(self) -> None:
        for block in self.installed:
            forwards.restore(block, FORWARD)
        self.installed.clear()
        self.checkpoints.detach()

    def training_call(self, model: nn.Module, kwargs: dict) -> dict:
        """Before a training call: the blocks' checkpointing made reentrant where it is HF's plain non-reentrant one
        (reentrant.py), and the call's keyword arguments, with `use_cache=False` added where the model's config keeps
        a KV cache (HF's default) and the caller did not choose: each block would get a cache and run eager. Only what
        the model returns changes (no cache, which training does not read); HF turns the cache off the same way when
        it checkpoints activations. Waits for the compiler's set-up thread first (at once once it is done): the
        model's own modules then never run while its rehearsal traces (compile_rehearsal.py)."""
        if self.set_up is not None:
            self.set_up.wait()
        if self.fallback is None:
            self.checkpoints.ensure()
        if self.fallback is not None or "use_cache" in kwargs:
            return kwargs
        if not getattr(getattr(model, "config", None), "use_cache", False):
            return kwargs
        if "use_cache" not in inspect.signature(model.forward).parameters:
            return kwargs
        return {**kwargs, "use_cache": False}

    def report(self) -> dict:
        return {"enabled": self.fallback is None, "backend": getattr(self.backend, "__name__", str(self.backend)),
                "compile_s": self.compile_s, "graphs": self.graphs, "fallback": self.fallback,
                "parts_s": {name: round(seconds, 4) for name, seconds in
                            sorted(self.parts_s.items(), key=lambda item: -item[1]) if seconds >= PART_MIN_S},
                "eager_cache_calls": self.eager_cache_calls, "reentrant_calls": self.checkpoints.reentrant_calls,
                **(self.set_up.report() if self.set_up is not None else {})}

    def _forward(self):
        compiled_blocks = self

        def forward(block, *args, **kwargs):
            # Looked up at each call, never captured: a deep copy of the model computes with its own weights.
            own = block.__dict__.get(FORWARD)
            if own is None:
                return compiled_blocks.call(type(block).forward, block, args, kwargs)
            if isinstance(own, types.MethodType) and own.__self__ is block:
                return compiled_blocks.call(own.__func__, block, args, kwargs)
            return own(*args, **kwargs)  # a callable of some other object in the instance: not ours to compile

        return forward

    def call(self, function: Callable, block: nn.Module, args: tuple, kwargs: dict):
        if self.fallback is not None:
            return function(block, *args, **kwargs)
        if _carries_cache(args, kwargs):
            self.eager_cache_calls += 1
            if torch.is_grad_enabled() and not self._cache_warned and self.rank0:
                self._cache_warned = True  # training with a cache: most likely a config left at its default
                logger.warning("compile: the blocks are called with a KV cache (use_cache=True in a training call), so "
                               "they run eager; leave use_cache out of training calls to train them compiled")
            return function(block, *args, **kwargs)
        compiled = self._compiled.get(function)
        if compiled is None:
            if self.set_up is not None:
                self.set_up.wait()
            options = INDUCTOR_OPTIONS if self.backend == "inductor" else None
            compiled = self._compiled[function] = torch.compile(function, backend=self.backend, options=options)
        grad = torch.is_grad_enabled()
        if grad not in self._probed:
            self._probed.add(grad)
            if not self._probe(compiled, block, args, kwargs):
                return function(block, *args, **kwargs)
        graphs, start = _unique_graphs(), time.perf_counter()  # every block's call: nothing dearer here
        try:
            out = compiled(block, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            # Raised while compiling a new graph (a new input shape), before the graph ran.
            self._fall_back(err)
            return function(block, *args, **kwargs)
        if _unique_graphs() != graphs:
            self.graphs += _unique_graphs() - graphs
            self.compile_s += time.perf_counter() - start
        return out

    def _probe(self, compiled: Callable, block: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Compile (forward, and backward when grad is on) on detached copies of this call's inputs; False (and
        eager from now on) where that raises. Nothing the step keeps sees the probe: its saved tensors go to its own
        hooks, not the window's or the checkpoint's, its gradients are returned, not accumulated, and the RNG
        (dropout) is put back."""
        def detached(t: torch.Tensor) -> torch.Tensor:
            copy = t.detach()
            return copy.requires_grad_() if t.requires_grad and (t.is_floating_point() or t.is_complex()) else copy

        args, kwargs = tree_map_only(torch.Tensor, detached, (args, kwargs))
        device = _device_of(block)
        devices = [device] if device.type == "cuda" else []
        graphs, start, before = _unique_graphs(), time.perf_counter(), _compiler_seconds()
        try:
            with torch.random.fork_rng(devices=devices), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = compiled(block, *args, **kwargs)
                if torch.is_grad_enabled():
                    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                    wrt = [t for t in tree_flatten((args, kwargs))[0]
                           if isinstance(t, torch.Tensor) and t.requires_grad]
                    wrt += [p for p in block.parameters() if p.requires_grad]
                    if outputs and wrt:
                        torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs], allow_unused=True)
                del out
        except Exception as err:  # whatever compiling raised: the blocks run as they would without the key
            self._fall_back(err)
            return False
        self.graphs += _unique_graphs() - graphs
        self.compile_s += time.perf_counter() - start
        for name, seconds in _compiler_seconds().items():
            if seconds > before.get(name, 0.0):
                self.parts_s[name] = self.parts_s.get(name, 0.0) + seconds - before.get(name, 0.0)
        if not self._logged and self.rank0:
            self._logged = True
            logger.info(f"compile: {len(self.blocks)} blocks of {type(block).__name__} share one compiled forward "
                        f"(backend {self.report()['backend']}): {self.compile_s:.1f} s to compile; Inductor caches "
                        f"its work in {_cache_dir()}, so later runs of this model compile faster")
        return True

    def _fall_back(self, err: BaseException) -> None:
        # A backend's own error comes wrapped (BackendCompilerFailed): name the inner one, which says what failed.
        err = getattr(err, "inner_exception", None) or err
        lines = str(err).strip().splitlines()
        self.fallback = f"{type(err).__name__}: {lines[0][:REASON_CHARS] if lines else ''}"
        self.checkpoints.detach()  # the eager blocks checkpoint as the model set them up
        if self.rank0:
            logger.warning(f"compile: compiling the blocks failed ({self.fallback}); every block runs eager from now "
                           "on (\"compile\": false skips the attempt)")


def _device_of(block: nn.Module) -> torch.device:
    param = next(block.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir()


def start_set_up(blocks: list[nn.Module], setting: Optional[bool], device: torch.device) -> None:
    """Start the compiler's process-wide set-up now where `compile_blocks` will compile `blocks` with Inductor
    (compiler_setup.start_early): it runs while the caller goes on setting up, and compile_blocks takes it over."""
    if BACKEND == "inductor" and compile_wanted(setting, device, blocks):
        compiler_setup.start_early(device, BACKEND, INDUCTOR_OPTIONS)


def compile_blocks(blocks: list[nn.Module], setting: Optional[bool], device: torch.device,
                   rank0: bool = True) -> Optional[CompiledBlocks]:
    """The blocks compiled as the "compile" key asks (None: eager)."""
    if not compile_wanted(setting, device, blocks):
        return None
    compiled = CompiledBlocks(blocks, rank0)
    if compiled.backend == "inductor":  # the process's one-time part, during the set-up rather than the first step
        compiled.set_up = compiler_setup.take_early(device) or CompilerSetUp(device, compiled.backend, INDUCTOR_OPTIONS)
    compiled.attach()
    return compiled
