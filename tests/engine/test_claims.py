"""step() claims the updates the CPU worker has not begun (cpu_optim.py, `UpdateRecord.claim`): their sums of
squares are read on the calling thread and their exact updates queued in forward order. The arithmetic is the one
the worker's job would have done (an early update with the unclipped gradient is the final update with clip
coefficient 1.0; a deferred one is the same final update), so a run with claims is bit-identical to the same run
without (masters and module weights, torch.equal); that run itself matches plain PyTorch (test_exactness.py,
test_speculation.py). A slow kernel (a sleep before each update) leaves a backlog at step(), so claims happen; at
full speed they may or may not, which changes nothing either way."""
import copy
import time
from types import SimpleNamespace

import pytest
import torch

import stronghold

from .helpers import VOCAB, batches, ds_config, relative_error, tiny_gpt2, tiny_llama, train_reference
from .test_weights_first import _assert_identical, _train

LR = 3e-3
DELAY_S = 0.05


class _SlowKernel:
    """The engine's kernel, with a sleep before every update (and, with `accumulate`, every sum): the worker falls
    behind backward."""

    def __init__(self, kernel, accumulate: bool = False):
        self._kernel, self._slow_sums = kernel, accumulate

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def step(self, *args, **kwargs):
        time.sleep(DELAY_S)
        return self._kernel.step(*args, **kwargs)

    def accumulate(self, *args, **kwargs):
        time.sleep(DELAY_S if self._slow_sums else 0.0)
        return self._kernel.accumulate(*args, **kwargs)

    def accumulate2(self, *args, **kwargs):
        time.sleep(DELAY_S if self._slow_sums else 0.0)
        return self._kernel.accumulate2(*args, **kwargs)


def _engine(model, slow: bool, **cfg):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        lr=LR, window=2, resident=1, bf16=True, **cfg))
    if slow:
        cpu = engine.stronghold_runtime.cpu
        cpu.kernel = _SlowKernel(cpu.kernel)
    return engine


# clip 0: no clipping (early updates, step() need not wait); 1e3: clipping configured, never active (early updates
# validated at step()).
@pytest.mark.parametrize("make,clip", [(tiny_llama, 0.0), (tiny_llama, 1e3), (tiny_gpt2, 1e3)])
def test_claimed_updates_are_bit_identical(make, clip):
    model, data = make(6), batches(4)
    slow, fast = _engine(model, True, clip=clip), _engine(model, False, clip=clip)
    _train(slow, data)
    _train(fast, data)
    _assert_identical(slow, fast)
    stats = slow.stronghold_runtime.cpu.stats
    assert stats.claimed_blocks > 0, "the slow worker left a backlog at step()"
    assert stats.claimed_blocks <= stats.deferred_blocks, "a claimed update is counted among the deferred"
    assert slow.stronghold_report()["overlap"]["claimed_blocks_per_step"] > 0


def test_clipping_every_step_defers_and_stays_identical():
    """Clipping at 1e-4 clips every step: after the first step's forecast the worker's jobs only read the sums of
    squares (every update is deferred), so it keeps up with backward; whatever it leaves is claimed, identically."""
    model, data = tiny_llama(6), batches(4)
    slow, fast = _engine(model, True, clip=1e-4), _engine(model, False, clip=1e-4)
    _train(slow, data)
    _train(fast, data)
    _assert_identical(slow, fast)
    assert slow.stronghold_runtime.cpu.stats.deferred_blocks > 0


def test_a_skipped_step_with_claimed_updates():
    """Step 2's gradients are NaN: its claimed updates are dropped like deferred ones, and training goes on."""
    model, data = tiny_llama(6), batches(4)
    slow, fast = _engine(model, True, clip=1e3), _engine(model, False, clip=1e3)
    _train(slow, data, nan_at=2)
    _train(fast, data, nan_at=2)
    assert slow.skipped_steps == fast.skipped_steps == 1
    _assert_identical(slow, fast)
    assert slow.stronghold_runtime.cpu.stats.claimed_blocks > 0


def test_host_accumulation_claims_the_update_behind_the_sum():
    """With accumulation on the host the sum of squares is the worker's (of the summed gradient), an urgent job that
    step() waits for; the early update behind it is claimed when the slow worker has not begun it."""
    model, data = tiny_llama(6), batches(4)
    slow, fast = _engine(model, True, clip=1e3, gas=2), _engine(model, False, clip=1e3, gas=2)
    _train(slow, data)
    _train(fast, data)
    _assert_identical(slow, fast)
    assert slow.stronghold_runtime.cpu.stats.claimed_blocks > 0


class _Skippy(torch.nn.Module):
    """Four residual blocks; a batch's `skip` leaves one out of its forward, so that block gets no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                          for _ in range(4))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels, skip=-1):
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = x + layer(x)
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss)


def test_a_block_without_gradients_at_the_boundary_sums_after_its_earlier_jobs():
    """Accumulation 4, the last streamed block left out of every window's last micro-batch: at the boundary it sends
    nothing, so nothing waits for its buffer; its sum must still take micro-step 2's parked gradients (its job is an
    ordinary one, behind them, cpu_optim.submit_grads). Slow sums keep the worker's queue long. The run equals plain
    PyTorch's. (The other blocks' waits for their buffers happen to drain the queue before this block's sum here.)"""
    model, data = _Skippy(), batches(8)
    for i, batch in enumerate(data):
        batch["skip"] = 3 if i % 4 == 3 else -1
    trained = copy.deepcopy(model)
    engine, _, _, _ = stronghold.initialize(model=trained, blocks=trained.layers, config=ds_config(
        lr=LR, window=2, resident=1, gas=4, clip=1.0))
    engine.stronghold_runtime.cpu.kernel = _SlowKernel(engine.stronghold_runtime.cpu.kernel, accumulate=True)
    for batch in data:
        engine.backward(engine(**batch).loss)
        engine.step()
    engine.synchronize_host()
    reference, _ = train_reference(model, data, lr=LR, gas=4, clip=1.0)
    assert relative_error(engine.module, reference) <= 1e-5
