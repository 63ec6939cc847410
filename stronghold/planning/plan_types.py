"""The planner's inputs (planner.py decides; placement.py fills them from a live model and machine): the model's
blocks, the activations, the budgets and rates, and the constants of its accounting; its output, the Plan, is
plan_result.py's. Units: `*_numel` count elements, `*_bytes` count bytes, `*_s` are
seconds; "per step" means per optimizer step, i.e. `accumulation_steps` forward/backward passes.
Plain frozen dataclasses: no torch, no device or psutil calls.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional


GIB = 2 ** 30

FP32_BYTES = 4
"""fp32 master weight, fp32 gradient accumulator, fp32 transient gradient: 4 bytes per element."""
MOMENTS_BYTES = 2 * FP32_BYTES
"""AdamW exp_avg + exp_avg_sq, fp32, kept where the parameter is updated (GPU resident, host streamed)."""
COMPUTE_BYTES = (2, 4)
"""bf16/fp16 or fp32 compute. In fp32 mode the working copy is the master (store.py, gpu_optim.py), so
all modes need 16 bytes per trainable parameter: bf16/fp16 2 weight + 2 grad + 4 master + 8 moments,
fp32 4 weight/master + 4 grad + 8 moments."""
COMPACT_MASTER_BYTES = 2
"""A compact master's low half per trainable parameter (streaming/compact.py); its high half is the bf16 working
copy."""
COMPACT_STAGING_SLOTS = 1
"""fp32 staging buffers of the largest compact block's master, where its holders merge it (compact.py): one, since
holds never overlap but for a main-thread hold while the CPU worker is idle (checkpoints, promotion), which waits
for it."""
GRAD_POOL_BUFFERS = 4
"""Landing buffers of the largest streamed block that pooled blocks share (streaming/grad_pool.py): backward runs up
to that many blocks ahead of the CPU's sums."""
STREAMED_GRADS_IN_FLIGHT = 2
"""Streamed blocks whose gradients are on the GPU at once: the block whose backward is producing
them, and the one before it whose D2H has not finished (streams.Transfers.offload holds no more: the
compute stream waits for the older copies before it goes on)."""
MIN_WINDOW, MAX_WINDOW = 2, 8
"""Two slots let one block compute while the next loads; beyond eight, slots only bank lead that a
copy-bound walk cannot use, while each costs 1/8 (bf16) of a resident block's GPU memory."""
ADAM_HOST_BYTES, ACCUMULATE_HOST_BYTES = 28, 10
ACCUMULATE_COST_VS_ADAM = ACCUMULATE_HOST_BYTES / ADAM_HOST_BYTES
"""CPU time of one accumulation pass relative to one AdamW pass. Both are memory-bound: AdamW moves
~28 bytes per parameter (read p, m, v and an fp32 gradient, write p, m, v and the bf16 copy), accumulating a bf16
gradient into fp32 ~10 (read 2, read 4, write 4)."""
DEFAULT_GPU_MARGIN_FRACTION = 0.05
DEFAULT_GPU_MARGIN_MIN_BYTES = 512 * 2 ** 20
"""GPU margin unless given: 5% of the budget, at least 512 MiB, for what the plan does not count:
allocator fragmentation (a capped caching allocator cannot always reuse freed blocks), cuBLAS and
Triton workspaces, NCCL/DeepSpeed bookkeeping."""
ACTIVATION_PREFETCH_BLOCKS = 2
"""Offloaded blocks whose activations are back on the GPU at once in backward (activations.py): the
block being back-propagated and the next one, in flight."""
ROW_PIECE_BYTES = 256 * 2 ** 20
"""The dense gradient an input table's update makes at a time from its landed rows (engine/embedding_rows.py), at most
the table: each piece is a kernel call whose threads start and join, and on a 2-core host the update of a 32768 x 4096
table ran 1.26x, 1.21x and 1.06x the whole-table buffer's time in pieces of 16, 64 and 256 MiB; an eighth of the
whole-table buffer it replaces for a 128256 x 4096 table (2 GiB)."""
DEFAULT_HOST_MARGIN_FRACTION = 0.05
DEFAULT_HOST_MARGIN_MIN_BYTES = 4 * 2 ** 30
"""Host margin unless given: 5% of the budget, at least 4 GiB (`default_host_margin`, also what
plan_bytes.check_host_fits keeps). The budget is memory available at start-up plus the model's own host
storage, so the process as it runs then is already outside it; the margin is for what grows after: the
CUDA context and the driver's pinned-memory bookkeeping, the Python heap, a data loader. It was 10%,
which on a 126 GiB host held back 12 GiB: as much as 0.9 B streamed parameters."""


def default_host_margin(host_bytes: int) -> int:
    return max(DEFAULT_HOST_MARGIN_MIN_BYTES, int(DEFAULT_HOST_MARGIN_FRACTION * host_bytes))


class Tier(enum.Enum):
    RESIDENT = "resident"  # weights, gradients and AdamW states on the GPU, updated there
    STREAMED = "streamed"  # states on the host, weights loaded into a window slot when needed
    LEAN = "lean"  # streamed, its gradients land in its working copy (no gradient buffer); updated at step()
    CACHED = "cached"  # outside the blocks: weights and gradients on the GPU, fp32 master and moments on the host
    NVME = "nvme"  # streamed, its fp32 master and moments in a file on the NVMe drive (streaming/nvme.py)


REST_TIERS = (Tier.RESIDENT, Tier.CACHED)
"""The tiers a part of the model outside the blocks can take (streaming/cached.py has the cached one)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    numel: int
    """Elements of all the block's parameters (trainable and frozen)."""
    trainable_numel: int
    """Elements of the parameters the optimizer updates (<= numel)."""

    def __post_init__(self):
        _require(0 <= self.trainable_numel <= self.numel,
                 f"a block needs 0 <= trainable_numel <= numel (got {self.trainable_numel}, {self.numel})")


@dataclass(frozen=True, kw_only=True)
class PartSpec:
    """A part of the model outside the blocks, placed as one unit (discovery.split_rest): the input embeddings and
    what runs before the blocks ("input"), or the final norm, the LM head and what runs after them ("output")."""

    name: str
    numel: int
    trainable_numel: int
    before_blocks: bool = True
    """Its gradients are the last of a backward (the input embeddings'): in the cached tier its D2H and CPU update
    follow every block's, a tail of the step. A part after the blocks gets its gradients first, and its update
    overlaps the blocks' backward."""
    row_gradients: bool = False
    """Its one trainable parameter is a plain embedding table (discovery.row_table): the blockwise walk sums the
    gradient of the window's tokens' rows alone (engine/embedding_rows.py), not the whole table."""

    def __post_init__(self):
        _require(0 <= self.trainable_numel <= self.numel,
                 f"part {self.name}: need 0 <= trainable_numel <= numel (got {self.trainable_numel}, {self.numel})")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    blocks: tuple[BlockSpec, ...]
    """The transformer blocks in forward order; the first R become resident."""
    rest_numel: int
    """Elements of everything outside the blocks (embeddings, final norm, head; tied weights once)."""
    rest_trainable_numel: int
    compute_bytes: int
    """Bytes per element of the compute dtype: 2 (bf16, fp16) or 4 (fp32, where the working copy is the master)."""
    bf16: bool = False
    """The 2-byte compute dtype is bf16 (not fp16): the high half of an fp32 master (a compact master)."""
    accumulation_steps: int = 1
    """Forward/backward passes per optimizer step; > 1 adds an fp32 accumulator per trainable
    parameter: on the host for streamed blocks, on the GPU for resident ones (gpu_optim.py)."""
    rest_parts: tuple[PartSpec, ...] = ()
    """The rest split into the parts placed one by one (each resident or cached); they add up to `rest_numel` and
    `rest_trainable_numel`. Empty: one part, "rest", before the blocks."""

    def __post_init__(self):
        _require(len(self.blocks) > 0, "the model needs at least one transformer block to plan placement")
        _require(0 <= self.rest_trainable_numel <= self.rest_numel,
                 f"need 0 <= rest_trainable_numel <= rest_numel (got {self.rest_trainable_numel}, {self.rest_numel})")
        if not self.rest_parts:
            object.__setattr__(self, "rest_parts", (PartSpec(name="rest", numel=self.rest_numel,
                                                             trainable_numel=self.rest_trainable_numel),))
        _require(sum(p.numel for p in self.rest_parts) == self.rest_numel
                 and sum(p.trainable_numel for p in self.rest_parts) == self.rest_trainable_numel,
                 "rest_parts must add up to rest_numel and rest_trainable_numel")
        _require(len({p.name for p in self.rest_parts}) == len(self.rest_parts), "rest_parts need distinct names")
        _require(self.compute_bytes in COMPUTE_BYTES,
                 f"compute_bytes must be 2 (bf16/fp16) or 4 (fp32), got {self.compute_bytes}")
        _require(self.accumulation_steps >= 1, f"accumulation_steps must be >= 1, got {self.accumulation_steps}")


@dataclass(frozen=True, kw_only=True)
class Activations:
    fixed_peak_bytes: int
    """GPU bytes of activations that do not grow with depth: the logits/loss peak plus one block's
    forward (or recompute) and backward working set."""
    per_block_bytes: int
    """GPU bytes kept per block across the step (with checkpointing: the block's input), for every
    block whatever its tier, unless the block's activations are offloaded to the host (activations.py;
    then they cross PCIe once each way per pass)."""
    allocator_gap_bytes: int = 0
    """Of `fixed_peak_bytes`, what a measured step reserved beyond its allocated peak (placement.py): blocks
    fragmented, or freed but held until a side stream's copy out of them ends."""

    def __post_init__(self):
        _require(self.fixed_peak_bytes >= 0 and self.per_block_bytes >= 0, "activation bytes must be >= 0")
        _require(0 <= self.allocator_gap_bytes <= self.fixed_peak_bytes,
                 "allocator_gap_bytes must lie between 0 and fixed_peak_bytes")


KEPT_PENDING = 4
"""The blockwise backward's kept inputs whose D2H has not landed, at most (engine/kept_inputs.py): the oldest is waited
for beyond that, so the forward's device memory stays its own plus a few inputs."""


NVME_ALIGN = 4096
"""A block's state file is padded to this: O_DIRECT's alignment (streaming/nvme_io.ALIGN)."""


DRIVE_SLOTS = 4
"""NVMe staging buffers ("nvme_buffers" "auto" takes as many where they fit): one held by the CPU update, one being
written back behind it, two being read ahead."""
MIN_DRIVE_SLOTS = 2
"""The fewest "auto" takes: one for the CPU update, one written back or read ahead meanwhile."""


@dataclass(frozen=True, kw_only=True)
class Drive:
    """The NVMe tier's drive (config "nvme_path"): its free space and rates as measured at start-up."""

    free_bytes: int
    read_bytes_per_s: float
    write_bytes_per_s: float
    slots: int = DRIVE_SLOTS
    """Host staging buffers, each the largest NVMe block's file (config "nvme_buffers"; at most one per block)."""
    fewer_slots: bool = False
    """The plan may take fewer buffers, down to MIN_DRIVE_SLOTS, where that keeps a block's states off the drive
    ("nvme_buffers" "auto"); the plan's own Drive has the number it took and this False."""
    max_io_s: float = 600.0
    """The most seconds one step's NVMe reads and writes may take: the stall timeout ("stall_timeout_s"). The
    CPU runs a step's deferred updates in order, so the next forward's wait for the last one queues behind every
    block's I/O: a drive slower than this could not train without tripping it."""

    def __post_init__(self):
        _require(self.free_bytes >= 0 and self.slots >= 1, "drive: free_bytes >= 0 and slots >= 1")

    def slot_choices(self) -> tuple[int, ...]:
        """The staging buffer counts a plan may take, most first."""
        return tuple(range(self.slots, min(MIN_DRIVE_SLOTS, self.slots) - 1, -1)) if self.fewer_slots else (self.slots,)
        _require(self.read_bytes_per_s > 0 and self.write_bytes_per_s > 0, "drive: rates must be positive")


@dataclass(frozen=True, kw_only=True)
class Budgets:
    gpu_bytes: int
    """GPU bytes this process may use: the cap (gpu_memory_limit_gb), or free memory at start."""
    gpu_held_bytes: int = 0
    """Of the cap or free memory, what the process already held on the GPU outside the model's parameters when planned
    (its own tensors, an engine built before and not destroyed): taken off `gpu_bytes`, and named in a refusal."""
    host_bytes: int
    """Host bytes the streamed blocks' buffers may use (available RAM of the node: with data parallel the
    node's ranks share it, see `local_ranks`)."""
    local_ranks: int = 1
    """Data-parallel ranks on this node: each holds 1/local_ranks of the fp32 states and gradient buffers,
    and the node holds one shared working copy (data_parallel.py), so the node's total does not grow."""
    gpu_margin_bytes: Optional[int] = None
    """Kept free on the GPU; None: max(512 MiB, 5% of gpu_bytes) (see DEFAULT_GPU_MARGIN_FRACTION)."""
    host_margin_bytes: Optional[int] = None
    """Kept free on the host; None: `default_host_margin(host_bytes)`."""
    host_process_bytes: int = 0
    """Host RAM this process holds outside the planned buffers (its RSS at planning, less the model's CPU
    parameters that move into them): not part of the budget check (available RAM already excludes it), only
    of the predicted peak RSS, `Plan.host_rss_bytes`."""
    host_limit_gb: Optional[float] = None
    """The "host_memory_limit_gb" that `host_bytes` reflects (named in a refusal)."""
    drive: Optional[Drive] = None
    """The NVMe tier's drive; None: no tier."""
    window_rows_numel: Optional[int] = None
    """The blockwise backward's input table gradient, as the window's rows (engine/embedding_rows.py): at most the
    window's tokens x the hidden size elements, which its store holds in place of the whole table; None: not known
    (no training forward yet), the whole table counted."""

    def __post_init__(self):
        _require(self.gpu_bytes > 0 and self.host_bytes >= 0, "budgets must be positive byte counts")
        _require(self.local_ranks >= 1, f"local_ranks must be >= 1 (got {self.local_ranks})")
        _require(self.host_process_bytes >= 0, f"host_process_bytes must be >= 0 (got {self.host_process_bytes})")
        _require(self.gpu_held_bytes >= 0, f"gpu_held_bytes must be >= 0 (got {self.gpu_held_bytes})")
        if self.gpu_margin_bytes is None:
            margin = max(DEFAULT_GPU_MARGIN_MIN_BYTES, int(DEFAULT_GPU_MARGIN_FRACTION * self.gpu_bytes))
            object.__setattr__(self, "gpu_margin_bytes", margin)
        if self.host_margin_bytes is None:
            object.__setattr__(self, "host_margin_bytes", default_host_margin(self.host_bytes))
        _require(self.gpu_margin_bytes >= 0 and self.host_margin_bytes >= 0, "margins must be >= 0 bytes")


@dataclass(frozen=True, kw_only=True)
class Rates:
    h2d_bytes_per_s: float
    """Pinned host-to-device copy bandwidth."""
    d2h_bytes_per_s: float
    cpu_adam_params_per_s: float
    """The engine's CPU AdamW (bf16 gradient in, bf16 copy out), all its threads."""
    gpu_s_per_block: float
    """Forward + backward (+ recompute with checkpointing) of one block at the run's shape, one pass."""
    gpu_s_fixed: float
    """Embeddings, head and loss, forward + backward, one pass."""
    host_memory_bytes_per_s: Optional[float] = None
    """Host DRAM bandwidth (read + write bytes per second). The copies to and from the GPU and the
    CPU optimizer all move bytes through the same DRAM, so together they cannot go faster than this;
    None leaves the term out. The engine passes the CPU AdamW kernel's own rate times ADAM_HOST_BYTES
    (placement.py): a torch CPU copy measured 27 GB/s on an H100 host and predicted a Llama step 3x too
    long."""

    gpu_adam_params_per_s: Optional[float] = None
    """The resident parameters' AdamW on the GPU (gpu_optim.py: upcast, clip, fused step, copy back), once a step
    and in series with the compute: the GPU term and the walk leave it out without it (None: left out). Measured
    in the steps the placement times: on an H200 it ran 61 G parameters/s, 15 and 28 ms of GPT-2 0.91 B and 1.72 B
    steps of 87-90 and 173-198 ms; without it the predictions of those all-resident steps came out 25% and 17%
    short."""
    deferred_share: float = 0.0
    """Share of the streamed blocks' updates that wait for step() because clipping holds them back until the
    global norm is known (cpu_optim.py), as the first step measured: their CPU time overlaps the next forward,
    not backward. With clipping active every step (a norm above the limit) it is all of them: for a Llama 2.70 B
    with accumulation 8 under a 32 GiB cap the next forward then waited 0.17-0.21 s a step for them (H200)."""

    def __post_init__(self):
        _require(0.0 <= self.deferred_share <= 1.0, f"rates: deferred_share must be in [0, 1], got {self.deferred_share}")
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "cpu_adam_params_per_s", "gpu_s_per_block"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, f"rates: {name} must be a positive number, got {value}")
        _require(math.isfinite(self.gpu_s_fixed) and self.gpu_s_fixed >= 0, "rates: gpu_s_fixed must be >= 0")
        _require(self.gpu_adam_params_per_s is None or self.gpu_adam_params_per_s > 0,
                 "rates: gpu_adam_params_per_s must be positive (or None)")
        _require(self.host_memory_bytes_per_s is None or self.host_memory_bytes_per_s > 0,
                 "rates: host_memory_bytes_per_s must be positive (or None)")
