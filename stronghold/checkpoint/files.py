"""The files of a checkpoint directory: checksums, durable writes, and reads that name what is wrong.

`manifest.json`, written last into a tag directory (before the rename that publishes it), records a
SHA-256 of every other file in it, in parts that tile the file: a safetensors shard as its header and
one part per tensor, `meta.pt` (a zip archive, as torch.save writes it) as one part per record and
the zip structure between them, anything else whole. Loading verifies every byte against it first, so
a flipped bit anywhere fails before the engine is touched, with an error that names the file and the
tensor or record. The manifest carries a digest of its own listing, so damage to it is told apart from
damage to the files it lists. Checksums guard against corruption (disk, copy, truncation), not
against someone who rewrites the files and the manifest together.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
READ_BYTES = 8 << 20
"""Bytes per read while hashing: large enough that hashlib (which releases the GIL) dominates."""


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a hidden `.partial` sibling renamed over it)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    fsync(partial)
    os.replace(partial, path)


def remove_stale_partials(save_dir: Path) -> None:
    """Remove the hidden `.<name>.partial` files and directories a killed save left in `save_dir`. One
    process saves into a directory at a time (with data parallel, rank 0 only), so any that exist
    now belong to a save that can no longer finish."""
    for entry in save_dir.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".partial"):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def writable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What safetensors can write: contiguous host tensors that share no memory. Views of a flat host
    buffer and device tensors are copied (one unit at a time); a tensor that is its whole storage already
    (a gathered block's states, sharding.py) is written as it is, so a save holds no second copy of it."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        whole = (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.storage_offset() == 0
                 and storage.nbytes() == tensor.numel() * tensor.element_size() and storage.data_ptr() not in seen)
        seen.add(storage.data_ptr())
        out[key] = tensor if whole else tensor.to("cpu", memory_format=torch.contiguous_format, copy=True)
    return out


# Parts of a file -------------------------------------------------------------------------------
def _tile(found: list[tuple[str, int, int]], size: int, filler: str) -> list[tuple[str, int, int]]:
    """`found` (name, start, end) ranges plus `filler` ranges for the gaps, covering [0, size) exactly."""
    parts, at = [], 0
    for name, start, end in sorted(found, key=lambda part: part[1]):
        if start < at or end < start or end > size:
            return [("file", 0, size)]  # overlapping or out of range: not worth splitting, hash it whole
        if start > at:
            parts.append((filler, at, start))
        if end > start:
            parts.append((name, start, end))
        at = end
    if at < size:
        parts.append((filler, at, size))
    return parts


def _safetensors_parts(path: Path, size: int) -> list[tuple[str, int, int]]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    found = [("header", 0, base)] + [(f"tensor {key!r}", base + info["data_offsets"][0], base + info["data_offsets"][1])
                                     for key, info in header.items() if key != "__metadata__"]
    return _tile(found, size, "padding")


def _zip_parts(path: Path, size: int) -> list[tuple[str, int, int]]:
    found = []
    with open(path, "rb") as raw, zipfile.ZipFile(raw) as archive:
        for info in archive.infolist():
            # The data follows the member's local header: 30 fixed bytes, then its name and extra field.
            raw.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", raw.read(4))
            start = info.header_offset + 30 + name_length + extra_length
            found.append((f"record {info.filename!r}", start, start + info.compress_size))
    return _tile(found, size, "zip structure")


def _parts(path: Path) -> list[tuple[str, int, int]]:
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        return _safetensors_parts(path, size)
    if zipfile.is_zipfile(path):
        return _zip_parts(path, size)
    return [("file", 0, size)]


def _hash_parts(path: Path, parts: Iterable[tuple[str, int, int]]) -> list[str]:
    digests = []
    with open(path, "rb") as f:
        for _, start, end in parts:
            f.seek(start)
            digest, left = hashlib.sha256(), end - start
            while left > 0:
                chunk = f.read(min(READ_BYTES, left))
                if not chunk:
                    break  # shorter than recorded: the digest will not match
                digest.update(chunk)
                left -= len(chunk)
            digests.append(digest.hexdigest())
    return digests


def _listing_digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1, 8)))


def write_manifest(directory: Path) -> None:
    """Checksum every file in `directory` into its manifest (call last, after the files are final)."""
    paths = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)

    def entry(path: Path) -> dict:
        parts = _parts(path)
        return {"bytes": path.stat().st_size,
                "parts": [[name, start, end, digest] for (name, start, end), digest in zip(parts, _hash_parts(path, parts))]}

    with _pool(len(paths)) as pool:
        files = dict(zip((p.name for p in paths), pool.map(entry, paths)))
    manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files, "digest": _listing_digest(files)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync(directory / MANIFEST)


def read_manifest(directory: Path) -> Optional[dict]:
    """The verified listing {file name: entry} of `directory`'s manifest; None where there is none."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        intact = manifest.get("digest") == _listing_digest(files)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"checkpoint manifest {path} cannot be read ({err}); the checkpoint cannot be "
                         "verified") from None
    if not intact or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"checkpoint manifest {path} is corrupt (its digest does not match its listing, or "
                         f"format {manifest.get('format')!r} is not {MANIFEST_FORMAT}); the checkpoint cannot "
                         "be verified")
    return files


def _check_file(path: Path, entry: dict) -> Optional[str]:
    """What is wrong with one file (None when every part matches)."""
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path} is {size} bytes, the manifest records {entry['bytes']} (truncated or overwritten)"
        parts = [(name, start, end) for name, start, end, _ in entry["parts"]]
        for (name, _, _), digest, (_, _, _, want) in zip(parts, _hash_parts(path, parts), entry["parts"]):
            if digest != want:
                return f"{path} is corrupt: the checksum of its {name} does not match the manifest"
    except FileNotFoundError:
        return f"{path} is missing (the manifest lists it)"
    except OSError as err:
        return f"{path} cannot be read ({err})"
    return None


def verify(directory: Path, files: dict, only: Optional[Iterable[str]] = None) -> None:
    """Check every file of `files` (a verified manifest listing), or just those in `only`, and that no
    checkpoint shard outside the listing is present; raise a ValueError naming the first bad file."""
    names = sorted(files if only is None else only)
    with _pool(len(names)) as pool:
        problems = [p for p in pool.map(lambda n: _check_file(directory / n, files[n]) if n in files
                                        else f"{directory / n} is not in the manifest", names) if p]
    if only is None:
        problems += [f"{p} is not in the manifest (a shard that was not part of this save)"
                     for p in sorted(directory.glob("*.safetensors")) if p.name not in files]
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint failed verification: {'; '.join(problems[:3])}{more}")


def load_meta(path: Path) -> Any:
    """torch.load(weights_only=True) that names the file in its errors (torch's say only "Invalid argument"
    or "failed finding central directory" for a damaged archive)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(f"{path}: {err}") from err
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        raise ValueError(f"{path} cannot be read as checkpoint metadata ({type(err).__name__}: {err})") from err
