"""Loading an engine checkpoint into any window size, residency or world size (checkpoint.py writes it;
its docstring describes the format). Every check runs before anything is changed, so a bad or foreign
checkpoint leaves the engine as it was."""
from __future__ import annotations

import functools
import json
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open

from stronghold.checkpoint.save import COUNTERS, INFO, LATEST, META, READABLE_FORMATS, _buffers, _check_tag, _set_rng_state
from stronghold.checkpoint.files import load_meta, read_manifest, verify
from stronghold.optim.param_state import names, rest, units

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


def _validate(engine, reader: _Reader, meta: dict, strict: bool, allow_non_finite: bool) -> None:
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
    if not allow_non_finite:
        _check_finite(reader, ours)
    if missing or unexpected:
        order = {name: i for i, name in enumerate(engine.module.state_dict(keep_vars=True))}  # torch's order
        missing.sort(key=lambda n: order.get(n.removeprefix("buffer:"), len(order)))
        warnings.warn(f"stronghold: load_module_strict=False: {_incompatible(missing, unexpected)} The model's "
                      "missing tensors keep the values they had; the unexpected ones were not loaded.")


def _check_finite(reader: _Reader, ours: dict) -> None:
    """Every parameter value and AdamW moment that would be loaded is finite. A run that diverged can save inf or
    NaN; loaded, every later step would be skipped (the gradient norm is not finite), silently."""
    bad = []
    for key in reader.handles:
        kind, name = key.split("/", 1)
        if kind in ("master", "frozen", "exp_avg", "exp_avg_sq") and name in ours:
            tensor = reader.get(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(key)
            tensor = None  # one tensor read at a time
    if bad:
        raise ValueError(f"checkpoint has inf or NaN in {len(bad)} tensor(s): {', '.join(bad[:10])}"
                         f"{' ...' if len(bad) > 10 else ''}; the run that saved it had diverged: load an earlier "
                         "checkpoint, or pass load_checkpoint(..., allow_non_finite=True) to load it anyway")


def _incompatible(missing: list[str], unexpected: list[str]) -> str:
    """The mismatch in the words of torch's `load_state_dict` (buffers by their state_dict names)."""
    def keys(names):
        return ", ".join(f'"{n.removeprefix("buffer:")}"' for n in names)
    parts = [f"Missing key(s) in state_dict: {keys(missing)}." if missing else "",
             f"Unexpected key(s) in state_dict: {keys(unexpected)}." if unexpected else ""]
    return " ".join(p for p in parts if p)


def _load_streamed(runtime, reader: _Reader, steps: dict, optimizer_states: bool) -> None:
    """Each store takes its shard of every trainable tensor (all of it unless sharded); frozen weights go
    into the working copy, which with data parallel is node-shared: each node's local rank 0 writes those."""
    data_parallel = runtime.data_parallel
    writes_frozen = data_parallel is None or data_parallel.local_rank == 0
    for store in runtime.host_stores():
        with store.states() as (master, exp_avg, exp_avg_sq):  # an NVMe store's: read, then written back
            _load_store(store, master, exp_avg, exp_avg_sq, reader, steps, optimizer_states, writes_frozen)
        store.life.weights_replaced()  # any GPU copy of the block is stale (a cached unit's is reloaded below)


def _load_store(store, master, exp_avg, exp_avg_sq, reader: _Reader, steps: dict, optimizer_states: bool,
                writes_frozen: bool) -> None:
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
            master[start:stop].copy_(reader.get(key).reshape(-1)[source])
        if optimizer_states and f"exp_avg/{entry.name}" in reader:
            exp_avg[start:stop].copy_(reader.get(f"exp_avg/{entry.name}").reshape(-1)[source])
            exp_avg_sq[start:stop].copy_(reader.get(f"exp_avg_sq/{entry.name}").reshape(-1)[source])
    if optimizer_states:
        for entry in store.trainable:  # every rank keeps every parameter's step (bias correction)
            if f"exp_avg/{entry.name}" in reader:
                entry.step = int(steps.get(entry.name, 0))
    if master.data_ptr() != store.working[store.shard_start:].data_ptr():
        # bf16/fp16: this rank's shard of the working copy follows its master
        store.working[store.shard_start:store.shard_stop].copy_(master)


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
                    custom_load_fn: Optional[Callable] = None, allow_non_finite: bool = False):
    """`DeepSpeedEngine.load_checkpoint` for a StrongholdEngine: returns (path loaded, client_state), or
    (None, None) when there is no checkpoint, as DeepSpeed does. With data parallel every rank loads the
    same files (written at any world size) and a failure on one rank is raised on all.

    Refused (ValueError, before anything changes) between backward() and step(), as save_checkpoint is
    (step_state.require_idle); and for a checkpoint with inf or NaN in a parameter or AdamW moment unless
    `allow_non_finite` (e.g. to inspect a diverged run). `load_module_strict=False` loads the tensors that match and
    warns with the missing and unexpected names, as torch's `load_state_dict` reports them."""
    data_parallel = engine.stronghold_runtime.data_parallel
    load = functools.partial(_load, engine, load_dir, tag, load_module_strict, load_optimizer_states,
                             load_lr_scheduler_states, load_module_only, custom_load_fn, allow_non_finite)
    if data_parallel is None:
        return load()
    result = data_parallel.run_agreed(load, rank0_only=False)
    # Every rank wrote its shard of the node-shared working copy: a block may be read once all have.
    data_parallel.publish(engine.stronghold_runtime)
    return result


def _load(engine, load_dir, tag, load_module_strict: bool, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, load_module_only: bool, custom_load_fn: Optional[Callable],
          allow_non_finite: bool):
    engine.stronghold_runtime.require_idle("load_checkpoint")
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
        _validate(engine, reader, meta, load_module_strict, allow_non_finite)
        steps = meta["adam_steps"]
        _load_streamed(runtime, reader, steps, optimizer_states)
        _load_resident(runtime, names(engine.module), reader, steps, optimizer_states)
        for param in rest(runtime):
            key = _value_key(reader, param.name)
            if key is not None:
                reader.copy_into(key, param.value)
        for name, buffer in _buffers(engine.module).items():
            reader.copy_into(f"buffer/{name}", buffer)
    runtime.cached.ensure()  # the cached units' device copies: the model's weights after the load
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
    engine.restore_counters({name: counters[name] for name in COUNTERS})
    runtime.restore_steps(counters["runtime_steps"])
    # Checkpoints written before speculation.py hold the old rule's flag instead; both map onto a forecast.
    speculation = meta["speculation"] if "speculation" in meta else meta.get("defer_next")
    if runtime.cpu is not None and speculation is not None:
        runtime.cpu.forecast.load_state_dict(speculation)
    data_parallel = runtime.data_parallel
    ranks = meta.get("rng_ranks")
    same_world = ranks is not None and data_parallel is not None and len(ranks) == data_parallel.world_size
    # At another world size every rank takes rank 0's (as a run started with one seed everywhere).
    _set_rng_state(ranks[data_parallel.rank] if same_world else meta["rng"])
    return str(path), meta["client_state"]
