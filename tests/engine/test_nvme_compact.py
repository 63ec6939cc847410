"""Compact masters on the drive (streaming/nvme.py with `compact`): a drive block's file holds its moments and the
master's low half, the working copy the high half. The update runs on the staged halves with the same kernel
(`step_compact`) and every other hold merges and splits as compact.py's do, so training equals compact masters in
host memory bit for bit, and full masters up to the compact tests' ulps (test_compact_master.py)."""
import copy

import pytest
import torch

import stronghold
from stronghold.planning.plan_bytes import drive_staging_bytes, state_file_bytes, store_bytes

from .helpers import batches, ds_config, run_steps, tiny_llama, train_caught_up
from .test_compact_master import _compare, promoted_midway
from .test_nvme import _spike_embeddings

LR = 3e-3
CLIP = 0.5  # under this model's gradient norms (~1-3): every step clips


def _engine(model, **config):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model),
                                            config=ds_config(lr=LR, bf16=True, compact_master=True, **config))
    return engine


def _same(a, b) -> None:
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
    masters, expected = a.stronghold_runtime.master_params(), b.stronghold_runtime.master_params()
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(masters[id(p)], expected[id(q)]), "the fp32 masters merged from the drive's low halves"


@pytest.mark.parametrize("case", ["accumulation", "redo", "weights_first"])
def test_compact_masters_on_the_drive_train_as_in_host_memory(tmp_path, case):
    """Four blocks on the drive through two staging buffers (each update reads its block back): clipped steps with
    accumulation; an early update redone under clipping (a merged hold that writes); weights first asked for (compact
    stores skip the preview, which would overwrite the high half)."""
    model, data = tiny_llama(5), batches(8)
    config = {"accumulation": dict(gas=2, clip=CLIP), "redo": dict(clip=10.0),
              "weights_first": dict(gas=2, clip=CLIP, weights_first=True)}[case]
    loss = _spike_embeddings(3) if case == "redo" else (lambda engine, batch, i: engine(**batch).loss)

    def train(**extra):
        return train_caught_up(_engine(model, window=2, resident=1, **config, **extra), data, loss)

    on_drive = train(nvme_path=str(tmp_path), nvme_blocks=4, nvme_buffers=2)
    runtime = on_drive.stronghold_runtime
    drive_stores = [s for s in runtime.stores.values() if s.tier is runtime.nvme]
    assert [s.index for s in drive_stores] == [1, 2, 3, 4]
    assert all(s.compact and s.master is None and s.master_lo is None and s.exp_avg is None for s in drive_stores)
    t = drive_stores[0].trainable_numel
    assert all(f.nbytes == state_file_bytes(t, 2, compact=True) < state_file_bytes(t, 2)
               for f in runtime.nvme.files.values()), "10 bytes a parameter on the drive, not 12"
    stats = runtime.cpu.stats
    if case == "redo":
        assert stats.redo_blocks > 0, "the spike must make step() redo early updates"
    if case == "weights_first":
        assert stats.weights_first_blocks == 0
    _same(on_drive, train())


def test_checkpoints_and_blocks_brought_back_to_host_memory(tmp_path):
    """A checkpoint of drive blocks with compact masters holds full fp32 masters: a run with them in host memory
    resumes from it bit for bit. Blocks brought back to host memory (runtime.states_to_host) get their whole fp32
    master back and train on as full masters do, up to the compact ulps."""
    model, data = tiny_llama(5), batches(10)
    config = dict(window=2, resident=1, gas=2, clip=CLIP)
    drive = dict(nvme_path=str(tmp_path / "drive"), nvme_blocks=3, nvme_buffers=2)
    (tmp_path / "drive").mkdir()
    whole = _engine(model, **config)
    run_steps(whole, data)
    first = _engine(model, **config, **drive)
    run_steps(first, data[:6])
    first.save_checkpoint(tmp_path / "ckpt")
    runtime = first.stronghold_runtime
    runtime.states_to_host(3)
    moved = runtime.stores[2]
    assert moved.tier is None and moved.master is not None and not moved.compact
    run_steps(first, data[6:])
    _compare(first, whole, steps=len(data))
    for extra in ({}, drive):  # into compact masters in host memory, and on the drive
        resumed = _engine(model, **config, **extra)
        resumed.load_checkpoint(tmp_path / "ckpt")
        run_steps(resumed, data[6:])
        _same(resumed, whole)
        resumed.destroy()


def test_drive_blocks_promoted_to_the_gpu_train_on_as_host_ones(tmp_path):
    """Promotion takes a drive block's merged master and moments to the GPU optimizer, as it takes a host compact
    block's: training goes on bit for bit alike."""
    model, data = tiny_llama(4), batches(8)
    on_drive = promoted_midway(_engine, model, data, nvme_path=str(tmp_path), nvme_blocks=3, nvme_buffers=2)
    runtime = on_drive.stronghold_runtime
    assert sorted(runtime.nvme.files) == [3] and runtime.stores[3].compact
    _same(on_drive, promoted_midway(_engine, model, data))


def test_the_planned_host_and_drive_bytes_are_the_tier_as_built(tmp_path):
    """The planner's model of a compact drive tier (plan_bytes) is what the runtime's meter counts."""
    model = tiny_llama(5)
    engine = _engine(model, window=2, resident=1, gas=2, nvme_path=str(tmp_path), nvme_blocks=3, nvme_buffers=2)
    runtime = engine.stronghold_runtime
    t = max(s.trainable_numel for s in runtime.stores.values())
    tier = runtime.nvme
    assert tier.bytes_on_drive == sum(state_file_bytes(s.trainable_numel, 2, compact=True)
                                      for s in runtime.stores.values() if s.tier is tier)
    staged = sum(s.buffer.numel() for s in tier.slots) + tier._merged.numel() * 4
    assert staged == drive_staging_bytes(t, 2, 2, compact=True)
    blocks = [(s.numel, s.trainable_numel) for _, s in sorted(runtime.stores.items())]
    planned = store_bytes(blocks, 2, True, on_drive=3, drive_slots=2, compact=True, pooled=runtime.pooled_grads,
                          spares=runtime.gradient_spares)
    assert runtime.host_bytes.live <= planned.total
