"""config.collect_after_backward: the engine runs a young-generation collection as each backward ends, and none
when it is off. Collection timing changes no arithmetic, so both runs train to the same weights (without clipping:
with it, how many streamed updates run early depends on timing, equal to rounding only, speculation.py)."""
import copy
import gc

import pytest
import torch

import stronghold

from .helpers import batches, ds_config, tiny_llama


class _Collections:
    """Generation-1 collections that begin inside `engine.backward` calls, as the engine's own call is the last
    thing each backward does."""

    def __init__(self):
        self.young = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start" and info.get("generation") == 1:
            self.young += 1


def _train(collect: bool, gas: int = 2):
    model = tiny_llama(n_layer=3)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        gas=gas, clip=0.0, collect_after_backward=collect))
    seen = _Collections()
    backward_calls = 0
    for batch in batches(4):
        loss = engine(**batch).loss
        gc.callbacks.append(seen)
        try:
            engine.backward(loss)
        finally:
            gc.callbacks.remove(seen)
        backward_calls += 1
        engine.step()
    engine.synchronize_host()
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return seen.young, backward_calls, weights


@pytest.mark.parametrize("gas", [1, 2])
def test_a_young_collection_ends_every_backward_only_when_on(gas):
    young_on, calls, weights_on = _train(True, gas)
    young_off, _, weights_off = _train(False, gas)
    # The interpreter may add collections of its own during a backward; the engine's is one per call.
    assert young_on >= calls
    assert young_off < calls, "with the setting off the engine must not collect (the tiny model allocates little)"
    for name, value in weights_on.items():
        assert torch.equal(value, weights_off[name]), name
