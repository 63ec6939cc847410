"""The `kernels` sweep's points (issue 10): stronghold's step time with all of stronghold_ops'
kernels, none, and each applicable one alone, per model family, in one run.

The order spreads drift over the run: none, all, each kernel alone, then none and all again (as
`repeat` 1, their own records): the two baselines measure the run-to-run noise that a kernel's gain
must beat (kernels_report.py). Each family runs at its acceptance shape; `--layers` makes it cheaper
(the ratios to `none`, not the absolute times, are what is compared).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from .point import Point, knobs_from_args


@dataclass(frozen=True, kw_only=True)
class KernelShape:
    """A family's acceptance shape for the end-to-end A/B (issue 10)."""

    arch: str
    hidden: int
    heads: int
    layers: int
    seq: int
    batch: int
    accumulation: int
    vocab: int
    resident_blocks: int
    """Blocks kept on the GPU at `layers` (the issue's setting under the 32 GiB cap)."""

    def resident_at(self, layers: int) -> int:
        """Resident blocks for a cheaper run of `layers`: as many blocks streamed as at the full depth
        (their copies and CPU updates are the part of the step the kernels do not change), but at
        least half the blocks resident; the full depth keeps the issue's number."""
        if layers == self.layers:
            return self.resident_blocks
        return layers - min(self.layers - self.resident_blocks, layers // 2)


KERNEL_SHAPES = {
    # GPT-2 1.72 B: the seed's shape, resident 28.
    "gpt2": KernelShape(arch="gpt2", hidden=2048, heads=16, layers=32, seq=1024, batch=4, accumulation=1,
                        vocab=50304, resident_blocks=28),
    # Llama 2.70 B (issue 12's acceptance shape), resident 16.
    "llama": KernelShape(arch="llama", hidden=2560, heads=20, layers=32, seq=2048, batch=2, accumulation=8,
                         vocab=32000, resident_blocks=16),
}


def applicable_kernels(arch: str) -> list[str]:
    """stronghold_ops' kernel kinds that patch something in `arch`'s models, in KINDS order (from the
    family table stronghold_ops.apply uses, so a kernel added there joins the sweep)."""
    from stronghold_ops import KINDS
    from stronghold_ops.patching import FAMILIES

    family = FAMILIES[arch]
    return [kind for kind in KINDS if getattr(family, kind)]


def kernel_sets(arch: str) -> list[tuple[str, Any]]:
    """(label, value of the "kernels" knob) in sweep order, without the repeats."""
    return [("none", False), ("all", True), *[(kind, [kind]) for kind in applicable_kernels(arch)]]


DEFAULT_SETS = [("none", False), ("default", "auto"), ("all", True)]
"""`--kernel-sets defaults`: the engine's default set (the knob's "auto") against none and all, each
run twice, for a shorter check of the defaults chosen from the full A/B."""


def set_label(value: Any) -> str:
    """The label of a "kernels" knob value: none, all, default, or the kernels' names joined by +."""
    if value is False or value == []:
        return "none"
    if value is True:
        return "all"
    if value == "auto":
        return "default"
    return "+".join(value)


def kernels_points(args: argparse.Namespace, arch: str, cap: float | None) -> list[Point]:
    """`arch`'s points in run order: none, all, each alone, none and all again (repeat 1); with
    `--kernel-sets defaults`: none, default, all, and the three again."""
    shape = KERNEL_SHAPES[arch]
    layers = (args.layers or [shape.layers])[0]
    knobs = {k: v for k, v in knobs_from_args(args).items() if k != "kernels"}
    knobs.setdefault("resident_blocks", shape.resident_at(layers))
    base = Point(system="stronghold", arch=arch, layers=layers, hidden=shape.hidden, heads=shape.heads, seq=shape.seq,
                 batch=shape.batch, accumulation=shape.accumulation, vocab=shape.vocab, gpu_cap_GB=cap,
                 warmup_steps=args.warmup_steps, timed_steps=args.timed_steps)
    if getattr(args, "kernel_sets", "all") == "defaults":
        order = [(value, repeat) for repeat in (0, 1) for _, value in DEFAULT_SETS]
    else:
        sets = kernel_sets(arch)
        order = [(value, 0) for _, value in sets] + [(value, 1) for _, value in sets[:2]]
    return [base.with_(stronghold={**knobs, "kernels": value}, repeat=repeat) for value, repeat in order]
