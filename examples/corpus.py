"""The embedded training data: a byte-level corpus generated from this repository's own text.

No downloads: the corpus is the UTF-8 bytes of the repo's Python sources and Markdown files, in
sorted path order, so every clone produces the same corpus. Tokens are bytes (vocabulary 256).
"""
from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256


def corpus_bytes(root: Path = ROOT) -> bytes:
    files = sorted(p for pattern in ("stronghold/**/*.py", "stronghold_ops/**/*.py", "examples/**/*.py",
                                     "*.md", "stronghold/**/csrc/*.c")
                   for p in root.glob(pattern))
    data = b"\n".join(p.read_bytes() for p in files)
    if len(data) < 4096:
        raise ValueError(f"the embedded corpus under {root} is only {len(data)} bytes; run from a full checkout")
    return data


class ByteBatches:
    """Random windows of `seq` bytes (input) and the same window as labels (HF shifts them)."""

    def __init__(self, data: bytes, seq: int, batch: int, seed: int = 0):
        if len(data) <= seq + 1:
            raise ValueError(f"sequence length {seq} is longer than the corpus ({len(data)} bytes)")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq, self.batch = seq, batch
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        starts = torch.randint(0, len(self.tokens) - self.seq, (self.batch,), generator=self.generator)
        ids = torch.stack([self.tokens[s:s + self.seq] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}
