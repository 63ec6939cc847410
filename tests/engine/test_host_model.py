"""One host-bytes model: what the planner counts for a placement (plan_bytes.host_bytes, built on store_bytes) is
what the runtime allocates for it, byte for byte, as its HostMeter counts the buffers after set-up. Each case builds
a runtime on the CPU with a different store layout (fp32 or bf16 working copies, host accumulation with its spare
gradient buffers, lean blocks, the cached tier for the parts outside the blocks, the NVMe tier's staging buffers)
and compares."""
import copy

import pytest
import torch

import stronghold
from stronghold.integrations.discovery import find_blocks
from stronghold.planning import plan_inputs
from stronghold.planning.plan_bytes import host_bytes
from stronghold.planning.plan_types import ROW_PIECE_BYTES
from stronghold.planning.planner import Budgets, Drive

from .helpers import ds_config, tiny_gpt2, tiny_llama

CASES = {
    "fp32": dict(),
    "fp32 accumulation": dict(gas=2),
    "bf16 accumulation": dict(gas=2, bf16=True),
    "bf16 lean": dict(bf16=True, lean_blocks=2),
    "bf16 cached rest": dict(gas=2, bf16=True, rest_placement="host"),
    "bf16 cached rest without spares": dict(gas=2, bf16=True, rest_placement="host", gradient_spares=False),
    "fp32 nvme": dict(nvme_blocks=3, nvme_buffers=2),
    "bf16 compact master": dict(gas=2, bf16=True, compact_master=True),
    "bf16 compact master, cached rest without spares": dict(gas=2, bf16=True, compact_master=True,
                                                            rest_placement="host", gradient_spares=False),
    "bf16 pooled gradient buffers": dict(gas=2, bf16=True, pooled_grads=True, gradient_spares=False),
    "bf16 blockwise backward": dict(gas=2, bf16=True, blockwise_backward=True),
    "bf16 blockwise backward, cached rest": dict(gas=2, bf16=True, blockwise_backward=True, rest_placement="host"),
    "fp32 blockwise backward, cached rest": dict(gas=2, blockwise_backward=True, rest_placement="host"),
    "fp32 pooled gradient buffers, nvme": dict(gas=2, pooled_grads=True, gradient_spares=False, nvme_blocks=2,
                                               nvme_buffers=2),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tie", [False, True])
def test_planned_host_bytes_are_the_allocated_ones(case, tie, tmp_path):
    config = dict(CASES[case])
    if "nvme_blocks" in config:
        config["nvme_path"] = str(tmp_path)
    model = tiny_gpt2(5, tie=tie) if tie else tiny_llama(5)
    parts = find_blocks(model, None, None)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    dtype = torch.bfloat16 if config.get("bf16") else torch.float32
    spec = plan_inputs.model_spec(model, parts, trainable, dtype, config.get("gas", 1))
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(resident=1, **config))
    runtime = engine.stronghold_runtime
    cached = frozenset(unit.name for unit in runtime.cached.units.values())
    assert ("rest_placement" in config) == bool(cached), "the case builds the tier it is about"
    on_drive = len(spec.blocks) - runtime.nvme_from
    assert on_drive == config.get("nvme_blocks", 0)
    drive = Drive(free_bytes=2 ** 40, read_bytes_per_s=1e9, write_bytes_per_s=1e9,
                  slots=config.get("nvme_buffers", 4))
    # The blockwise backward's input table keeps its window's rows in place of a whole-table gradient buffer
    # (embedding_rows.py): none before the first walk, whose landing buffers and piece are made outside the meter.
    rows = any(store.row_grads is not None for store in runtime.cached.stores.values())
    budgets = Budgets(gpu_bytes=2 ** 40, host_bytes=2 ** 40, drive=drive, window_rows_numel=0 if rows else None)
    planned = host_bytes(spec, budgets, runtime.resident_count, lean=runtime.lean_until - runtime.resident_count,
                         gpu_accumulation=False, cached=cached, spares=runtime.gradient_spares, nvme=on_drive,
                         compact=runtime.compact_master, pooled=runtime.pooled_grads,
                         blockwise=runtime.blockwise is not None)
    assert runtime.compact_master == config.get("compact_master", False)
    assert all((s.master_lo is not None) == runtime.compact_master for s in runtime.stores.values())
    table = next((p.trainable_numel for p in spec.rest_parts if p.name == "input"), 0)
    assert planned.total - (min(ROW_PIECE_BYTES, 4 * table) if rows else 0) == runtime.host_bytes.live
    assert rows == (runtime.blockwise is not None and "input" in cached and not tie)
    spared = [store.grad_spare is not None for store in [*runtime.stores.values(), *runtime.cached.stores.values()]]
    if runtime.blockwise is not None:  # a cached output part still sums on the host, with its spare
        assert not runtime.gradient_spares and not any(s.grad_spare is not None for s in runtime.stores.values())
        assert all(s.accum is None for s in runtime.stores.values())
    else:
        assert all(spared) == runtime.gradient_spares and any(spared) == runtime.gradient_spares, \
            "the parts outside the blocks keep a spare gradient buffer exactly where the blocks do"
    engine.destroy()


def test_the_blockwise_input_table_is_planned_as_its_windows_rows():
    """Once a training forward has shown the window's tokens, the blockwise plan counts the input table's gradient as
    their rows and one piece (embedding_rows.py), not the whole table; before, and without rows, the whole table."""
    model = tiny_llama(5)
    spec = plan_inputs.model_spec(model, find_blocks(model, None, None), {id(p) for p in model.parameters()},
                                  torch.float32, 4)
    table = next(p for p in spec.rest_parts if p.name == "input")
    assert table.row_gradients and table.trainable_numel == 96 * 32

    def grads(rows, blockwise=True, cached=frozenset({"input"})):
        budgets = Budgets(gpu_bytes=2 ** 40, host_bytes=2 ** 40, window_rows_numel=rows)
        return host_bytes(spec, budgets, 1, cached=cached, spares=False, blockwise=blockwise).grads

    piece = min(ROW_PIECE_BYTES, 4 * 96 * 32)  # a piece is at most the table
    assert grads(None) - grads(40 * 32) == 4 * (96 - 40) * 32 - piece
    assert grads(200 * 32) == grads(None) + piece  # more rows than the table has: the table, and a piece
    assert grads(40 * 32, blockwise=False) == grads(None, blockwise=False)
    assert grads(40 * 32, cached=frozenset()) == grads(None, cached=frozenset())
