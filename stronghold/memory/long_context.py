"""What the first training forward's batch shape decides on a GPU, once, before any activation exists (the
construction-time plan cannot know the sequence; a first step that ran out of memory would be too late): under
`offload_activations: "auto"`, is this a long-sequence run; under `kernels: "auto"`, are the logits large enough
for the fused linear + cross-entropy head.

The blocks' checkpointed inputs alone take n_blocks x tokens x hidden x element bytes. When that exceeds
AUTO_OFFLOAD_SHARE of the GPU budget, the run is treated as long-context and gets what trained the longest
sequences on a GPU: the activations of every block but the last offloaded to
the host (activations.py), and, where those settings are "auto" too, chunked MLPs (mlp_chunks.py) and the
family's long-context kernels (stronghold_ops.default_kernels(long_context=True)). Shorter runs get nothing
installed: the hooks cost host time on every saved tensor.

A micro-batch's logits (tokens x vocabulary, in the compute dtype and the fp32 copy the loss upcasts them to) above
FUSED_HEAD_SHARE of the GPU budget get the family's fused head, which computes the loss vocabulary chunk by chunk:
the memory the logits would have taken goes to the placement (measured at the first forward, after this), which
keeps more blocks resident. A later micro-batch longer than the first (a collator that pads each batch to its own
longest sequence) is judged again for the head alone, before its forward: its logits grow with its tokens, and
unfused they are the step's largest transient (a 2.7 B Llama under 32 GiB whose first micro-batches had 2048 tokens
ran out of GPU memory in the loss's fp32 copy once they had 8192). The long-sequence decision stays the first
forward's: its offload and chunks change what the placement measured and planned.
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


FUSED_HEAD_SHARE = 0.05
"""Logits above a twentieth of the GPU budget. Llama h2560, 32 layers, GA 8, 32 GiB cap on an H100: with a 128256
vocabulary (logits 9% of the cap) the fused head let the placement keep 11 blocks resident instead of 6-8 and the
step ran 1.12x faster; with 32000 and 50304 (2-4%) it made no difference beyond the noise."""


def has_large_logits(tokens: int, vocab: int, element_bytes: int, gpu_budget_bytes: int) -> bool:
    return tokens * vocab * (element_bytes + 4) > FUSED_HEAD_SHARE * gpu_budget_bytes


def vocab_size(model) -> Optional[int]:
    value = getattr(getattr(model, "config", None), "vocab_size", None)
    return value if isinstance(value, int) else None


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
    """Makes the decisions for one runtime at its first training forward (`before_forward`): long context where
    "offload_activations" is "auto", the fused head where "kernels" is "auto"."""

    def __init__(self, runtime, gpu_budget_bytes: int):
        self.runtime, self.gpu_budget_bytes = runtime, gpu_budget_bytes
        self.pending = True
        self.decision: dict[str, Any] = {}
        self.judged_tokens: Optional[int] = None
        """The most tokens of a training micro-batch the head has been judged for."""

    def kernels_here(self) -> bool:
        """Whether the Triton kernels may be installed: on a GPU (on the CPU they run only under Triton's
        interpreter, which the tests use)."""
        return self.runtime.device.type == "cuda"

    def before_forward(self, inputs: tuple, kwargs: dict, training: bool) -> None:
        if not training:
            return
        if not self.pending:
            self._judge_longer(batch_tokens(inputs, kwargs))
            return
        self.pending = False
        runtime, settings = self.runtime, self.runtime.settings
        tokens, hidden = batch_tokens(inputs, kwargs), hidden_size(runtime.model)
        self.judged_tokens = tokens
        n_blocks, element = len(runtime.blocks), torch.tensor([], dtype=runtime.compute_dtype).element_size()
        if tokens is None or hidden is None:
            self.decision = {"long_context": False, "why": "no (batch, seq) input or hidden size to judge by"}
            return
        inputs_bytes = n_blocks * tokens * hidden * element
        long = settings.offload_activations is None and is_long_context(n_blocks, tokens, hidden, element,
                                                                         self.gpu_budget_bytes)
        self.decision = {"long_context": long, "tokens": tokens, "block_inputs_bytes": inputs_bytes,
                         "gpu_budget_bytes": self.gpu_budget_bytes}
        if long:
            self._enable(tokens, inputs_bytes)
        else:
            self._fused_head(tokens)

    def _judge_longer(self, tokens: Optional[int]) -> None:
        """A training micro-batch after the first: where it is the longest yet, its logits are judged again."""
        if tokens is None or self.judged_tokens is None or tokens <= self.judged_tokens:
            return
        self.judged_tokens = tokens
        if not self.decision.get("long_context") and "fused_head" not in self.decision and self._fused_head(tokens):
            self.decision["fused_head_tokens"] = tokens

    def _fused_head(self, tokens: int) -> bool:
        """The fused head where "kernels" is left to stronghold and `tokens` tokens' logits are large: whether it
        was installed."""
        runtime, settings = self.runtime, self.runtime.settings
        if settings.kernels is not None or not self.kernels_here():
            return False
        vocab, element = vocab_size(runtime.model), torch.tensor([], dtype=runtime.compute_dtype).element_size()
        if vocab is None or not has_large_logits(tokens, vocab, element, self.gpu_budget_bytes):
            return False
        self.decision["fused_head"] = apply_kernels(runtime.model, settings, large_logits=True)
        if runtime.data_parallel is None or runtime.data_parallel.rank == 0:
            logger.info(f"large logits ({tokens} tokens x {vocab} vocabulary, over {FUSED_HEAD_SHARE:.0%} "
                        f"of the GPU's {self.gpu_budget_bytes / 2 ** 30:.1f} GiB): the fused linear + "
                        f"cross-entropy head (\"kernels\": false turns this off)")
        return True

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
        if settings.kernels is None and self.kernels_here():
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
