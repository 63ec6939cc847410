"""Where the blocks live, changed between optimizer steps: a mixin of runtime.StrongholdRuntime, whose fields it
moves (its stores, window, slots and counts stay the runtime's own, changed only by these methods).

- `promote`: streamed blocks become resident, states and all (promotion.py moves each block).
- `shrink_window`: the window gives up slots before a forward, between micro-steps too (planning/batch_room.py).
- `states_to_host`: blocks leave the NVMe tier for host memory (nvme.py).
- `offload_activations`: the first blocks' saved activations go to the host from the next forward (activations.py).
- `chunk_mlps`: the blocks' MLPs run in chunks of tokens (mlp_chunks.py).
- `accumulate_on_gpu`: the streamed blocks' gradients are summed on the GPU instead of the host (device_accum.py).
- `backward_block_by_block`: the boundary's backward runs block by block (blockwise.py) instead of every micro-step's.
The placement (planning/placement.py) and the long-context switch (memory/long_context.py) decide; these carry out.
"""
from __future__ import annotations

from typing import Optional

import torch

from stronghold.engine.blockwise import BlockwiseBackward
from stronghold.engine.step_state import StepState, require_idle
from stronghold.memory.activations import ActivationOffload
from stronghold.memory.mlp_chunks import MlpChunks
from stronghold.optim import param_state
from stronghold.planning import promotion
from stronghold.planning.plan_rest import BLOCKWISE_SUMMED
from stronghold.streaming.cached import INDEX_OF
from stronghold.streaming.device_accum import switch_to_gpu
from stronghold.streaming.promotion_fill import BlockFill, PromotionFill
from stronghold.streaming.staging import Stager


class Relayout:
    def offload_activations(self, blocks: int) -> None:
        """Offload the saved activations of the first `blocks` blocks from the next forward on (activations.py):
        at construction for a number in the config, or at the first forward under "auto" (long_context.py)."""
        pin = self.settings.pin_memory and self.device.type == "cuda"
        self.activations = ActivationOffload(dict(enumerate(self.blocks)), self.transfers, pin, blocks)
        self.activations.attach()

    def chunk_mlps(self, chunk_tokens) -> MlpChunks:
        """The blocks' MLPs in chunks (`chunk_tokens`: mlp_chunks.MlpChunks's), installed by the caller's `attach` once
        anything else that replaces an MLP's forward is in place (long_context.py: kernels first)."""
        self.mlp_chunks = MlpChunks(dict(enumerate(self.blocks)), chunk_tokens)
        return self.mlp_chunks

    def accumulate_on_gpu(self) -> None:
        """From the next step on, sum the streamed blocks' gradients on the GPU (device_accum.switch_to_gpu)."""
        self.device_accum = switch_to_gpu(self)

    def backward_block_by_block(self) -> None:
        """From the next step on, the blockwise backward (blockwise.py), between steps of a runtime built with host
        accumulation (placement.py's choice under "auto"). Each streamed block's pinned fp32 accumulator becomes its
        fp32 gradient buffer (where the walk's sum lands) and its compute-dtype gradient buffers go, as for
        `accumulate_on_gpu`, pooled landing buffers too (grad_pool.py: the walk sends each sum once); the cached input
        part's the same (it is summed like a block: plan_rest.BLOCKWISE_SUMMED). That is the host layout a runtime
        built for the blockwise backward has."""
        if self.mid_step:
            raise RuntimeError("stronghold: the blockwise backward can only start between optimizer steps")
        if self.blockwise is not None:
            return
        self.synchronize()  # no CPU job still reads a gradient buffer or accumulator; every pooled buffer is back
        units = [self.cached.units[INDEX_OF[name]].store for name in BLOCKWISE_SUMMED
                 if INDEX_OF[name] in self.cached.units]
        for store in [*self.stores.values(), *units]:
            assert store.accum is not None and not store.lean and not store.sharded
            store.grad, store.accum, store.grad_spare, store.pool = store.accum, None, None, None
        self.pooled_grads = False
        self.blockwise = BlockwiseBackward(self, self.blocks)
        self.blockwise.attach()

    def promote(self, resident_blocks: int, window_size: int, background: bool = False) -> dict[str, float]:
        """Make the leading streamed blocks up to `resident_blocks` resident and give the rest `window_size` slots,
        between steps (promotion.py). Returns the host seconds of its parts (what a first step's promotion costs,
        in the placement's report; the device work they launch is not waited for, except where a part waits).
        `background`: the copies run on a thread (streaming/promotion_fill.py) where every promoted block's states
        are plain host memory and no other rank takes part; each block's first forward waits for its own."""
        clock = promotion.PartClock()
        self.finish_promotion()
        indices = promotion.check_promotion(self, resident_blocks)
        promotion.settle(self, indices)
        clock.mark("settle_s")
        self.hooks.detach()
        self.window = None
        self.transfers.free_slots()  # before the promoted blocks need the memory
        background = background and self.data_parallel is None and all(
            promotion.fills_later(self.stores[index]) for index in indices)
        # Before the first optimizer step the CPU has no updates to run beside the copies (staging.py).
        named, stager = param_state.names(self.model), Stager(self.device, staged=self.steps == 0)
        fills = [BlockFill(index) for index in indices] if background else [None] * len(indices)
        left_behind = [self._take_out(index, named, stager, fill) for index, fill in zip(indices, fills)]
        del stager  # its pinned buffers back to torch's host cache (the releaser empties it)
        clock.mark("move_s")
        # Their host buffers go back on the releaser's thread (release.py), once copied; the device's cache here,
        # where the old window's slots were freed.
        then = promotion.release_host_cache if self.device.type == "cuda" else None
        if background and indices:
            self.promotion_fill = PromotionFill(self.device, {i: self.blocks[i] for i in indices}, fills,
                                                staged=self.steps == 0, release=self.releaser.release,
                                                left_behind=left_behind, then=then)
        else:
            self.releaser.release(left_behind, then=then)
        del left_behind, fills
        promotion.release_device_cache(self.device)
        clock.mark("release_s")
        self.resident_count = len(self.blocks) - len(self.stores)
        self.window_size = min(window_size, len(self.stores))
        if self.stores:
            self._build_window()
        elif self.cpu is not None and not self.cached.units:  # the cached units keep the CPU optimizer
            self.cpu.close()
            self.cpu = None
            self.device_accum = None
        clock.mark("window_s")
        return clock.parts

    def shrink_window(self, window_size: int) -> None:
        """Give the window `window_size` slots (at least 2), fewer than it has, before a forward: between optimizer
        steps or between the micro-steps of an accumulation window (a longer micro-batch's activations take the room:
        planning/batch_room.py). The blocks the window held point back at their host copies, which no update changes
        before the step's boundary, and load again on demand; the freed slots' memory stays in torch's cache, where
        the activations take it."""
        if self.state is StepState.UPDATING:
            raise RuntimeError("stronghold: the window can only shrink before a forward, not during a step's update")
        window_size = max(2, window_size)
        if self.window is None or window_size >= self.window_size:
            return
        stats = self.window.stats
        self.window.evict_all()
        if self.transfers.is_cuda:
            # Prefetches still in flight write into the slots: the compute stream, which reuses their memory, waits.
            torch.cuda.current_stream(self.device).wait_stream(self.transfers.h2d_stream)
        self.hooks.detach()
        self.window = None
        self.transfers.free_slots()
        self.window_size = window_size
        self._build_window()
        self.window.stats = stats  # the telemetry's counters since its last reset go on

    def _take_out(self, index: int, named: dict[int, str], stager: Stager, fill: Optional[BlockFill]) -> tuple:
        """Block `index` out of the streamed blocks and onto the device (promotion.py; its copies left to `fill` if
        given); returns what it left behind on the host, for the releaser."""
        micro, landed = self.micro.pop(index), self.landed.pop(index)
        if self.device_accum is not None:
            self.device_accum.pop(index)
        store = self.stores.pop(index)
        promotion.move_to_device(self, store, named, stager, fill)
        return store, micro, landed

    def finish_promotion(self) -> None:
        """A promotion's copies still running on their thread (`promote(background=True)`) done and usable: before
        anything reads the promoted blocks' values other than their own forwards."""
        if self.promotion_fill is not None:
            fill, self.promotion_fill = self.promotion_fill, None
            fill.finish()
            self.promotion_fills.append(fill.report())

    def states_to_host(self, first_on_drive: int) -> None:
        """Keep only the blocks from `first_on_drive` on in the NVMe tier: the streamed blocks below it get their
        fp32 states back in host memory (nvme.py), where a later plan found room for them. Between steps."""
        require_idle(self.state, "moving block states off the NVMe drive")
        if self.nvme is None or first_on_drive <= self.nvme_from:
            return
        self.synchronize()  # no CPU job may touch a moving block's state
        for index in range(self.nvme_from, first_on_drive):
            store = self.stores.get(index)
            if store is not None and store.tier is not None:
                self.nvme.to_host(store, self.host_bytes)
        self.nvme_from = min(first_on_drive, len(self.blocks))
        if not self.nvme.files:
            self.nvme.close()
            self.nvme = None
