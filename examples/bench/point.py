"""One benchmark point: what to run (system, model shape, GPU cap, stronghold knobs, steps).

A `Point` is the unit the runner runs in one subprocess, the store caches and the sweeps
enumerate. Its `key()` names the measurement, not the run: steps, timeouts and the figure
that asked for it are left out, so a point measured for one figure is reused by another.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from examples.llama import check_shape, default_intermediate

SYSTEMS = ("stronghold", "no_offload", "zero_offload", "zero_infinity")
# Peers that need a drive (--nvme-path), run only when named (nvme_acceptance.sh), never by a sweep's default.
NVME_PEERS = ("zero_infinity_nvme",)
# The offloading peers a user would pick today, each configured as its own documentation recommends
# (peer_engines.py, systems.py): measured point by point (`one`), not by the paper's sweeps, whose
# systems stay SYSTEMS.
PEER_SYSTEMS = ("torchao", "fsdp2_offload", "zenflow")
ALL_SYSTEMS = SYSTEMS + PEER_SYSTEMS + NVME_PEERS
# The systems that run DeepSpeed's own engine (the others: stronghold's, or a plain training loop).
DEEPSPEED_SYSTEMS = ("no_offload", "zero_offload", "zero_infinity", "zenflow", "zero_infinity_nvme")
# The offloading peers of the seed's claims; `no_offload` stands in for Megatron-LM.
OFFLOAD_BASELINES = ("zero_offload", "zero_infinity")
PLAIN_BASELINE = "no_offload"
ARCHS = ("gpt2", "llama", "qwen2")

# Seed shape (stronghold-ae.md): GPT hidden 2048, 16 heads, seq 1024, micro-batch 4.
SEED_HIDDEN = 2048
SEED_HEADS = 16
SEED_SEQ = 1024
SEED_BATCH = 4
# GPT-2's vocabulary rounded up to a multiple of 128 (tensor-core-friendly, as Megatron-LM pads it).
VOCAB = 50304
# The STRONGHOLD paper's card had 32 GB; the cap emulates it at 32 GiB for every system.
SEED_CAP_GB = 32.0
# Every system clips the global gradient norm at 1.0 (DeepSpeed's default).
GRADIENT_CLIPPING = 1.0


@dataclass(frozen=True, kw_only=True)
class Point:
    """A (system, shape, cap, knobs) measurement and how many steps to time it over."""

    system: str
    """One of ALL_SYSTEMS."""
    layers: int
    """Transformer blocks (GPT-2 `n_layer`, Llama `num_hidden_layers`)."""
    arch: str = "gpt2"
    """One of ARCHS: HF GPT2LMHeadModel (tied head), LlamaForCausalLM (untied head, RMSNorm, RoPE, SwiGLU) or
    Qwen2ForCausalLM (Llama's block with biases on q, k and v; untied, as Qwen2.5-7B)."""
    intermediate: int | None = None
    """Llama and Qwen2 only: MLP width; None = Llama's rule (examples/llama.py), see `intermediate_size`."""
    kv_heads: int | None = None
    """Llama and Qwen2 only: key/value heads (grouped-query attention); None = heads, see `num_kv_heads`."""
    hidden: int = SEED_HIDDEN
    heads: int = SEED_HEADS
    seq: int = SEED_SEQ
    """Sequence length in tokens (also GPT-2 `n_positions`)."""
    batch: int = SEED_BATCH
    """Micro-batch size in sequences."""
    accumulation: int = 1
    """Micro-batches per optimizer step (DeepSpeed gradient_accumulation_steps): a timed step is one
    optimizer step of `accumulation` micro-batches, and samples/s and FLOPs count all of them."""
    vocab: int = VOCAB
    gpu_cap_GB: float | None = SEED_CAP_GB
    """GPU memory cap in GiB (2**30 bytes) through set_per_process_memory_fraction; None = uncapped."""
    checkpointing: bool = True
    """HF gradient checkpointing: every block's forward is recomputed in backward."""
    stronghold: dict[str, Any] = field(default_factory=dict)
    """Free-form knobs for the ds.json "stronghold" section (e.g. window_size); stronghold only."""
    cpu_checkpointing: bool = False
    """DeepSpeed systems only: the model's checkpointed blocks call deepspeed.checkpointing.checkpoint
    with the ds.json `activation_checkpointing` section's cpu_checkpointing on (each block's input
    kept in host memory), instead of HF's torch checkpointing. Needs checkpointing."""
    clipping: float = GRADIENT_CLIPPING
    """ds.json gradient_clipping, every system; 0 = off. Off is a diagnostic: with clipping on, stronghold's
    streamed AdamW waits for the global norm (speculation.py), so the pair on/off in one run shows that cost."""
    repeat: int = 0
    """0: the measurement; n > 0: the same point measured again as its own record (the kernels
    sweep repeats its baselines to measure run-to-run noise)."""
    warmup_steps: int = 2
    timed_steps: int = 3
    nvme_path: str | None = None
    """NVME_PEERS only: the directory on the drive their states (and parameters) are swapped to. stronghold's NVMe
    tier takes its own from the knobs ("nvme_path")."""

    def __post_init__(self) -> None:
        if self.system not in ALL_SYSTEMS:
            raise ValueError(f"unknown system {self.system!r}: pick one of {', '.join(ALL_SYSTEMS)}")
        if (self.system in NVME_PEERS) != (self.nvme_path is not None):
            raise ValueError(f"--nvme-path is for (and needed by) {', '.join(NVME_PEERS)} (here {self.system!r}); "
                             "stronghold takes \"nvme_path\" in --stronghold")
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}: pick one of {', '.join(ARCHS)}")
        for name in ("layers", "hidden", "heads", "seq", "batch", "accumulation", "vocab", "timed_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}: pick heads that divide it")
        if self.arch != "gpt2":
            check_shape(self.hidden, self.heads, self.num_kv_heads, self.intermediate_size)
        elif self.intermediate is not None or self.kv_heads is not None:
            raise ValueError(f"intermediate/kv_heads ({self.intermediate}, {self.kv_heads}) are for Llama and Qwen2 "
                             f"only: drop --intermediate/--kv-heads for arch {self.arch!r}, or pass --arch llama")
        if self.gpu_cap_GB is not None and self.gpu_cap_GB <= 0:
            raise ValueError(f"gpu_cap_GB={self.gpu_cap_GB} must be > 0, or None for no cap")
        if self.stronghold and self.system != "stronghold":
            raise ValueError(f"stronghold knobs {self.stronghold} given for system {self.system!r}: drop them")
        if self.cpu_checkpointing and (self.system not in DEEPSPEED_SYSTEMS or not self.checkpointing):
            raise ValueError(f"cpu_checkpointing is DeepSpeed's activation checkpointing: it needs a DeepSpeed system "
                             f"(not {self.system!r}) and checkpointing on; stronghold has offload_activations")
        if self.cpu_checkpointing and self.arch == "gpt2":
            raise ValueError("cpu_checkpointing runs DeepSpeed's partitioned checkpoint, which fails on GPT-2's blocks "
                             "(None positional arguments; systems.CPU_CHECKPOINTING): use --arch llama")
        if self.repeat < 0:
            raise ValueError(f"repeat={self.repeat} must be >= 0")
        if not self.clipping >= 0:
            raise ValueError(f"clipping={self.clipping} must be >= 0 (0 turns gradient clipping off)")

    @property
    def intermediate_size(self) -> int:
        """The MLP width the model is built with: GPT-2's 4 x hidden, or Llama's (given or by rule)."""
        if self.arch == "gpt2":
            return 4 * self.hidden
        return default_intermediate(self.hidden) if self.intermediate is None else self.intermediate

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads the model is built with (GPT-2: every head has its own)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def key(self) -> str:
        """Identity of the measurement (without the commit, which the store adds).

        The fields added after the GPT-2 results were stored (arch, its Llama shape, accumulation)
        appear only where they differ from those results, so a GPT-2 point without accumulation
        keeps the key it was stored under. Llama's widths are the resolved ones: a point that
        names the rule's width and one that leaves it to the rule are the same measurement."""
        fields: dict[str, Any] = {
            "system": self.system, "hidden": self.hidden, "layers": self.layers, "heads": self.heads,
            "seq": self.seq, "batch": self.batch, "vocab": self.vocab, "gpu_cap_GB": self.gpu_cap_GB,
            "checkpointing": self.checkpointing, "stronghold": self.stronghold,
        }
        if self.arch != "gpt2":
            fields.update(arch=self.arch, intermediate=self.intermediate_size, kv_heads=self.num_kv_heads)
        if self.accumulation != 1:
            fields["accumulation"] = self.accumulation
        if self.cpu_checkpointing:
            fields["cpu_checkpointing"] = True
        if self.clipping != GRADIENT_CLIPPING:
            fields["clipping"] = self.clipping
        if self.repeat:
            fields["repeat"] = self.repeat
        if self.nvme_path is not None:
            fields["nvme_path"] = self.nvme_path
        return json.dumps(fields, sort_keys=True)

    def with_(self, **changes: Any) -> "Point":
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        cap = "uncapped" if self.gpu_cap_GB is None else f"cap{self.gpu_cap_GB:g}"
        # A label names files: a knob's path (nvme_path) keeps its characters but not its separators.
        knobs = "".join(f"-{k}{'+'.join(map(str, v)) if isinstance(v, list) else v}".replace("/", "_")
                        for k, v in sorted(self.stronghold.items()))
        arch = "" if self.arch == "gpt2" else f"-{self.arch}"
        accumulation = "" if self.accumulation == 1 else f"-ga{self.accumulation}"
        extra = ("-cpuckpt" if self.cpu_checkpointing else "") + (f"-r{self.repeat}" if self.repeat else "")
        extra += f"-clip{self.clipping:g}" if self.clipping != GRADIENT_CLIPPING else ""
        label = f"{self.system}{arch}-h{self.hidden}-l{self.layers}-s{self.seq}-b{self.batch}{accumulation}-{cap}{knobs}"
        return label + extra

    def to_argv(self) -> list[str]:
        """Command-line flags that `add_point_args` + `point_from_args` read back into this point."""
        argv = [
            "--system", self.system, "--layers", str(self.layers), "--hidden", str(self.hidden),
            "--heads", str(self.heads), "--seq", str(self.seq), "--batch", str(self.batch),
            "--accumulation", str(self.accumulation), "--arch", self.arch, "--vocab", str(self.vocab),
            "--gpu-cap-gb", "none" if self.gpu_cap_GB is None else repr(self.gpu_cap_GB),
            "--warmup-steps", str(self.warmup_steps), "--timed-steps", str(self.timed_steps),
            "--stronghold", json.dumps(self.stronghold, sort_keys=True),
        ]
        if self.intermediate is not None:
            argv += ["--intermediate", str(self.intermediate)]
        if self.kv_heads is not None:
            argv += ["--kv-heads", str(self.kv_heads)]
        if not self.checkpointing:
            argv.append("--no-checkpointing")
        if self.cpu_checkpointing:
            argv.append("--cpu-checkpointing")
        if self.repeat:
            argv += ["--repeat", str(self.repeat)]
        if self.clipping != GRADIENT_CLIPPING:
            argv += ["--gradient-clipping", repr(self.clipping)]
        if self.nvme_path is not None:
            argv += ["--nvme-path", self.nvme_path]
        return argv


def parse_cap(text: str) -> float | None:
    """`32` -> 32.0 GiB; `none` (or `0`) -> uncapped."""
    if text.strip().lower() in ("none", "uncapped", "0", ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"GPU cap {text!r} is not a number of GiB: pass e.g. 32, or 'none' for no cap") from None


def parse_knobs(text: str) -> dict[str, Any]:
    try:
        knobs = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--stronghold {text!r} is not JSON ({e}): pass e.g. '{{\"window_size\": 4}}'") from None
    if not isinstance(knobs, dict):
        raise ValueError(f"--stronghold {text!r} must be a JSON object, e.g. '{{\"window_size\": 4}}'")
    return knobs


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the one-point runner and every sweep (shape, knobs, steps; not the cap,
    which sweeps take as a list)."""
    parser.add_argument("--hidden", type=int, default=SEED_HIDDEN)
    parser.add_argument("--heads", type=int, default=SEED_HEADS)
    parser.add_argument("--seq", type=int, default=SEED_SEQ)
    parser.add_argument("--batch", type=int, default=SEED_BATCH, help="micro-batch size in sequences")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step (gradient_accumulation_steps), every system")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--arch", choices=ARCHS, default="gpt2", help="model family (default gpt2)")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="llama: MLP width (default: int(8/3 x hidden) rounded up to a multiple of 256)")
    parser.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: --heads)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--cpu-checkpointing", action="store_true",
                        help="DeepSpeed systems: deepspeed.checkpointing with cpu_checkpointing (ignored for stronghold "
                             "in sweeps)")
    parser.add_argument("--repeat", type=int, default=0, help="measure the same point again as record number N")
    parser.add_argument("--gradient-clipping", type=float, default=GRADIENT_CLIPPING,
                        help=f"ds.json gradient_clipping for every system (default {GRADIENT_CLIPPING:g}; 0 = off)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--stronghold", type=parse_knobs, default={},
                        help="JSON object merged into the ds.json 'stronghold' section")
    parser.add_argument("--window-size", type=int, default=None, help="shorthand for stronghold.window_size")
    parser.add_argument("--resident-blocks", type=int, default=None, help="shorthand for stronghold.resident_blocks")
    parser.add_argument("--nvme-path", default=None, help=f"{', '.join(NVME_PEERS)}: the directory on the drive")


def add_point_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", required=True, choices=ALL_SYSTEMS)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--gpu-cap-gb", type=parse_cap, default=SEED_CAP_GB,
                        help="GPU memory cap in GiB, or 'none' (default 32, the seed's card)")
    add_shape_args(parser)


def knobs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    knobs = dict(args.stronghold)
    if args.window_size is not None:
        knobs["window_size"] = args.window_size
    if args.resident_blocks is not None:
        knobs["resident_blocks"] = args.resident_blocks
    return knobs


def point_from_args(args: argparse.Namespace, **overrides: Any) -> Point:
    """A Point from `add_shape_args` flags; `overrides` (system, layers, ...) win over the flags."""
    values: dict[str, Any] = dict(
        hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch, accumulation=args.accumulation,
        vocab=args.vocab, arch=args.arch, intermediate=args.intermediate, kv_heads=args.kv_heads,
        checkpointing=args.checkpointing, warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps, cpu_checkpointing=getattr(args, "cpu_checkpointing", False),
        repeat=getattr(args, "repeat", 0), clipping=getattr(args, "gradient_clipping", GRADIENT_CLIPPING),
    )
    for name, flag in (("system", "system"), ("layers", "layers"), ("gpu_cap_GB", "gpu_cap_gb")):
        if hasattr(args, flag):
            values[name] = getattr(args, flag)
    values.update(overrides)
    if values["system"] in NVME_PEERS and "nvme_path" not in overrides:
        values["nvme_path"] = getattr(args, "nvme_path", None)
    if values["system"] == "stronghold" and "stronghold" not in overrides:
        values["stronghold"] = knobs_from_args(args)
    if values["system"] == "stronghold" and "cpu_checkpointing" not in overrides:
        values["cpu_checkpointing"] = False  # a sweep's DeepSpeed-only flag, as knobs are stronghold-only
    return Point(**values)
