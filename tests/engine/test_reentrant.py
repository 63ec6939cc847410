"""The reentrant checkpoint of compiled blocks (integrations/reentrant.py), on HF checkpointing layers alone: it runs
only where it gives the gradients of the model's own checkpoint, and detach puts the model's function back."""
import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from stronghold.integrations.reentrant import ATTRIBUTE, ReentrantCheckpoints

pytestmark = pytest.mark.newest  # transformers' own checkpointing layer: run on the newest transformers too


class Block(GradientCheckpointingLayer):
    def __init__(self, output: str):
        super().__init__()
        self.linear, self.output = nn.Linear(4, 4), output

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        return {"tensor": y, "tuple": (y, None), "dict": {"hidden": y}}[self.output]


def _hidden(out):
    return out["hidden"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out


def _checkpointed(block: Block) -> Block:
    block = copy.deepcopy(block)
    block.train()
    block.gradient_checkpointing = True
    block.__dict__[ATTRIBUTE] = functools.partial(checkpoint, use_reentrant=False)  # as HF's default sets it
    return block


@pytest.mark.parametrize("output, reentrant", [("tensor", 2), ("tuple", 2), ("dict", 0)])
def test_only_outputs_a_reentrant_checkpoint_carries_go_reentrant(output, reentrant):
    """Three calls: the class's first runs the model's own checkpoint (its output decides), the later ones reentrant
    where the output is a tensor or a tuple of tensors and Nones; a dict's gradient would be lost, so it never is.
    The gradients equal those of the block without checkpointing in every case."""
    torch.manual_seed(0)
    plain = Block(output)
    block = _checkpointed(plain)
    own = block.__dict__[ATTRIBUTE]
    checkpoints = ReentrantCheckpoints([block])
    checkpoints.ensure()
    assert block.__dict__[ATTRIBUTE] is not own
    for seed in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        _hidden(block(x)).square().sum().backward()
        _hidden(plain(x)).square().sum().backward()
    assert checkpoints.reentrant_calls == reentrant
    for mine, reference in zip(block.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-6, atol=1e-7)
    checkpoints.detach()
    assert block.__dict__[ATTRIBUTE] is own


def test_calls_without_an_input_that_requires_grad_or_with_grad_off_keep_the_models_checkpoint():
    block = _checkpointed(Block("tensor"))
    checkpoints = ReentrantCheckpoints([block])
    checkpoints.ensure()
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()  # the class's first call: the model's own
    block(x.detach()).sum().backward()  # no input requires grad: a reentrant one would leave the weights' grads None
    with torch.no_grad():
        block(x)
    assert checkpoints.reentrant_calls == 0
    assert block.linear.weight.grad is not None


def test_other_checkpoint_functions_are_left_alone():
    """A reentrant one already, selective checkpointing (context_fn), or a wrapper of the user's."""
    kinds = [functools.partial(checkpoint, use_reentrant=True),
             functools.partial(checkpoint, use_reentrant=False, context_fn=lambda: None),
             lambda function, *args: checkpoint(function, *args, use_reentrant=False)]
    blocks = []
    for function in kinds:
        block = _checkpointed(Block("tensor"))
        block.__dict__[ATTRIBUTE] = function
        blocks.append(block)
    checkpoints = ReentrantCheckpoints(blocks)
    checkpoints.ensure()
    assert [block.__dict__[ATTRIBUTE] for block in blocks] == kinds
