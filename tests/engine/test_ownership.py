"""One owner per piece of state: an object's attributes are written only by the code of its own class (its module, or
the module of a base class it mixes in), never by another module of the package.

Checked on every class the package defines but the records below (a block's buffers, a transfer slot, the stats),
which several modules fill; a block's lifecycle (streaming/lifecycle.py's BlockLife) is checked: only its module moves
a block from state to state. Each checked class's `__setattr__` is wrapped for the test to note the writer's file;
training then runs through streaming, accumulation, clipping, the cached tier, activation offload, MLP chunks,
compiled blocks, a promotion, the GPU accumulators' switch, a checkpoint save and load, the NVMe tier, compact masters,
pooled gradient buffers and the blockwise backward with its forwards block by block (data parallel runs in other
processes: not here).
"""
import enum
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

import stronghold
from tests.engine.helpers import batches, ds_config, run_steps, tiny_llama

PACKAGE = str(Path(stronghold.__file__).parent)
RECORDS = {"BlockStore", "ParamEntry", "Slot", "MicroState", "UpdateRecord", "MicroAccum"}
"""Records that several modules fill in turn (a block's buffers, a transfer slot, one micro-step's progress, a CPU
job). Where a block is and who may touch it now is not among them: the store's `life` (streaming/lifecycle.py) has
one writer, its own module. The counters of a part (its `...Stats`) are its own record."""


def _owner_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(stronghold.__path__, "stronghold."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            record = cls.__name__ in RECORDS or cls.__name__.endswith("Stats")
            if cls.__module__ == module.__name__ and not record \
                    and not issubclass(cls, (BaseException, enum.Enum, tuple, type)):
                classes.append(cls)
    return classes


def _own_files(cls: type) -> set[str]:
    return {inspect.getfile(k) for k in cls.__mro__ if k.__module__.startswith("stronghold.")}


@pytest.fixture
def writes(monkeypatch):
    """(class, attribute, file:line) of every write from a package module that does not own the object."""
    found: list[tuple[str, str, str]] = []
    classes = _owner_classes()
    originals = {cls: next(k.__dict__["__setattr__"] for k in cls.__mro__ if "__setattr__" in k.__dict__)
                 for cls in classes}

    def guard(cls, original, allowed):
        def __setattr__(self, name, value):
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if path.startswith(PACKAGE) and path not in allowed and type(self) is cls:
                found.append((cls.__name__, name, f"{Path(path).relative_to(PACKAGE)}:{caller.f_lineno}"))
            original(self, name, value)
        return __setattr__

    for cls, original in originals.items():
        monkeypatch.setattr(cls, "__setattr__", guard(cls, original, _own_files(cls)))
    return found


def test_the_guard_sees_a_foreign_write(writes):
    from stronghold.streaming.streams import Transfers
    import torch
    transfers = Transfers(torch.device("cpu"))
    exec(compile("transfers.slots = []", str(Path(PACKAGE) / "engine" / "telemetry.py"), "exec"),
         {"transfers": transfers})
    transfers.free_slots()
    assert writes == [("Transfers", "slots", "engine/telemetry.py:1")]


def _train(config: dict, tmp_path, promote: bool = False, gpu_accumulation: bool = False) -> None:
    engine, _, _, _ = stronghold.initialize(model=tiny_llama(6), config=config)
    data = batches(8)
    gas = config["gradient_accumulation_steps"]

    def steps(part: list[dict]) -> None:
        """run_steps, each window's batches given ahead (block_major_forward)."""
        def offer(engine, i):
            if i % gas == gas - 1:
                engine.window_batches(part[i + 1:i + 1 + gas])

        engine.window_batches(part[:gas])
        run_steps(engine, part, before_step=offer)

    steps(data[:4])
    runtime = engine.stronghold_runtime
    if promote:
        runtime.promote(runtime.resident_count + 1, 2)
    if gpu_accumulation:
        runtime.accumulate_on_gpu()
    engine.stronghold_report(reset=True)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    steps(data[4:])
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    steps(data[4:6])
    engine.stronghold_report()
    engine.destroy()


def test_no_module_writes_another_modules_objects(writes, tmp_path, monkeypatch):
    from stronghold.integrations import compile as compile_module
    monkeypatch.setattr(compile_module, "BACKEND", "eager")  # Dynamo's tracing without code generation: fast
    _train(ds_config(window=2, resident=1, gas=2, clip=1.0, rest_placement="host", offload_activations=2,
                     mlp_chunk_tokens=4), tmp_path / "a", promote=True)
    _train(ds_config(window=2, resident=1, gas=2, clip=1.0, compile=True), tmp_path / "b", gpu_accumulation=True)
    (tmp_path / "drive").mkdir()
    _train(ds_config(window=2, resident=1, gas=2, clip=1.0, nvme_path=str(tmp_path / "drive"), nvme_blocks=2),
           tmp_path / "c", promote=True)
    _train(ds_config(window=2, resident=1, gas=2, clip=1.0, bf16=True, compact_master=True, pooled_grads=True,
                     gradient_spares=False), tmp_path / "d", promote=True)
    _train(ds_config(window=2, resident=1, gas=2, clip=1.0, blockwise_backward=True, rest_placement="host",
                     block_major_forward=True), tmp_path / "e", promote=True)
    assert sorted(set(writes)) == []
