"""Checkpoint integrity (stronghold/checkpoint/files.py): every byte of a saved checkpoint is checked
against its manifest before anything is loaded, errors name the file and the tensor or record, older
checkpoints without a manifest still load (with a warning), and a killed save's leftovers go away."""
import copy
import json
import shutil
import struct
import zipfile

import pytest
import torch

import stronghold
from stronghold.checkpoint import save as checkpoint
from stronghold.checkpoint import load as checkpoint_load
from stronghold.checkpoint.files import MANIFEST
from tests.engine.helpers import batches, ds_config, relative_error, run_steps, tiny_gpt2

TAG = "global_step2"


def make_engine(model):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(window=2, resident=1))
    return engine


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint, saved after 2 steps, that each test copies and damages; and the model it came from."""
    model = tiny_gpt2(4)
    engine = make_engine(model)
    run_steps(engine, batches(2))
    root = tmp_path_factory.mktemp("saved")
    engine.save_checkpoint(root)
    return root, model, {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.fixture
def copy_of(saved, tmp_path):
    root, _, _ = saved
    shutil.copytree(root, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def tensor_range(directory, key):
    """(shard, start, end) of a tensor's bytes, from the safetensors header."""
    for shard in sorted(directory.glob("*.safetensors")):
        raw = shard.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        if key in header:
            begin, end = header[key]["data_offsets"]
            return shard, 8 + length + begin, 8 + length + end
    raise KeyError(key)


def record_range(path, suffix):
    """(start, end) of the bytes of the zip record (of torch.save's archive) whose name ends in `suffix`."""
    with open(path, "rb") as raw, zipfile.ZipFile(raw) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
        raw.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", raw.read(4))
        start = info.header_offset + 30 + name_length + extra_length
        return info.filename, start, start + info.compress_size


def assert_rejected(directory, saved, match):
    """Loading fails with `match` and leaves a fresh engine exactly as it was."""
    _, model, _ = saved
    engine = make_engine(model)
    engine.synchronize_host()
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(ValueError, match=match):
        engine.load_checkpoint(directory)
    engine.synchronize_host()
    assert engine.global_steps == 0
    assert all(torch.equal(p.detach(), before[n]) for n, p in engine.module.named_parameters())


def test_manifest_lists_every_file_and_the_checkpoint_loads(copy_of, saved):
    listed = json.loads((copy_of / TAG / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in (copy_of / TAG).iterdir()} - {MANIFEST}
    assert set(listed) == on_disk and {checkpoint.META, checkpoint.INFO} <= on_disk
    for entry in listed.values():  # the parts tile each file: no byte goes unchecked
        ends = [(start, end) for _, start, end, _ in entry["parts"]]
        assert ends[0][0] == 0 and ends[-1][1] == entry["bytes"]
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    engine = make_engine(saved[1])
    engine.load_checkpoint(copy_of)
    engine.synchronize_host()
    assert all(torch.equal(p.detach(), saved[2][n]) for n, p in engine.module.named_parameters())


@pytest.mark.parametrize("key", ["exp_avg/transformer.h.2.attn.c_attn.weight", "master/transformer.h.3.mlp.c_fc.bias",
                                 "master/transformer.wte.weight"])
def test_flipped_byte_in_a_tensor_names_the_file_and_tensor(copy_of, saved, key):
    shard, start, end = tensor_range(copy_of / TAG, key)
    flip(shard, (start + end) // 2)
    assert_rejected(copy_of, saved, f"{shard.name} is corrupt: the checksum of its tensor '{key}'")


def test_flipped_byte_in_a_shard_header_is_rejected(copy_of, saved):
    shard = sorted((copy_of / TAG).glob("*.safetensors"))[1]
    flip(shard, 20)
    assert_rejected(copy_of, saved, f"{shard.name} is corrupt: the checksum of its header")


@pytest.mark.parametrize("record", ["data.pkl", "data/0"])
def test_flipped_byte_in_a_meta_record_names_the_record(copy_of, saved, record):
    """data.pkl holds the structure and plain values (counters, groups, client state); data/N a tensor
    (RNG states)."""
    meta = copy_of / TAG / checkpoint.META
    name, start, end = record_range(meta, record)
    flip(meta, (start + end) // 2)
    assert_rejected(copy_of, saved, f"meta.pt is corrupt: the checksum of its record '{name}'")


def test_flipped_byte_in_the_config_file_is_rejected(copy_of, saved):
    info = copy_of / TAG / checkpoint.INFO
    flip(info, info.stat().st_size // 2)
    assert_rejected(copy_of, saved, "stronghold.json is corrupt")
    with pytest.raises(ValueError, match="stronghold.json is corrupt"):
        checkpoint_load.saved_config(copy_of)


def test_missing_truncated_and_extra_files_are_rejected(copy_of, saved):
    shards = sorted((copy_of / TAG).glob("*.safetensors"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[:-1])
    assert_rejected(copy_of, saved, f"{shards[0].name} is {len(data) - 1} bytes, the manifest records {len(data)}")
    shards[0].write_bytes(data)
    second = shards[1].read_bytes()
    shards[1].unlink()
    assert_rejected(copy_of, saved, f"{shards[1].name} is missing")
    shards[1].write_bytes(second)
    (copy_of / TAG / "state-00099.safetensors").write_bytes(data)
    assert_rejected(copy_of, saved, r"state-00099.safetensors is not in the manifest")


def test_damaged_manifest_is_told_apart_from_damaged_files(copy_of, saved):
    manifest = copy_of / TAG / MANIFEST
    forged = json.loads(manifest.read_text())
    first = next(iter(forged["files"]))
    forged["files"][first]["parts"][0][3] = "0" * 64  # a listed checksum damaged, the file itself intact
    manifest.write_text(json.dumps(forged))
    assert_rejected(copy_of, saved, "manifest .*manifest.json is corrupt")
    manifest.write_text("{not json")
    assert_rejected(copy_of, saved, "manifest .*manifest.json cannot be read")
    manifest.unlink()
    assert_rejected(copy_of, saved, "has no manifest.json, which every format-2 checkpoint has")


def _as_format_1(directory):
    """What the previous stronghold wrote: the same files, format 1, no manifest."""
    (directory / MANIFEST).unlink()
    meta = torch.load(directory / checkpoint.META, weights_only=True)
    torch.save({**meta, "format": 1}, directory / checkpoint.META)
    info = json.loads((directory / checkpoint.INFO).read_text())
    (directory / checkpoint.INFO).write_text(json.dumps({**info, "format": 1}))


def test_previous_format_loads_unverified_with_a_warning(copy_of, saved):
    _, model, at_save = saved
    _as_format_1(copy_of / TAG)
    engine = make_engine(model)
    with pytest.warns(UserWarning, match="format 1, no checksums.*unverified"):
        engine.load_checkpoint(copy_of)
    engine.synchronize_host()
    assert engine.global_steps == 2
    assert all(torch.equal(p.detach(), at_save[n]) for n, p in engine.module.named_parameters())


def test_corrupt_meta_without_a_manifest_names_the_file(copy_of, saved):
    """Before checksums, a damaged meta.pt surfaced as a bare `OSError: [Errno 22] Invalid argument`."""
    _as_format_1(copy_of / TAG)
    meta = copy_of / TAG / checkpoint.META
    meta.write_bytes(meta.read_bytes()[:-40])
    assert_rejected(copy_of, saved, r"meta\.pt cannot be read as checkpoint metadata")


def test_a_killed_save_is_cleaned_up_by_the_next(tmp_path, saved):
    """A save killed midway (no Python cleanup ran) leaves hidden .partial entries; the next save into the
    same directory removes them, whatever their tag, and its checkpoint loads."""
    _, model, _ = saved
    (tmp_path / ".global_step7.partial").mkdir(parents=True)
    (tmp_path / ".global_step7.partial" / "state-00000.safetensors").write_bytes(b"half")
    (tmp_path / ".latest.partial").write_text("global_step7")
    engine = make_engine(model)
    run_steps(engine, batches(1))
    engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "latest"]
    fresh = make_engine(model)
    fresh.load_checkpoint(tmp_path)
    fresh.synchronize_host()
    assert relative_error(fresh.module, engine.module) == 0.0
