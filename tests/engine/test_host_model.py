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
    budgets = Budgets(gpu_bytes=2 ** 40, host_bytes=2 ** 40, drive=drive)
    planned = host_bytes(spec, budgets, runtime.resident_count, lean=runtime.lean_until - runtime.resident_count,
                         gpu_accumulation=False, cached=cached, spares=runtime.gradient_spares, nvme=on_drive,
                         compact=runtime.compact_master, pooled=runtime.pooled_grads,
                         blockwise=runtime.blockwise is not None)
    assert runtime.compact_master == config.get("compact_master", False)
    assert all((s.master_lo is not None) == runtime.compact_master for s in runtime.stores.values())
    assert planned.total == runtime.host_bytes.live
    spared = [store.grad_spare is not None for store in [*runtime.stores.values(), *runtime.cached.stores.values()]]
    if runtime.blockwise is not None:  # a cached output part still sums on the host, with its spare
        assert not runtime.gradient_spares and not any(s.grad_spare is not None for s in runtime.stores.values())
        assert all(s.accum is None for s in runtime.stores.values())
    else:
        assert all(spared) == runtime.gradient_spares and any(spared) == runtime.gradient_spares, \
            "the parts outside the blocks keep a spare gradient buffer exactly where the blocks do"
    engine.destroy()
