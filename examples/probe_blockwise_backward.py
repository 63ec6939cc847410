"""Probe: can a backward run each block for every micro-batch in turn, through hooks alone, and stay exact?

Each micro-step's forward runs the blocks under no_grad, its forward pre-hooks keep every block's input and keyword
arguments, and the top block's output is cut from the graph (detached, requiring grad), so the caller's own
`loss.backward()` runs the head and stops there, leaving the output's gradient. At the accumulation boundary each block
is run again from its kept inputs, top block first, for every micro-batch in turn, and back-propagated with that
micro-batch's gradient; the embedding last. Compared with plain accumulation (forward + backward per micro-step), in
fp32 on the CPU, a tiny HF Llama; `--drop-one` leaves one micro-batch out of one block's pass (the comparison must
see it). Prints one JSON line.

    python3 examples/probe_blockwise_backward.py [--accumulation 4] [--drop-one]
"""
from __future__ import annotations

import argparse
import copy
import json
import platform

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class BlockwiseBackward:
    """Hooks on a Llama model's embedding and decoder layers for the block-by-block backward above."""

    def __init__(self, model: LlamaForCausalLM):
        self.model, self.blocks = model, model.model.layers
        self.kept: list[dict] = []  # per micro-batch: each block's (input, args, kwargs), the cut's gradient, embedding

    def micro_step(self, input_ids: torch.Tensor, scale: float) -> float:
        calls, cut, embedded = {}, {}, {}

        def keep(index):
            def hook(module, args, kwargs):
                calls[index] = (args[0].detach(), args[1:], kwargs)
            return hook

        def detach_embedding(module, args, out):
            embedded["out"] = out
            return out.detach()

        def cut_top(module, args, kwargs, out):
            cut["out"] = out.detach().requires_grad_()
            return cut["out"]

        handles = [block.register_forward_pre_hook(keep(i), with_kwargs=True) for i, block in enumerate(self.blocks)]
        handles.append(self.model.model.embed_tokens.register_forward_hook(detach_embedding))
        handles.append(self.blocks[-1].register_forward_hook(cut_top, with_kwargs=True))
        forwards = [block.forward for block in self.blocks]
        for block, forward in zip(self.blocks, forwards):
            block.forward = torch.no_grad()(forward)  # on the instance; put back below
        try:
            loss = self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss * scale
        finally:
            for block in self.blocks:
                del block.forward
            for handle in handles:
                handle.remove()
        loss.backward()  # the head and the final norm, down to the cut
        self.kept.append({"calls": calls, "grad": cut["out"].grad, "embedded": embedded["out"]})
        return loss.item()

    def boundary(self, drop: tuple[int, int] | None = None) -> None:
        for index in reversed(range(len(self.blocks))):
            for m, kept in enumerate(self.kept):
                if (index, m) == drop:
                    continue
                hidden, args, kwargs = kept["calls"][index]
                x = hidden.requires_grad_()
                self.blocks[index](x, *args, **kwargs).backward(kept["grad"])
                kept["grad"] = x.grad
        for kept in self.kept:
            kept["embedded"].backward(kept["grad"])
        self.kept.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--drop-one", action="store_true")
    opts = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, attn_implementation="eager")
    plain = LlamaForCausalLM(config)
    blockwise = copy.deepcopy(plain)
    data = [torch.randint(0, config.vocab_size, (2, 32)) for _ in range(opts.accumulation)]
    scale = 1.0 / opts.accumulation
    plain_losses = []
    for ids in data:
        loss = plain(input_ids=ids, labels=ids, use_cache=False).loss * scale
        loss.backward()
        plain_losses.append(loss.item())
    probe = BlockwiseBackward(blockwise)
    losses = [probe.micro_step(ids, scale) for ids in data]
    probe.boundary(drop=(1, opts.accumulation - 1) if opts.drop_one else None)
    worst, bit_identical = 0.0, True
    for (name, a), (_, b) in zip(plain.named_parameters(), blockwise.named_parameters()):
        worst = max(worst, ((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-30)).item())
        bit_identical &= torch.equal(a.grad, b.grad)
    print(json.dumps({"probe": "blockwise_backward", "accumulation": opts.accumulation, "drop_one": opts.drop_one,
                      "parameters": len(list(plain.parameters())), "losses_equal": losses == plain_losses,
                      "worst_relative_gradient_difference": worst, "bit_identical": bit_identical,
                      "torch": torch.__version__, "machine": platform.machine(), "dtype": "fp32"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
