"""Engine checkpoints by parameter name, so they load into any window size or residency.

A checkpoint is the directory `<save_dir>/<tag>/` (tag: DeepSpeed's default `global_step<N>`):
- `state-NNNNN.safetensors`: tensors keyed `<kind>/<name>`: `master` (the fp32 value the optimizer
  updates), `exp_avg` / `exp_avg_sq` (AdamW moments), `frozen` (a parameter nothing updates, in its
  stored dtype), `buffer` (persistent module buffers). One shard per streamed block and per resident
  chunk: safetensors cannot write views of one flat host buffer, so every tensor is copied out, and
  sharding bounds those copies to one block at a time.
- `meta.pt`: counters, per-parameter AdamW steps, param-group hyperparameters, LR scheduler state, RNG
  states, client state: tensors and plain values only, read with `torch.load(weights_only=True)`, so
  loading never unpickles arbitrary objects.
- `stronghold.json`: the stronghold config and layout it was written with (`saved_config`).
`<save_dir>/latest` holds the newest complete tag, as DeepSpeed's does.

Saves are atomic: everything is written into a hidden temporary directory that is renamed into place,
then `latest` is replaced by a rename. A failure before the renames leaves the earlier checkpoints and
`latest` as they were; re-saving an existing tag keeps the old copy under `.<tag>.previous` until the
new one is in place, and loading falls back to it.
"""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

FORMAT = 1
LATEST = "latest"
META = "meta.pt"
INFO = "stronghold.json"
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


@dataclass
class ParamState:
    """One parameter as the running engine holds it (views of its buffers, not copies)."""

    name: str
    value: torch.Tensor
    """The fp32 master of a trainable parameter; the parameter's own value when frozen."""
    trainable: bool
    exp_avg: Optional[torch.Tensor] = None
    """None for frozen parameters and for resident ones that have not taken a step yet."""
    exp_avg_sq: Optional[torch.Tensor] = None
    step: int = 0


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _units(engine) -> Iterator[list[ParamState]]:
    """Every parameter, grouped as stored: per streamed block, per resident chunk, then the rest."""
    runtime, names = engine.stronghold_runtime, _names(engine.module)
    for store in runtime.stores.values():
        unit = []
        for entry in store.entries:
            if entry.group is None:
                unit.append(ParamState(names[id(entry.param)], entry.host_view(store.working), False))
            else:
                unit.append(ParamState(names[id(entry.param)], entry.host_view(store.master), True,
                                       entry.host_view(store.exp_avg), entry.host_view(store.exp_avg_sq), entry.step))
        yield unit
    for chunk in runtime.resident.chunks:
        unit = []
        for param, master in zip(chunk.params, chunk.masters):
            state = chunk.optimizer.state.get(master, {})
            unit.append(ParamState(names[id(param)], master, True, state.get("exp_avg"), state.get("exp_avg_sq"),
                                   int(state["step"]) if "step" in state else 0))
        yield unit
    yield _rest(engine, _covered(runtime))


def _rest(engine, covered: set[int]) -> list[ParamState]:
    """Parameters neither streamed nor updated on the GPU: frozen ones that stay resident."""
    return [ParamState(name, p.data, False) for name, p in engine.module.named_parameters() if id(p) not in covered]


def _covered(runtime) -> set[int]:
    return {id(e.param) for store in runtime.stores.values() for e in store.entries} | {
        id(p) for chunk in runtime.resident.chunks for p in chunk.params}


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by state_dict name (what `state_dict()` would save besides parameters)."""
    found, seen = {}, set()
    for prefix, mod in module.named_modules():
        for name, buffer in mod._buffers.items():
            if buffer is None or name in mod._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def _check_quiescent(engine) -> None:
    runtime = engine.stronghold_runtime
    midway = any(state.accum_started for state in getattr(runtime, "micro", {}).values())
    if midway or (runtime.cpu is not None and runtime.cpu.records):
        raise ValueError("save_checkpoint was called between backward() and the step() that ends the gradient "
                         "accumulation window, so the pending gradients would be lost; save after engine.step() "
                         "at an accumulation boundary")


def _rng_state() -> dict:
    numpy_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_storable(value: Any, what: str) -> None:
    """Fail before writing anything if `value` would not load back with weights_only=True."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means "not storable"; the message says why
        raise ValueError(f"{what} cannot be stored in a checkpoint: only tensors and plain Python values "
                         f"(numbers, strings, lists, tuples, dicts) load back without unpickling code ({err})") from None


def _check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag.startswith(".") or os.sep in tag or (os.altsep and os.altsep in tag):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (no path separators, not "
                         "starting with '.')")
    return tag


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tag(directory: Path, engine, client_state: dict, exclude_frozen: bool) -> None:
    runtime = engine.stronghold_runtime
    steps = {}
    for index, unit in enumerate(_units(engine)):
        tensors = {}
        for param in unit:
            if not param.trainable:
                if not exclude_frozen:
                    tensors[f"frozen/{param.name}"] = param.value
                continue
            steps[param.name] = param.step
            tensors[f"master/{param.name}"] = param.value
            for kind in ("exp_avg", "exp_avg_sq"):
                moment = getattr(param, kind)
                tensors[f"{kind}/{param.name}"] = torch.zeros_like(param.value) if moment is None else moment
        if index == 0:
            tensors.update({f"buffer/{name}": b for name, b in _buffers(engine.module).items()})
        if tensors:
            path = directory / f"state-{index:05d}.safetensors"
            # One copy each: a private, contiguous host tensor (safetensors needs both).
            save_file({k: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
                       for k, t in tensors.items()}, str(path),
                      metadata={"format": "pt"})
            _fsync(path)
    meta = {
        "format": FORMAT,
        "counters": {**{name: int(getattr(engine, name)) for name in COUNTERS}, "runtime_steps": runtime.steps},
        # The CPU optimizer's choice for the next step (defer or speculate), so a resumed run takes the same
        # path; None where there is no CPU part (it then starts from its default).
        "defer_next": runtime.cpu.defer_next if runtime.cpu is not None else None,
        "adam_steps": steps,
        "exclude_frozen": exclude_frozen,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups],
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "rng": _rng_state(),
        "client_state": client_state,
    }
    _check_storable(meta, "the checkpoint's metadata")
    torch.save(meta, directory / META)
    _fsync(directory / META)
    info = {"format": FORMAT, "stronghold": runtime.config.model_dump(), "window_size": runtime.window_size,
            "resident_blocks": runtime.resident_count, "compute_dtype": str(runtime.compute_dtype),
            "global_steps": engine.global_steps}
    (directory / INFO).write_text(json.dumps(info, indent=2, default=str))


def _replace_file(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    _fsync(partial)
    os.replace(partial, path)


def save_checkpoint(engine, save_dir, tag=None, client_state: Optional[dict] = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """`DeepSpeedEngine.save_checkpoint` for a StrongholdEngine (see the module docstring)."""
    client_state = dict(client_state or {})
    _check_storable(client_state, "client_state")
    if engine.lr_scheduler is not None:
        _check_storable(engine.lr_scheduler.state_dict(), f"the LR scheduler's state ({type(engine.lr_scheduler).__name__})")
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    engine.synchronize_host()
    _check_quiescent(engine)
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    final, partial, previous = save_dir / tag, save_dir / f".{tag}.partial", save_dir / f".{tag}.previous"
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
    partial.mkdir()
    try:
        _write_tag(partial, engine, client_state, exclude_frozen_parameters)
        _fsync(partial)
        if final.exists():
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(final, previous)
        os.replace(partial, final)
        _fsync(save_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    if save_latest:
        _replace_file(save_dir / LATEST, tag)
    return True


# Loading -------------------------------------------------------------------------------------------
class _Reader:
    """Every tensor of a checkpoint directory by key; headers are read (and checked) up front."""

    def __init__(self, directory: Path, stack: ExitStack):
        self.handles: dict[str, Any] = {}
        for path in sorted(directory.glob("state-*.safetensors")):
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for key in handle.keys():
                self.handles[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self.handles

    def shape(self, key: str) -> tuple:
        return tuple(self.handles[key].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self.handles[key].get_tensor(key)

    def copy_into(self, key: str, target: torch.Tensor) -> bool:
        if key not in self.handles:
            return False
        target.copy_(self.get(key).view(target.shape))
        return True


def _value_key(reader: _Reader, name: str) -> Optional[str]:
    for kind in ("master", "frozen"):
        if f"{kind}/{name}" in reader:
            return f"{kind}/{name}"
    return None


def _validate(engine, reader: _Reader, meta: dict, strict: bool) -> None:
    """All checks before anything is changed, so a bad checkpoint leaves the engine as it was."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {meta.get('format')!r} is not {FORMAT}; it was not written by this "
                         "version of stronghold")
    params = [p for unit in _units(engine) for p in unit]
    ours = {p.name: tuple(p.value.shape) for p in params}
    ours.update({f"buffer:{n}": tuple(b.shape) for n, b in _buffers(engine.module).items()})
    theirs = {}
    for key in reader.handles:
        kind, name = key.split("/", 1)
        if kind in ("master", "frozen"):
            theirs[name] = reader.shape(key)
        elif kind == "buffer":
            theirs[f"buffer:{name}"] = reader.shape(key)
    wrong = [f"{n} {theirs[n]} vs model {shape}" for n, shape in ours.items() if n in theirs and theirs[n] != shape]
    if wrong:
        raise ValueError(f"checkpoint shapes differ from the model's for {len(wrong)} tensors, e.g. {wrong[:3]}; "
                         "load it into the model it was saved from")
    frozen_now = {p.name for p in params if not p.trainable}
    missing = [n for n in ours if n not in theirs and not (meta.get("exclude_frozen") and n in frozen_now)]
    unexpected = [n for n in theirs if n not in ours]
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint does not match the model: {len(missing)} missing (e.g. {missing[:3]}), "
                         f"{len(unexpected)} unexpected (e.g. {unexpected[:3]}); pass load_module_strict=False to "
                         "load the tensors that match")
    groups = len(engine.optimizer.param_groups)
    if len(meta["param_groups"]) != groups:
        raise ValueError(f"checkpoint has {len(meta['param_groups'])} optimizer param groups, the engine has "
                         f"{groups}; build the optimizer with the same groups as the run that saved it")


def _load_streamed(runtime, reader: _Reader, steps: dict, optimizer_states: bool) -> None:
    for store in runtime.stores.values():
        for entry in store.entries:
            key = _value_key(reader, entry.name)
            if entry.group is None:
                if key is not None:
                    reader.copy_into(key, entry.host_view(store.working))
                continue
            if key is not None:
                reader.copy_into(key, entry.host_view(store.master))
            if optimizer_states and f"exp_avg/{entry.name}" in reader:
                reader.copy_into(f"exp_avg/{entry.name}", entry.host_view(store.exp_avg))
                reader.copy_into(f"exp_avg_sq/{entry.name}", entry.host_view(store.exp_avg_sq))
                entry.step = int(steps.get(entry.name, 0))
        if store.master.data_ptr() != store.working.data_ptr():  # bf16: the working copy follows the master
            store.working[:store.trainable_numel].copy_(store.master)
        store.version += 1  # any GPU copy of the block is stale


def _load_resident(runtime, names: dict[int, str], reader: _Reader, steps: dict, optimizer_states: bool) -> None:
    for chunk in runtime.resident.chunks:
        optimizer = chunk.optimizer
        order = [p for group in optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        full = optimizer.state_dict()
        state = full["state"]
        for param, master in zip(chunk.params, chunk.masters):
            name = names[id(param)]
            key = _value_key(reader, name)
            if key is not None:
                reader.copy_into(key, master)
                if master is not param:
                    param.data.copy_(master)
            if optimizer_states and f"exp_avg/{name}" in reader:
                i, step = index[id(master)], int(steps.get(name, 0))
                state.pop(i, None)
                if step > 0:  # a parameter that never stepped has no AdamW state, as in torch
                    state[i] = {"step": torch.tensor(float(step)), "exp_avg": reader.get(f"exp_avg/{name}"),
                                "exp_avg_sq": reader.get(f"exp_avg_sq/{name}")}
        if optimizer_states:
            optimizer.load_state_dict(full)  # casts and places each state tensor as torch's AdamW wants it


def _resolve_tag(load_dir: Path, tag) -> Optional[Path]:
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    path = load_dir / _check_tag(tag)
    if not path.is_dir() and (load_dir / f".{tag}.previous").is_dir():
        warnings.warn(f"stronghold: {path} is missing (a save of the same tag was interrupted); loading the "
                      "previous copy of it")
        return load_dir / f".{tag}.previous"
    return path if path.is_dir() else None


def saved_config(load_dir, tag=None) -> dict:
    """The stronghold section, window, residency and dtype a checkpoint was written with (to rebuild the
    same layout; loading does not need it: any layout loads)."""
    path = _resolve_tag(Path(load_dir), tag)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {load_dir} (tag {tag!r})")
    return json.loads((path / INFO).read_text())


def load_checkpoint(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn: Optional[Callable] = None):
    """`DeepSpeedEngine.load_checkpoint` for a StrongholdEngine: returns (path loaded, client_state), or
    (None, None) when there is no checkpoint, as DeepSpeed does."""
    if custom_load_fn is not None:
        raise ValueError("custom_load_fn is not supported by stronghold: it loads by parameter name into its own "
                         "host and GPU buffers; load the tensors into the model before stronghold.initialize instead")
    path = _resolve_tag(Path(load_dir), tag)
    if path is None:
        warnings.warn(f"stronghold: no checkpoint found in {load_dir} (tag {tag!r}); nothing was loaded")
        return None, None
    meta = torch.load(path / META, weights_only=True, map_location="cpu")
    engine.synchronize_host()
    runtime, names = engine.stronghold_runtime, _names(engine.module)
    optimizer_states = load_optimizer_states and not load_module_only
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(path, stack)
        _validate(engine, reader, meta, load_module_strict)
        steps = meta["adam_steps"]
        _load_streamed(runtime, reader, steps, optimizer_states)
        _load_resident(runtime, names, reader, steps, optimizer_states)
        for param in _rest(engine, _covered(runtime)):
            key = _value_key(reader, param.name)
            if key is not None:
                reader.copy_into(key, param.value)
        for name, buffer in _buffers(engine.module).items():
            reader.copy_into(f"buffer/{name}", buffer)
    if load_module_only:
        return str(path), meta["client_state"]
    if optimizer_states:
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            group.update(saved)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    counters = meta["counters"]
    for name in COUNTERS:
        setattr(engine, name, counters[name])
    runtime.steps = counters["runtime_steps"]
    if runtime.cpu is not None and meta["defer_next"] is not None:
        runtime.cpu.defer_next = bool(meta["defer_next"])
    _set_rng_state(meta["rng"])
    return str(path), meta["client_state"]
