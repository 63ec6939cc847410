"""`offload_activations: "auto"` on a GPU: is this a long-sequence run? Decided once, at the first training
forward, from the batch's shape, before any activation exists (the construction-time plan cannot know the
sequence; a first step that ran out of memory would be too late).

The blocks' checkpointed inputs alone take n_blocks x tokens x hidden x element bytes. When that exceeds
AUTO_OFFLOAD_SHARE of the GPU budget, the run is treated as long-context and gets what trained the longest
sequences on a GPU: the activations of every block but the last offloaded to
the host (activations.py), and, where those settings are "auto" too, chunked MLPs (mlp_chunks.py) and the
family's long-context kernels (stronghold_ops.default_kernels(long_context=True)). Shorter runs get nothing
installed: the hooks cost host time on every saved tensor.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from stronghold.memory.activations import blocks_to_offload
from stronghold.integrations.kernels import apply_kernels

logger = logging.getLogger(__name__)

AUTO_OFFLOAD_SHARE = 0.2
"""Block inputs above a fifth of the GPU budget. Llama h2560, 32 layers, 32 GiB cap: from ~42k tokens a
micro-batch. Without offload, 57344 tokens trained (inputs 27% of the cap) and 65536 did not (31%) on an H100;
offloading cost +0.6-1.0% step time where both fit, so turning it on early costs little, and late fails the run."""


def is_long_context(n_blocks: int, tokens: int, hidden: int, element_bytes: int, gpu_budget_bytes: int) -> bool:
    return n_blocks * tokens * hidden * element_bytes > AUTO_OFFLOAD_SHARE * gpu_budget_bytes


def batch_tokens(inputs: tuple, kwargs: dict) -> Optional[int]:
    """Tokens in a micro-batch: the (batch, seq) of `input_ids`, `inputs_embeds`, or the first tensor."""
    for tensor in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"),
                   *inputs, *[v for v in kwargs.values() if isinstance(v, torch.Tensor)]):
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
            return int(tensor.shape[0] * tensor.shape[1])
    return None


def hidden_size(model) -> Optional[int]:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


class LongContextAuto:
    """Makes the decision for one runtime at its first training forward (`before_forward`)."""

    def __init__(self, runtime, gpu_budget_bytes: int):
        self.runtime, self.gpu_budget_bytes = runtime, gpu_budget_bytes
        self.pending = True
        self.decision: dict[str, Any] = {}

    def before_forward(self, inputs: tuple, kwargs: dict, training: bool) -> None:
        if not (self.pending and training):
            return
        self.pending = False
        runtime = self.runtime
        tokens, hidden = batch_tokens(inputs, kwargs), hidden_size(runtime.model)
        n_blocks, element = len(runtime.blocks), torch.tensor([], dtype=runtime.compute_dtype).element_size()
        if tokens is None or hidden is None:
            self.decision = {"long_context": False, "why": "no (batch, seq) input or hidden size to judge by"}
            return
        inputs_bytes = n_blocks * tokens * hidden * element
        long = is_long_context(n_blocks, tokens, hidden, element, self.gpu_budget_bytes)
        self.decision = {"long_context": long, "tokens": tokens, "block_inputs_bytes": inputs_bytes,
                         "gpu_budget_bytes": self.gpu_budget_bytes}
        if long:
            self._enable(tokens, inputs_bytes)

    def _enable(self, tokens: int, inputs_bytes: int) -> None:
        runtime, settings = self.runtime, self.runtime.settings
        chosen = blocks_to_offload(True, len(runtime.blocks))
        runtime.offload_activations(chosen)
        done = [f"activations of blocks 0-{chosen - 1} offloaded"]
        # Kernels before chunks: a kernel replaces the MLP's forward, and the chunks must wrap whatever
        # forward the MLP ends up with (chunks installed at construction are taken off and put back).
        chunks = runtime.mlp_chunks
        if chunks is not None:
            chunks.detach()
        if settings.kernels is None and runtime.device.type == "cuda":
            patched = apply_kernels(runtime.model, settings, long_context=True)
            if patched:
                done.append(f"kernels {', '.join(patched)}")
        if chunks is None and settings.mlp_chunk_tokens is None:
            chunks = runtime.chunk_mlps(None)
            done.append("MLPs chunked")
        if chunks is not None:
            chunks.attach()
        self.decision["enabled"] = done
        if runtime.data_parallel is None or runtime.data_parallel.rank == 0:
            logger.info(f"long sequences ({tokens} tokens a micro-batch: the blocks' inputs take "
                        f"{inputs_bytes / 2 ** 30:.1f} GiB, over {AUTO_OFFLOAD_SHARE:.0%} of the GPU's "
                        f"{self.gpu_budget_bytes / 2 ** 30:.1f} GiB): {'; '.join(done)} (\"offload_activations\": "
                        f"false turns this off)")
