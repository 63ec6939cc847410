"""Fused LM head + cross-entropy: the loss of `hidden @ weight.T` against labels, without ever holding
the [tokens, vocab] logits.

Tokens are processed in chunks. For each chunk the logits are one [chunk, vocab] matmul in the
weight's dtype (as HF's `lm_head` computes them); a Triton kernel turns them into per-token losses
(fp32 log-sum-exp) and overwrites them with their gradient; two more matmuls turn that into the
chunk's hidden-state gradient and add its share of the weight gradient. The gradients are computed in
the forward pass, because a scalar loss lets the backward pass be a scale by the upstream gradient:
three matmuls in all, as in eager, where recomputing the logits in backward would need four.

Cost of that choice: the weight gradient ([vocab, hidden], weight dtype) is held from forward to
backward, and is accumulated over chunks in the weight dtype (one bf16 rounding per chunk under bf16
training; chunks are large, so there are few). The backward pass scales the held gradients in place,
so it can run once: `retain_graph=True` and a second backward through this loss raise an error.

Semantics follow HF's `ForCausalLMLoss`: labels are shifted left by one (the last position of each
sequence has no target), `ignore_index` tokens are skipped, the reduction is the mean over the other
tokens, or the sum divided by `num_items_in_batch` when that is given (HF Trainer's gradient
accumulation). The loss is fp32. A head tied to the input embedding needs nothing special: the weight
gradient is returned for the Parameter passed, and autograd adds it to the embedding's.
"""
import torch
import torch.nn.functional as F

from . import _runtime as rt

# Budget for one chunk of logits. Larger chunks mean fewer passes over the weight gradient (each
# chunk reads and writes it once) and better matmul shapes; smaller ones, less transient memory.
CHUNK_LOGITS_BYTES = 512 << 20


def shifted_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's causal shift: position t is scored against labels[t + 1]; the last position is ignored."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def linear_cross_entropy_reference(
    hidden, weight, labels, *, shift=True, ignore_index=-100, num_items_in_batch=None
):
    """HF's `lm_head` followed by `ForCausalLMLoss`, materialising the logits."""
    logits = F.linear(hidden, weight).float()
    targets = shifted_targets(labels, ignore_index) if shift else labels
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
        ignore_index=ignore_index, reduction=reduction,
    )
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def default_chunk_tokens(vocab: int, element_size: int) -> int:
    tokens = CHUNK_LOGITS_BYTES // (vocab * element_size)
    return max(1, tokens - tokens % 64 if tokens >= 64 else tokens)


def _vocab_launch(vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_V, N_BLOCKS, num_warps). The interpreter gets small blocks so tests walk several."""
    cap = 128 if device.type == "cpu" else 4096
    block = min(cap, rt.next_power_of_2(vocab))
    return block, rt.cdiv(vocab, block), 8 if block >= 2048 else 4


class LinearCrossEntropyFunction(torch.autograd.Function):
    """hidden [tokens, width], weight [vocab, width], targets [tokens] (already shifted), scale: a 0-d
    fp32 tensor, 1 / (number of tokens the mean is over). Returns the fp32 loss."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, ignore_index, chunk_tokens):
        from .kernels import cross_entropy as kernels

        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, vocab = hidden.shape[0], weight.shape[0]
        block, n_blocks, warps = _vocab_launch(vocab, hidden.device)
        loss_rows = rt.new_empty((rows,), torch.float32, hidden.device)
        grad_hidden = rt.new_empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight and rows == 0 else None
        logits_buffer = rt.new_empty((min(chunk_tokens, rows), vocab), weight.dtype, hidden.device)
        # The matmuls must run in the dtype the gradients are accumulated in, whatever autocast says.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_tokens):
                end = min(start + chunk_tokens, rows)
                h = hidden[start:end]
                logits = torch.mm(h, weight.t(), out=logits_buffer[: end - start])
                kernels.cross_entropy_rows[(end - start,)](
                    logits, logits.stride(0), targets[start:end], loss_rows[start:end], scale,
                    vocab, ignore_index,
                    BLOCK_V=block, N_BLOCKS=n_blocks, WRITE_GRAD=need_hidden or need_weight, num_warps=warps,
                )
                if need_hidden:
                    torch.mm(logits, weight, out=grad_hidden[start:end])
                if need_weight:
                    if grad_weight is None:
                        grad_weight = torch.mm(logits.t(), h)
                    else:
                        grad_weight.addmm_(logits.t(), h)
        ctx.grads = (grad_hidden, grad_weight)
        return loss_rows.sum() * scale

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward ran twice through one loss; its gradients are "
                "computed in forward and consumed by the first backward. Recompute the loss instead of "
                "using retain_graph=True."
            )
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool = True,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels`, as HF's causal-LM loss computes it.

    hidden: [..., width]; labels: hidden.shape[:-1], integer. With `shift=True` (HF's `labels`) the
    labels are shifted inside; with `shift=False` they are already aligned (HF's `shift_labels`).
    """
    rt.check_inputs("fused_linear_cross_entropy", hidden, weight)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy: weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a "
            f"dtype; cast one of them first"
        )
    if labels.shape != hidden.shape[:-1] or labels.dtype.is_floating_point:
        raise ValueError(
            f"fused_linear_cross_entropy: labels must be integers of shape {tuple(hidden.shape[:-1])}, got "
            f"{labels.dtype} {tuple(labels.shape)}"
        )
    targets = (shifted_targets(labels, ignore_index) if shift else labels).reshape(-1)
    targets = targets.to(device=hidden.device, dtype=torch.int64).contiguous()
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum()
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device)
    scale = denominator.to(torch.float32).reciprocal()
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], weight.element_size())
    if chunk_tokens < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_tokens must be positive, got {chunk_tokens}")
    hidden2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    return LinearCrossEntropyFunction.apply(hidden2, weight, targets, scale, int(ignore_index), int(chunk_tokens))
