"""The blocks' forwards block by block over the accumulation window (`"block_major_forward"`), under the blockwise
backward (blockwise.py).

Why: under the blockwise backward every forward of the window runs the blocks without autograd, and each brings the
streamed blocks outside the window back onto the GPU: at the Llama-3-8B point under 24 GiB, 11 of 32 blocks, an
H2D-bound ~0.09 s a forward, seven times a step after the first forward, which trails the CPU update block by block
(docs/design-notes.md). Given the window's micro-batches before its first forward, each block runs for all of them
while it is on the GPU: the window's blocks are loaded once, and every forward runs under the CPU update.

How:
- `offer` (engine.window_batches; the Trainer line hands over what Trainer's `get_batch_samples` fetched for the
  window) keeps the batches until the window's first training forward.
- There, before the model runs (`run`): a collecting pass per micro-batch through the model's own forward, without
  grad, with the keyword arguments that forward adds to its batch (`see_call`), that stops at the first block's
  pre-hook with its arguments (`Collected`); then block by block, each block runs
  for every micro-batch, recorded as blockwise.py records a forward (kept input, keyword arguments, RNG state), its
  output the next block's input. The last block's output is kept per micro-batch.
- Each micro-batch's own forward then runs the model as usual up to the first block. Where the first block's arguments
  equal those collected (`same`), the blocks are skipped: every block's instance forward (integrations/forwards.py)
  returns its input, the last one the kept output, and the window's hooks do nothing (`inert`). The head and the loss
  run for real, and the walk runs as without this. Where they differ (another batch than the one offered), what ran
  ahead is dropped and the window's forwards run one by one as without this.
- The blocks draw random numbers (dropout) in another order than plain training's; each call's RNG state is recorded
  and put back for the walk as always, so forward and walk agree. Models without dropout train the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from stronghold.integrations import forwards

FORWARD = "_stronghold_block_major_forward"
"""Where `forwards.install` keeps the instance forward that the skipping one replaces (a compiled one, or None)."""


class Collected(Exception):
    """Raised by the first block's pre-hook in a collecting pass: the model's forward stops there."""


@dataclass
class Ahead:
    """One micro-batch run ahead."""

    args: tuple
    """The first block's arguments (the hidden states first) and keyword arguments, as the pre-hook cleaned them."""
    kwargs: dict
    calls: dict = field(default_factory=dict)
    """Per block: its BlockCall (blockwise.py)."""
    tails: dict = field(default_factory=dict)
    """Per block whose output is a tuple: the elements after the hidden states (what a skipped call returns with)."""
    output: Any = None
    """The last block's output."""


def same(a: Any, b: Any) -> bool:
    """Whether two of a block's arguments are equal: tensors by shape, dtype, device and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(same(a[k], b[k]) for k in a))
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # an object without a plain equality: not provably the same
        return False


def hidden_of(output: Any) -> torch.Tensor:
    """A block's output hidden states (the next block's input)."""
    return output if isinstance(output, torch.Tensor) else output[0]


class BlockMajor:
    def __init__(self, blockwise):
        self.blockwise = blockwise
        self.index_of = {id(block): index for index, block in enumerate(blockwise.blocks)}
        """A block's index by id, for the skipping forward (installed on every block)."""
        self.offered: Optional[list[dict]] = None
        self.ahead: list[Ahead] = []
        """Per micro-batch of the window run ahead and not yet consumed by its own forward, from `first`."""
        self.first = 0
        """The window's micro-batch that `ahead[0]` is."""
        self.collecting: Optional[list] = None
        """During a collecting pass: where the first block's pre-hook puts the arguments."""
        self.skipping: Optional[Ahead] = None
        """During a micro-batch's own forward whose blocks ran ahead: what they return."""
        self.expecting = False
        """A training forward whose first block's arguments decide whether its blocks ran ahead (`take`) is on."""
        self.installed: list[nn.Module] = []
        self.call_kwargs: dict = {}
        self.runs = 0
        """Windows run ahead so far."""
        self.dropped = 0
        """Windows whose forwards ran one by one after all, as a batch differed from the one offered."""

    @property
    def inert(self) -> bool:
        """The blocks' calls are a collecting pass's or skipped ones, or the first block's call that decides whether
        they are skipped: the window's hooks leave them alone (blockwise.py enters the first block where it runs)."""
        return self.collecting is not None or self.skipping is not None or self.expecting

    def offer(self, batches: list[dict]) -> None:
        self.offered = list(batches)

    def expect(self, training: bool) -> None:
        """A forward starts (or its blocks just ran ahead): where it trains and blocks ran ahead, its first block's
        arguments decide whether they are skipped (`take`)."""
        self.expecting = training and bool(self.ahead)

    def stop_skipping(self) -> None:
        """A forward's record is dropped (a failure, or the next forward starts): none of its blocks is skipped."""
        self.skipping = None

    def see_call(self, kwargs: dict) -> None:
        """A training forward's keyword arguments, before it runs: those it adds to its batch (Trainer's
        `num_items_in_batch`, which transformers passes down to the blocks) go into the collecting passes too."""
        self.call_kwargs = kwargs

    def refuse(self) -> None:
        """This window's forwards run one by one (one asks for every block's output, which a skipped block has not)."""
        self.offered = None
        self.drop()
        self.expecting = False

    # The run ahead ----------------------------------------------------------------------------------------------
    def run(self, model: nn.Module, device: torch.device, prepare: Callable[[dict], dict]) -> None:
        """At the window's first training forward (blockwise.begin_forward has opened its record): every offered
        micro-batch's blocks, block by block. `prepare`: what the engine does to a training call's keyword arguments
        (compile.training_call), done to the collecting passes' too."""
        batches, self.offered = self.offered, None
        self.drop()
        if not batches or len(batches) < 2:
            return
        blockwise, grad = self.blockwise, torch.is_grad_enabled()
        extra = {k: v for k, v in self.call_kwargs.items() if k not in batches[0]}
        entries = [self._collect(model, prepare({**batch, **extra}), device) for batch in batches]
        hidden = [entry.args[0] for entry in entries]
        last = len(blockwise.blocks) - 1
        try:
            for index, block in enumerate(blockwise.blocks):
                for m, entry in enumerate(entries):
                    blockwise.record_into(entry.calls)
                    output = block(hidden[m], *entry.args[1:], **entry.kwargs)
                    if not isinstance(output, torch.Tensor):
                        entry.tails[index] = tuple(output[1:])
                    if index == last:
                        entry.output = output
                    else:
                        hidden[m] = hidden_of(output)
        except BaseException:
            self.ahead = entries
            self.drop()
            raise
        finally:
            blockwise.record_into(None)
            torch.set_grad_enabled(grad)  # a block that raised left its pre-hook's grad mode on
        self.ahead, self.first, self.runs = entries, 0, self.runs + 1
        for block in blockwise.blocks:
            if forwards.install(block, FORWARD, self._forward):
                self.installed.append(block)

    def _collect(self, model: nn.Module, batch: dict, device: torch.device) -> Ahead:
        """The first block's arguments for `batch`: the model's forward up to the first block, without grad."""
        found: list = []
        self.collecting = found
        try:
            with torch.no_grad():
                model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        except Collected:
            pass
        finally:
            self.collecting = None
        if not found:
            raise RuntimeError("stronghold: block_major_forward: the model's forward never reached its first block")
        args, kwargs = found[0]
        return Ahead(args=args, kwargs=kwargs)

    def collected(self, args: tuple, kwargs: dict) -> None:
        """The first block's pre-hook in a collecting pass: keep its arguments and stop the model there."""
        self.collecting.append((args, kwargs))
        raise Collected()

    # A micro-batch's own forward ----------------------------------------------------------------------------
    def take(self, micro: int, args: tuple, kwargs: dict) -> Optional[Ahead]:
        """The first block's pre-hook of micro-batch `micro`'s own forward: what ran ahead for it, where its
        arguments are those collected (from now on the blocks are skipped, `skipping`), else None (and whatever ran
        ahead is dropped)."""
        self.expecting = False
        if not self.ahead:
            return None
        entry = self.ahead[0] if micro == self.first else None
        if entry is None or not (same(args, entry.args) and same(kwargs, entry.kwargs)):
            self.dropped += 1
            self.drop()
            return None
        self.ahead.pop(0)
        self.first += 1
        self.skipping = entry
        return entry

    def _forward(self, module: nn.Module, *args, **kwargs):
        entry = self.skipping
        if entry is None:
            own = module.__dict__.get(FORWARD)
            return own(*args, **kwargs) if own is not None else type(module).forward(module, *args, **kwargs)
        index = self.index_of[id(module)]
        if index == len(self.blockwise.blocks) - 1:
            return entry.output
        tail = entry.tails.get(index)
        return args[0] if tail is None else (args[0], *tail)

    def skipped(self) -> None:
        """The last block's post-hook of a skipping forward: the rest of the model runs as usual."""
        self.skipping = None
        if not self.ahead:
            self._restore()

    def drop(self) -> None:
        """What ran ahead and was not consumed goes (the window ended early, a batch differed, a failure)."""
        self.skipping = None
        self.blockwise.kept.recycle(call.args[0] for entry in self.ahead for index, call in entry.calls.items()
                                    if index > 0)
        self.ahead = []
        self._restore()

    def _restore(self) -> None:
        for block in self.installed:
            forwards.restore(block, FORWARD)
        self.installed.clear()


class RunsAhead:
    """The runtime's side of block-major forwards (a mixin of runtime.StrongholdRuntime): whether the windows' batches
    come ahead, and the blocks' calls that are not the model's compute."""
    settings: Any
    blockwise: Any
    batches_ahead: bool

    @property
    def runs_ahead(self) -> bool:
        """Block-major forwards configured and the batches given ahead: what the planner counts on."""
        return self.settings.block_major_forward and self.batches_ahead

    def offer_window(self, batches: list) -> None:
        """engine.window_batches: kept for the window's first forward where it can run ahead."""
        self.batches_ahead = True
        if self.settings.block_major_forward and self.blockwise is not None:
            self.blockwise.major.offer(batches)

    @property
    def blocks_inert(self) -> bool:
        """The blocks' calls now are not the model's compute: the window's hooks leave them alone."""
        return self.blockwise is not None and self.blockwise.major.inert
