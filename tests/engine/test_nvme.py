"""The NVMe tier (streaming/nvme.py): streamed blocks' fp32 master and moments in files on a drive, staged through a
few host buffers. The same AdamW kernel runs on the staged state, so training equals the host tier bit for bit, and
plain torch AdamW at the equivalence tests' bar; checkpoints keep their format and resume exactly."""
import copy
import errno
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

import stronghold
from stronghold.streaming import nvme, nvme_setup
from stronghold.planning.plan_bytes import store_bytes
from stronghold.streaming.store import counts, cpu_param_bytes
from stronghold.engine import runtime as runtime_module

from .helpers import (batches, ds_config, failing_call, relative_error, run_steps, tiny_llama, train_caught_up,
                      train_reference)

LR = 3e-3
TOL = 1e-5  # fp32, the equivalence tests' bar
CLIP = 0.5  # under this model's gradient norms (~1-3): every step clips


def _engine(model, tmp_path, **config):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(lr=LR, **config))
    return engine


def _on_drive(engine) -> list[int]:
    runtime = engine.stronghold_runtime
    return sorted(i for i, s in runtime.stores.items() if s.tier is not None)


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters()))


def test_nvme_tier_equals_torch_adamw_and_the_host_tier(tmp_path):
    """Five steps of two micro-steps each, every step clipped, every streamed block's state on the drive and only
    two staging buffers, so each update reads its block back from its file."""
    model, data = tiny_llama(6), batches(10)
    reference, _ = train_reference(model, data, lr=LR, gas=2, clip=CLIP)
    config = dict(window=2, resident=1, gas=2, clip=CLIP)
    on_drive = _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_blocks=5, nvme_buffers=2, **config)
    run_steps(on_drive, data)
    tier = on_drive.stronghold_runtime.nvme
    assert _on_drive(on_drive) == [1, 2, 3, 4, 5]
    assert all(s.exp_avg is None and s.exp_avg_sq is None for s in on_drive.stronghold_runtime.stores.values()), \
        "in fp32 the moments leave host memory (the working copy is the master)"
    # Five blocks through two buffers: every step reads each block from its file at least once.
    assert tier.stats.read_bytes >= 5 * tier.bytes_on_drive
    # Each job's block is queued for reading before the job is, so every hold finds its block being read already.
    assert tier.stats.reads_on_demand == 0
    report = on_drive.stronghold_report()["nvme"]
    assert report["read_bytes_per_step"] >= tier.bytes_on_drive and report["busy_s_per_step"] > 0
    assert on_drive.stronghold_runtime.grad_norm() > CLIP, "the step must clip"
    assert relative_error(on_drive.module, reference) <= TOL
    in_memory = _engine(model, tmp_path, **config)
    run_steps(in_memory, data)
    assert _bitwise_equal(on_drive, in_memory)
    directory = tier.directory
    assert not directory.exists(), "no file has a name, nor a directory: a process killed without clean-up leaves none"
    on_drive.destroy()
    assert not directory.exists()


def _spike_embeddings(step):
    """A loss whose embedding gradient is huge at `step` only: the streamed blocks, under the limit, are updated
    early, then redone with the clip coefficient (cpu_optim.py's redo on states read back from the drive)."""
    def loss(engine, batch, i):
        out = engine(**batch).loss
        return out + 1e4 * engine.module.model.embed_tokens.weight.square().sum() if i == step else out
    return loss


@pytest.mark.parametrize("case", ["redo", "bf16_weights_first", "bf16_lean"])
def test_nvme_tier_is_bitwise_the_host_tier(tmp_path, case):
    """The paths that touch the state more than once per step: an early update redone under clipping, a deferred
    update previewed (weights first) then completed, and bf16 (the fp32 master on the drive too), with lean blocks
    whose skipped-step restore reads the master back."""
    model, data = tiny_llama(5), batches(6)
    config = {"redo": dict(clip=10.0),
              "bf16_weights_first": dict(bf16=True, gas=2, clip=CLIP, weights_first=True),
              "bf16_lean": dict(bf16=True, clip=CLIP, lean_blocks=2)}[case]
    loss = _spike_embeddings(2) if case == "redo" else (lambda engine, batch, i: engine(**batch).loss)

    def train(**extra):
        return train_caught_up(_engine(model, tmp_path, window=2, resident=1, **config, **extra), data, loss)

    on_drive = train(nvme_path=str(tmp_path), nvme_blocks=4, nvme_buffers=2)
    in_memory = train()
    assert _on_drive(on_drive) == [1, 2, 3, 4]
    stats = on_drive.stronghold_runtime.cpu.stats
    if case == "redo":
        assert stats.redo_blocks > 0, "the spike must make step() redo early updates"
    if case == "bf16_weights_first":
        assert stats.weights_first_blocks > 0, "the deferred updates must go weights first"
    if case.startswith("bf16"):
        assert all(s.master is None for s in on_drive.stronghold_runtime.stores.values())
    assert _bitwise_equal(on_drive, in_memory)
    masters, expected = on_drive.stronghold_runtime.master_params(), in_memory.stronghold_runtime.master_params()
    for p, q in zip(on_drive.module.parameters(), in_memory.module.parameters()):
        assert torch.equal(masters[id(p)], expected[id(q)]), "the fp32 masters read back from the drive"


def test_checkpoint_from_the_nvme_tier_resumes_exactly(tmp_path):
    model, data = tiny_llama(5), batches(10)
    config = dict(window=2, resident=1, gas=2, clip=CLIP)
    drive = dict(nvme_path=str(tmp_path), nvme_blocks=3, nvme_buffers=2)
    whole = _engine(model, tmp_path, **config, **drive)
    run_steps(whole, data)
    first = _engine(model, tmp_path, **config, **drive)
    run_steps(first, data[:6])
    first.save_checkpoint(tmp_path / "ckpt")
    first.destroy()
    resumed = _engine(model, tmp_path, **config, **drive)
    resumed.load_checkpoint(tmp_path / "ckpt")
    run_steps(resumed, data[6:])
    assert _bitwise_equal(resumed, whole)
    # The same format as the host tier's: a run without the tier resumes from it too.
    in_memory = _engine(model, tmp_path, **config)
    in_memory.load_checkpoint(tmp_path / "ckpt")
    run_steps(in_memory, data[6:])
    assert _bitwise_equal(in_memory, whole)


@pytest.mark.parametrize("bf16", [False, True])
def test_blocks_brought_back_to_host_memory_train_on_exactly(tmp_path, bf16):
    """A later plan with room brings the first drive blocks' states back to host memory between steps
    (runtime.states_to_host, which placement.py calls on a GPU): training goes on bit for bit as in the host tier,
    those blocks' files and the staging buffers they no longer need are gone, and with none left the tier closes."""
    model, data = tiny_llama(5), batches(8)
    config = dict(window=2, resident=1, gas=2, clip=CLIP, bf16=bf16)
    engine = _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_blocks=4, nvme_buffers=3, **config)
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:4])
    tier, directory = runtime.nvme, runtime.nvme.directory
    runtime.states_to_host(4)
    assert _on_drive(engine) == [4] and runtime.nvme_from == 4 and sorted(tier.files) == [4]
    assert len(tier.slots) == 1, "one block left on the drive needs one staging buffer"
    moved = runtime.stores[2]
    assert moved.exp_avg is not None and (moved.master is not None) and moved.exp_avg.abs().sum() > 0
    run_steps(engine, data[4:6])
    runtime.states_to_host(9)  # past the last block: every block
    assert runtime.nvme is None and not directory.exists() and runtime.nvme_from == 5
    run_steps(engine, data[6:])
    in_memory = _engine(model, tmp_path, **config)
    run_steps(in_memory, data)
    assert _bitwise_equal(engine, in_memory)
    with pytest.raises(ValueError, match="between backward"):
        engine.backward(engine(**data[0]).loss)
        runtime.states_to_host(5)


def test_promoting_drive_blocks_trains_on_exactly_and_drops_their_files(tmp_path):
    model, data = tiny_llama(4), batches(8)
    config = dict(window=2, resident=1, gas=2, clip=CLIP)

    def train(**extra):
        engine = _engine(model, tmp_path, **config, **extra)
        run_steps(engine, data[:4])
        engine.stronghold_runtime.promote(3, 2)
        run_steps(engine, data[4:])
        return engine
    on_drive = train(nvme_path=str(tmp_path), nvme_blocks=3, nvme_buffers=2)
    assert _on_drive(on_drive) == [3]
    assert sorted(on_drive.stronghold_runtime.nvme.files) == [3]
    assert _bitwise_equal(on_drive, train())


def test_bad_nvme_path_fails_before_anything_is_built(tmp_path, monkeypatch):
    model = tiny_llama(3)
    with pytest.raises(ValueError, match="is not a directory"):
        _engine(model, tmp_path, nvme_path=str(tmp_path / "missing"), nvme_blocks=1)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        _engine(model, tmp_path, nvme_path=str(tmp_path / "file"), nvme_blocks=1)
    with pytest.raises(ValueError, match="nvme_path is not set"):
        _engine(model, tmp_path, nvme_blocks=1)

    class Full:
        free = 4096
    monkeypatch.setattr(nvme_setup.shutil, "disk_usage", lambda path: Full())
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB .* \(4096 bytes\) free") as err:
        _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_blocks=2)
    assert "nvme_blocks" in str(err.value)
    assert not list(tmp_path.glob("stronghold-nvme-*")), "nothing was made on the drive"


def test_a_directory_on_tmpfs_is_refused_with_what_to_do(tmp_path):
    """Files on tmpfs are host memory: the tier's states there would take what it frees. Judged by the mount table's
    longest prefix of the directory."""
    from stronghold.streaming.nvme_path import check_path, filesystem_type

    drive, shm = tmp_path / "drive", tmp_path / "drive" / "shm"
    shm.mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\n/dev/nvme0n1 {drive} xfs rw 0 0\ntmpfs {shm} tmpfs rw 0 0\n")
    assert (filesystem_type(drive, str(mounts)), filesystem_type(shm, str(mounts))) == ("xfs", "tmpfs")
    assert check_path(str(drive), str(mounts)) == drive
    with pytest.raises(ValueError, match=r"is on tmpfs, which keeps its files in host memory.*df -T"):
        check_path(str(shm), str(mounts))
    assert filesystem_type(drive, str(tmp_path / "none")) is None  # no mount table: nothing to judge by
    model = tiny_llama(3)
    with pytest.raises(ValueError, match="is on tmpfs"):
        with mock.patch("stronghold.streaming.nvme_path.MOUNTS", str(mounts)):
            _engine(model, tmp_path, nvme_path=str(shm), nvme_blocks=1)
    assert not list(shm.iterdir()), "nothing was made there"


def test_auto_puts_the_fewest_blocks_on_the_drive(tmp_path, monkeypatch):
    """Under a host budget that the states fit only with three streamed blocks' on the drive (two staging buffers
    cost two blocks' states), "auto" puts exactly three there."""
    model = tiny_llama(6)
    engine = _engine(model, tmp_path)
    layouts = [counts(s.entries) for _, s in sorted(engine.stronghold_runtime.stores.items())]
    engine.destroy()
    freed = cpu_param_bytes(model)
    margin = 4 * 2 ** 30  # plan_types.DEFAULT_HOST_MARGIN_MIN_BYTES, the margin of a budget this small

    def needed(on_drive):
        return store_bytes(layouts, 4, False, on_drive=on_drive, drive_slots=2).total - freed + margin
    assert needed(2) >= needed(0) > needed(3), "two buffers (aligned to 4 KiB) cost what two blocks' states save"
    monkeypatch.setattr(runtime_module, "host_available", lambda limit: needed(3))
    engine = _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_buffers=2)
    assert _on_drive(engine) == [3, 4, 5], "the last streamed blocks, and no more than needed"
    run_steps(engine, batches(2))
    monkeypatch.setattr(runtime_module, "host_available", lambda limit: needed(5) - 1)
    with pytest.raises(MemoryError, match="host memory"):
        _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_buffers=2)


def _stores(n_blocks, numel=3000):
    from stronghold.streaming.store import build_block_store, order_entries
    torch.manual_seed(0)
    stores = []
    for i in range(n_blocks):
        # Integer values: the sums below are exact in fp32, whatever the order of the additions.
        params = [("w", torch.nn.Parameter(torch.randint(-9, 9, (numel,)).float())),
                  ("b", torch.nn.Parameter(torch.randint(-9, 9, (7,)).float()))]
        entries = order_entries(params, {id(p): 0 for _, p in params})
        stores.append(build_block_store(i, entries, torch.bfloat16, pin=False, accumulate=False))
    return stores


def test_the_state_is_where_the_last_write_left_it(tmp_path):
    """Updates through one staging buffer shared by two threads, each block evicted and read back between any two
    holds: no update is lost and the masters come back as written (a read never passes its block's last write)."""
    import threading
    stores = _stores(4)
    masters = [s.master.clone() for s in stores]
    tier = nvme.NvmeStates(tmp_path, torch.bfloat16, max(s.trainable_numel for s in stores), slots=1)
    for store in stores:
        tier.add(store)
    assert all(s.master is None and s.exp_avg is None for s in stores)
    rounds = 25

    def work(mine):
        for _ in range(rounds):
            for store in mine:
                with store.states() as (master, exp_avg, exp_avg_sq):
                    master.add_(1.0)
                    exp_avg.add_(2.0)
                    exp_avg_sq.add_(store.index)
    threads = [threading.Thread(target=work, args=(stores[k::2],)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for store, master in zip(stores, masters):
        with store.states(write=False) as (m, a, v):
            assert torch.equal(m, master + rounds)
            assert torch.equal(a, torch.full_like(a, 2.0 * rounds))
            assert torch.equal(v, torch.full_like(v, float(store.index * rounds)))
    assert tier.stats.reads_on_demand >= 4 * rounds, "one buffer: every hold of another block reads its file"
    directory = tier.directory
    tier.close()
    assert not directory.exists()


def test_a_save_that_fails_midway_leaves_the_last_checkpoint_and_the_run_intact(tmp_path, monkeypatch):
    """A save killed while it reads the drive's blocks: the previous checkpoint is what a fresh run loads, and the
    run that failed to save goes on exactly as one that never tried (a save only reads the states)."""
    from stronghold.checkpoint import save as checkpoint
    model, data = tiny_llama(4), batches(6)
    config = dict(window=2, resident=1, clip=CLIP, nvme_path=str(tmp_path), nvme_blocks=3, nvme_buffers=2)
    engine, untouched = _engine(model, tmp_path, **config), _engine(model, tmp_path, **config)
    run_steps(engine, data[:2])
    run_steps(untouched, data[:2])
    engine.save_checkpoint(tmp_path / "ckpt")
    at_save = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    run_steps(engine, data[2:4])
    run_steps(untouched, data[2:4])
    real, calls = checkpoint.save_file, []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:  # the third unit: blocks 1 and 2 are saved, block 3 was just read from the drive
            raise OSError("disk full (injected)")
        return real(tensors, path, metadata=metadata)
    monkeypatch.setattr(checkpoint, "save_file", failing)
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(checkpoint, "save_file", real)
    fresh = _engine(model, tmp_path, **config)
    fresh.load_checkpoint(tmp_path / "ckpt")
    fresh.synchronize_host()
    for name, param in fresh.module.named_parameters():
        assert torch.equal(param.detach(), at_save[name]), name
    run_steps(engine, data[4:])
    run_steps(untouched, data[4:])
    assert _bitwise_equal(engine, untouched)


KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # a free port of its own, not the test process's
    from stronghold.engine.launch import single_process_env
    single_process_env()
    from stronghold.streaming import nvme_path
    nvme_path.MOUNTS = "/nonexistent/mounts"  # as tests/conftest.py's fixture: the temporary directory may be tmpfs
    from tests.engine.helpers import batches, ds_config, tiny_llama
    import stronghold

    engine, _, _, _ = stronghold.initialize(model=tiny_llama(4), config=ds_config(
        window=2, resident=1, gas=2, nvme_path={drive!r}, nvme_blocks=2, nvme_buffers=2))
    for batch in batches(2):
        engine.backward(engine(**batch).loss)
        engine.step()
    print(sorted(os.listdir({drive!r})), len(engine.stronghold_runtime.nvme.files), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no exit handler, no finalizer: as the OOM killer or a preemption ends it
""")


def test_a_job_killed_while_training_on_the_drive_leaves_nothing_there(tmp_path):
    """Every state file loses its name as soon as it is open, and the tier's directory goes once they all are: a
    process killed with SIGKILL leaves nothing under `nvme_path` (the kernel frees the files' blocks with the
    process's last descriptor)."""
    drive = tmp_path / "drive"
    drive.mkdir()
    root = str(pathlib.Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", KILLED_CHILD.format(root=root, drive=str(drive))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "2"], "two blocks on the drive, nothing with a name there while they train"
    assert list(drive.iterdir()) == []


def test_the_state_files_space_is_reserved_at_start_up(tmp_path, monkeypatch):
    """Every state file's blocks are allocated when it is made (fallocate), so a drive that something else fills later
    fails the start-up, with what to do, and never a state write in the middle of the run; nothing stays on it."""
    from stronghold.streaming import nvme_io

    model = tiny_llama(4)
    engine = _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_blocks=2, nvme_buffers=2)
    tier = engine.stronghold_runtime.nvme
    if nvme_io.FALLOCATE is not None:
        for entry in tier.files.values():
            assert os.fstat(entry.fd).st_blocks * 512 >= entry.nbytes, "allocated, not a sparse file"
    engine.destroy()

    full_after_one, calls = failing_call(2, errno.ENOSPC)
    monkeypatch.setattr(nvme_io, "FALLOCATE", full_after_one)
    with pytest.raises(ValueError, match=r"nvme_path .* filled up while the NVMe tier reserved its files \(block 3"):
        _engine(model, tmp_path, nvme_path=str(tmp_path), nvme_blocks=2, nvme_buffers=2)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_a_drive_that_fails_mid_run_names_itself_and_what_to_do(tmp_path, monkeypatch):
    """A state write that the drive refuses (EIO, or ENOSPC on a copy-on-write filesystem) fails the step with the
    drive's error, naming the NVMe tier, nvme_path and how to go on."""
    model, data = tiny_llama(4), batches(6)
    engine = _engine(model, tmp_path, window=2, resident=1, nvme_path=str(tmp_path), nvme_blocks=2, nvme_buffers=2)
    real, writes = os.pwritev, []

    def failing(fd, buffers, offset):
        writes.append(offset)
        if len(writes) > 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)
    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(RuntimeError) as failed:
        for batch in data:
            engine.backward(engine(**batch).loss)
            engine.step()
    cause = failed.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.EIO
    assert "NVMe tier: writing" in str(cause) and "nvme_path" in str(cause) and "last checkpoint" in str(cause)
