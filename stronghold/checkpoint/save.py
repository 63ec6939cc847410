"""Engine checkpoints by parameter name, so they load into any window size or residency: the format and
its writing (loading: checkpoint_load.py).

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

import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from stronghold.checkpoint.files import fsync, remove_stale_partials, replace_file, writable, write_manifest
from stronghold.optim.param_state import units
from stronghold.distributed.sharding import save_on_rank0

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
        # What the CPU optimizer's next early-or-deferred choices are made from (speculation.py), so a
        # resumed run takes the same path; None where there is no CPU part (it then starts without one).
        "speculation": runtime.cpu.forecast.state_dict() if runtime.cpu is not None else None,
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
    info = {"format": FORMAT, "stronghold": engine._sh_config.model_dump(), "window_size": runtime.window_size,
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
    engine.stronghold_runtime.require_idle("save_checkpoint")
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    engine.synchronize_host()
    data_parallel = engine.stronghold_runtime.data_parallel
    if data_parallel is None:
        return _save(engine, Path(save_dir), tag, client_state, save_latest, exclude_frozen_parameters, None)
    # Rank 0 writes, gathering one block at a time as it goes; the others follow its announcements and
    # raise its failure (sharding.save_on_rank0).
    rng_ranks = data_parallel.gather(_rng_state())
    runtime = engine.stronghold_runtime
    return save_on_rank0(data_parallel, {store.index: store for store in runtime.host_stores()}, runtime.host_bytes,
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
