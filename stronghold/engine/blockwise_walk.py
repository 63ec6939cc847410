"""The boundary's walk of the blockwise backward (blockwise.py): every block's backward over every micro-batch, from
the last block to the first, then the embeddings', each parameter's gradients summed in fp32 on the device."""
from __future__ import annotations

import contextlib

import torch

from stronghold.streaming.cached import INDEX_OF
from stronghold.streaming.device_accum import add_grads
from stronghold.streaming.hooks import first_grad_tensor
from stronghold.streaming.schedule import Phase


def run_walk(blockwise, runtime) -> None:
    """`blockwise`: the recorded window (blockwise.BlockwiseBackward); `runtime`: the runtime it belongs to."""
    micro = len(blockwise.calls)
    grads = list(blockwise.top_grads)
    """Per micro-batch: the gradient at the output of the block walked next."""
    if runtime.window is not None and runtime.window.phase is not Phase.BACKWARD:
        runtime.window.begin(Phase.BACKWARD, True)  # step() closing a window without its boundary backward
    resident_ids = {id(p) for p in runtime.resident.params}
    in_blocks: set[int] = set()
    sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    """The resident parameters' fp32 sums of the walk, merged into the resident accumulators once it is over."""
    hooked = runtime.window is not None
    kept = blockwise.kept
    for index in reversed(range(len(blockwise.blocks))):
        if index > 0:  # the block below's inputs come back while this one is walked
            for calls in blockwise.calls:
                if index - 1 in calls:
                    kept.prefetch(calls[index - 1].args[0])
        block = blockwise.blocks[index]
        params = [p for p in block.parameters() if id(p) in resident_ids]
        in_blocks.update(id(p) for p in block.parameters())
        store = runtime.stores.get(index)
        total, touched = None, set()
        for m in range(micro):
            call = blockwise.calls[m].get(index)
            if call is None or grads[m] is None:
                continue
            x = kept.get(call.args[0]).detach().requires_grad_()
            with blockwise.replay(index, call), torch.enable_grad(), \
                    runtime.hooks.saved_tensors() if hooked else contextlib.nullcontext():
                out = first_grad_tensor(block(x, *call.args[1:], **call.kwargs))
                if out is not None:
                    torch.autograd.backward(out, grads[m])
            grads[m] = x.grad
            kept.release(call.args[0])
            if store is not None:
                total = _fold_streamed(store, total, touched)
            else:
                _fold(params, sums)
        if store is not None:
            runtime.offload_block_sum(index, total, [e for e in store.trainable if id(e) in touched])
    _embeddings(blockwise, runtime, grads, [p for p in runtime.resident.params if id(p) not in in_blocks], sums,
                runtime.cached.units.get(INDEX_OF["input"]))
    runtime.resident.add_sums({key: total for key, (_, total) in sums.items()})


def _embeddings(blockwise, runtime, grads: list, rest: list, sums: dict, unit) -> None:
    """The first block's input gradients back through what computed its input (the embeddings), micro-batch by
    micro-batch. The boundary micro-batch's gradients of the rest (the head's) wait aside meanwhile, so each sum holds
    what this backward adds alone. A cached input part (`unit`, cached.py) gets its fp32 sum as a streamed block does:
    one D2H, one submission; a plain table's, the sums of the window's rows alone (embedding_rows.py)."""
    rows = blockwise.table_rows(unit)
    summed = None if rows is None else rows.sum_rows(blockwise.inputs, grads)
    if summed is not None:  # the table is the only parameter on the graph: no other sum to fold
        runtime.offload_rows_sum(unit.store.index, rows, *summed)
        return
    if rows is not None:
        rows.whole_table_buffer(unit.store)
    held = {id(p): (p, p.grad) for p in rest if p.grad is not None}
    total, touched = None, set()
    for p, _ in held.values():
        p.grad = None
    for m, hidden in enumerate(blockwise.inputs):
        if hidden is None or grads[m] is None:
            continue
        # The graph stays until the walk is over: a boundary that fails is run again from the same inputs.
        torch.autograd.backward(hidden, grads[m], retain_graph=True)
        _fold(rest, sums)
        if unit is not None:
            total = _fold_streamed(unit.store, total, touched)
    for p, grad in held.values():
        p.grad = grad
    if unit is not None:
        runtime.offload_block_sum(unit.store.index, total, [e for e in unit.store.trainable if id(e) in touched])


@torch.no_grad()
def _fold(params: list, sums: dict) -> None:
    """One micro-batch's gradients of `params` into their fp32 sums: the first converted, later ones added."""
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        entry = sums.get(id(param))
        if entry is None:
            sums[id(param)] = (param, grad.float() if grad.dtype != torch.float32 else grad)
        else:
            entry[1].add_(grad)
        param.grad = None


@torch.no_grad()
def _fold_streamed(store, total, touched: set):
    """One micro-batch's gradients of a streamed block into its flat fp32 sum (the store's trainable layout)."""
    present = [entry for entry in store.trainable if entry.param.grad is not None]
    if present and total is None:
        total = torch.zeros(store.trainable_numel, dtype=torch.float32, device=present[0].param.grad.device)
    if present:
        add_grads(total, present)
    touched.update(id(entry) for entry in present)
    return total
