"""Engine checkpoints by parameter name, so they load into any window size or residency.

A checkpoint is the directory `<save_dir>/<tag>/` (tag: DeepSpeed's default `global_step<N>`):
- `state-NNNNN.safetensors`: tensors keyed `<kind>/<name>`: `master` (the fp32 value the optimizer
  updates), `exp_avg` / `exp_avg_sq` (AdamW moments), `frozen` (a parameter nothing updates, in its
  stored dtype), `buffer` (persistent module buffers). One shard per streamed block and per resident
  chunk: safetensors cannot write views of one flat host buffer, so those are copied out
  (`checkpoint_files.writable`), and sharding bounds the copies to one block at a time.
- `meta.pt`: counters, per-parameter AdamW steps, param-group hyperparameters, LR scheduler state, fp16
  loss-scaler state, RNG states, client state: tensors and plain values only, read with
  `torch.load(weights_only=True)`, so
  loading never unpickles arbitrary objects.
- `stronghold.json`: the stronghold config and layout it was written with (`saved_config`).
- `manifest.json`: SHA-256 checksums of the files above, verified before anything is loaded
  (checkpoint_files.py).
`<save_dir>/latest` holds the newest complete tag, as DeepSpeed's does.

With data parallel each rank holds a shard of the streamed blocks' fp32 states (data_parallel.py). Rank 0
writes the usual by-name files (with every rank's RNG state, `rng_ranks` in meta.pt), gathering each
streamed block's shards to itself just before it writes that block's shard file (sharding.save_on_rank0:
`dist.gather`, not all-gather), so the save holds one block's full fp32 states on rank 0 and none on the
other ranks; every rank loads the files and keeps its own shard. Why gather rather than one file per
rank: the format stays the one a single process writes, so a checkpoint loads at any world size, window
or residency (re-sharding is only a slice at load), and fp32 values are copied, never recomputed, so a
round trip is bit-exact. Rank 0 announces each gather and, last, its outcome, so a failed write (or
mkdir) never leaves the other ranks waiting in a collective: they raise rank 0's error.

FORMAT 2 added the manifest; nothing else changed. A format-1 checkpoint (no manifest) still loads,
with a warning that it is unverified; a format-2 one without its manifest is rejected, since the
manifest is always written and its absence means the directory was altered.

Saves are atomic: everything is written into a hidden temporary directory that is renamed into place,
then `latest` is replaced by a rename. A failure before the renames leaves the earlier checkpoints and
`latest` as they were (the next save into the directory removes what a killed one left); re-saving an existing tag keeps the old copy under `.<tag>.previous` until the
new one is in place, and loading falls back to it.
"""
from __future__ import annotations

import functools
import io
import json
import os
import random
import shutil
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .checkpoint_files import (fsync, load_meta, read_manifest, remove_stale_partials, replace_file, verify,
                               writable, write_manifest)
from .param_state import names, rest, units
from .sharding import save_on_rank0

FORMAT = 2
READABLE_FORMATS = (1, 2)
"""1: no manifest.json (loads unverified); 2: with it."""
LATEST = "latest"
META = "meta.pt"
INFO = "stronghold.json"
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


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
    if engine.stronghold_runtime.mid_step:
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


def _unit_tensors(unit: list, exclude_frozen: bool, steps: dict[str, int]) -> dict[str, torch.Tensor]:
    """A unit's tensors by checkpoint key; records the trainable parameters' AdamW steps in `steps`."""
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
    return tensors


def _write_tag(directory: Path, engine, client_state: dict, exclude_frozen: bool,
               rng_ranks: Optional[list], gather: Optional[Callable] = None) -> None:
    runtime = engine.stronghold_runtime
    steps = {}
    # Not enumerate(): it keeps the previous (index, unit) tuple until the generator has produced the
    # next unit, so a gathered block would still be held while the next one is gathered.
    index = -1
    for unit in units(runtime, gather=gather):
        index += 1
        tensors = _unit_tensors(unit, exclude_frozen, steps)
        if index == 0:
            tensors.update({f"buffer/{name}": b for name, b in _buffers(engine.module).items()})
        if tensors:
            path = directory / f"state-{index:05d}.safetensors"
            save_file(writable(tensors), str(path), metadata={"format": "pt"})
            fsync(path)
        # A gathered block's full state is freed when the next unit is asked for, if nothing here holds it.
        unit = tensors = None
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
        "loss_scaler": scaler.state_dict() if (scaler := engine.optimizer.loss_scaler) is not None else None,
        "rng": _rng_state(),
        "client_state": client_state,
    }
    if rng_ranks is not None:
        meta["rng_ranks"] = rng_ranks  # every rank's RNG, so each continues its own stream at the same world size
    _check_storable(meta, "the checkpoint's metadata")
    torch.save(meta, directory / META)
    fsync(directory / META)
    info = {"format": FORMAT, "stronghold": runtime.config.model_dump(), "window_size": runtime.window_size,
            "resident_blocks": runtime.resident_count, "compute_dtype": str(runtime.compute_dtype),
            "global_steps": engine.global_steps}
    (directory / INFO).write_text(json.dumps(info, indent=2, default=str))
    fsync(directory / INFO)
    write_manifest(directory)  # last: it checksums the files above as they are on disk


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
    data_parallel = engine.stronghold_runtime.data_parallel
    if data_parallel is None:
        return _save(engine, Path(save_dir), tag, client_state, save_latest, exclude_frozen_parameters, None)
    # Rank 0 writes, gathering one block at a time as it goes; the others follow its announcements and
    # raise its failure (sharding.save_on_rank0).
    rng_ranks = data_parallel.gather(_rng_state())
    runtime = engine.stronghold_runtime
    return save_on_rank0(data_parallel, runtime.stores, runtime.host_bytes,
                         lambda gather: _save(engine, Path(save_dir), tag, client_state, save_latest,
                                              exclude_frozen_parameters, rng_ranks, gather))


def _save(engine, save_dir: Path, tag: str, client_state: dict, save_latest: bool, exclude_frozen: bool,
          rng_ranks: Optional[list], gather: Optional[Callable] = None) -> bool:
    save_dir.mkdir(parents=True, exist_ok=True)
    final, partial, previous = save_dir / tag, save_dir / f".{tag}.partial", save_dir / f".{tag}.previous"
    remove_stale_partials(save_dir)
    partial.mkdir()
    try:
        _write_tag(partial, engine, client_state, exclude_frozen, rng_ranks, gather)
        fsync(partial)
        if final.exists():
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(final, previous)
        os.replace(partial, final)
        fsync(save_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    if save_latest:
        replace_file(save_dir / LATEST, tag)
    return True


# Loading -------------------------------------------------------------------------------------------
class _Reader:
    """Every tensor of a checkpoint directory by key; headers are read (and checked) up front."""

    def __init__(self, directory: Path, stack: ExitStack):
        self.handles: dict[str, Any] = {}
        for path in sorted(directory.glob("state-*.safetensors")):
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types; name the file
                raise ValueError(f"{path} cannot be read as a safetensors file ({err})") from err
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
    params = [p for unit in units(engine.stronghold_runtime, shapes_only=True) for p in unit]
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
    """Each store takes its shard of every trainable tensor (all of it unless sharded); frozen weights go
    into the working copy, which with data parallel is node-shared: local rank 0 writes those."""
    data_parallel = runtime.data_parallel
    writes_frozen = data_parallel is None or data_parallel.rank == 0
    for store in runtime.stores.values():
        for entry in store.entries:
            key = _value_key(reader, entry.name)
            if entry.group is None:
                if key is not None and writes_frozen:
                    reader.copy_into(key, entry.host_view(store.working))
                continue
            pieces = store.local_ranges([(entry.offset, entry.offset + entry.numel)])
            if not pieces:
                continue
            (start, stop), = pieces
            source = slice(store.shard_start + start - entry.offset, store.shard_start + stop - entry.offset)
            if key is not None:
                store.master[start:stop].copy_(reader.get(key).reshape(-1)[source])
            if optimizer_states and f"exp_avg/{entry.name}" in reader:
                store.exp_avg[start:stop].copy_(reader.get(f"exp_avg/{entry.name}").reshape(-1)[source])
                store.exp_avg_sq[start:stop].copy_(reader.get(f"exp_avg_sq/{entry.name}").reshape(-1)[source])
        if optimizer_states:
            for entry in store.trainable:  # every rank keeps every parameter's step (bias correction)
                if f"exp_avg/{entry.name}" in reader:
                    entry.step = int(steps.get(entry.name, 0))
        if store.master.data_ptr() != store.working[store.shard_start:].data_ptr():
            # bf16/fp16: this rank's shard of the working copy follows its master
            store.working[store.shard_start:store.shard_stop].copy_(store.master)
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


def _verified_meta(path: Path) -> dict:
    """meta.pt of a checkpoint directory, after every file in it was checked against its manifest."""
    files = read_manifest(path)
    if files is not None:
        verify(path, files)
    meta = load_meta(path / META)
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path / META}: checkpoint format {found!r} is not one of {READABLE_FORMATS}; it was not "
                         "written by this version of stronghold")
    if files is None:
        if meta["format"] >= 2:
            raise ValueError(f"{path} has no manifest.json, which every format-{meta['format']} checkpoint has: "
                             "the directory was altered after the save, so its files cannot be trusted")
        warnings.warn(f"stronghold: {path} was written by an earlier stronghold (format 1, no checksums); loading "
                      "it unverified. Save it again to add them.")
    return meta


def saved_config(load_dir, tag=None) -> dict:
    """The stronghold section, window, residency and dtype a checkpoint was written with (to rebuild the
    same layout; loading does not need it: any layout loads)."""
    path = _resolve_tag(Path(load_dir), tag)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {load_dir} (tag {tag!r})")
    files = read_manifest(path)
    if files is not None:
        verify(path, files, only=[INFO])
    try:
        return json.loads((path / INFO).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path / INFO} cannot be read ({err})") from err


def load_checkpoint(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn: Optional[Callable] = None):
    """`DeepSpeedEngine.load_checkpoint` for a StrongholdEngine: returns (path loaded, client_state), or
    (None, None) when there is no checkpoint, as DeepSpeed does. With data parallel every rank loads the
    same files (written at any world size) and a failure on one rank is raised on all."""
    data_parallel = engine.stronghold_runtime.data_parallel
    load = functools.partial(_load, engine, load_dir, tag, load_module_strict, load_optimizer_states,
                             load_lr_scheduler_states, load_module_only, custom_load_fn)
    if data_parallel is None:
        return load()
    result = data_parallel.run_agreed(load, rank0_only=False)
    # Every rank wrote its shard of the node-shared working copy: a block may be read once all have.
    data_parallel.publish(engine.stronghold_runtime)
    return result


def _load(engine, load_dir, tag, load_module_strict: bool, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, load_module_only: bool, custom_load_fn: Optional[Callable]):
    if custom_load_fn is not None:
        raise ValueError("custom_load_fn is not supported by stronghold: it loads by parameter name into its own "
                         "host and GPU buffers; load the tensors into the model before stronghold.initialize instead")
    path = _resolve_tag(Path(load_dir), tag)
    if path is None:
        warnings.warn(f"stronghold: no checkpoint found in {load_dir} (tag {tag!r}); nothing was loaded")
        return None, None
    meta = _verified_meta(path)
    engine.synchronize_host()
    runtime = engine.stronghold_runtime
    optimizer_states = load_optimizer_states and not load_module_only
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(path, stack)
        _validate(engine, reader, meta, load_module_strict)
        steps = meta["adam_steps"]
        _load_streamed(runtime, reader, steps, optimizer_states)
        _load_resident(runtime, names(engine.module), reader, steps, optimizer_states)
        for param in rest(runtime):
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
        # Absent in checkpoints from before fp16 support, None from a bf16/fp32 run: the scale starts afresh.
        if meta.get("loss_scaler") is not None and engine.optimizer.loss_scaler is not None:
            engine.optimizer.loss_scaler.load_state_dict(meta["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    counters = meta["counters"]
    for name in COUNTERS:
        setattr(engine, name, counters[name])
    runtime.steps = counters["runtime_steps"]
    if runtime.cpu is not None and meta["defer_next"] is not None:
        runtime.cpu.defer_next = bool(meta["defer_next"])
    data_parallel = runtime.data_parallel
    ranks = meta.get("rng_ranks")
    same_world = ranks is not None and data_parallel is not None and len(ranks) == data_parallel.world_size
    # At another world size every rank takes rank 0's (as a run started with one seed everywhere).
    _set_rng_state(ranks[data_parallel.rank] if same_world else meta["rng"])
    return str(path), meta["client_state"]
