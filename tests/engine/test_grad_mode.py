"""A Ctrl-C inside a `torch.no_grad()` block's exit, during forward or step(): the script that catches the
KeyboardInterrupt and trains on still has grad mode on.

A signal can land on any bytecode; landing in `no_grad.__exit__` before it restores the mode (or between a `with`'s
enter and its protection) leaves the thread with grad mode off, and the next forward builds no graph (DeepSpeed then
refuses the loss: "loss must be a scalar tensor"). The engine's training calls restore the caller's mode whatever
raises. `InterruptAt` puts the interrupt on the first line of the first `no_grad` exit inside the call, so the case is
hit every run rather than by chance. (An interrupted step() is left part-done, as DeepSpeed's own is: only the grad
mode is checked there. backward() runs no such block on the caller's thread: autograd sets and restores
the mode itself.)
"""
import pytest
import torch

from .helpers import batches, engine_for, tiny_llama
from .interrupts import InterruptAt


@pytest.mark.parametrize("name", ["forward", "step"])
def test_a_ctrl_c_in_a_no_grad_exit_leaves_grad_mode_on(name):
    data = batches(4)
    engine = engine_for(tiny_llama(4), window=2, resident=1, clip=1.0, stall_timeout_s=10)
    engine.backward(engine(**data[0]).loss)
    engine.step()
    if name == "step":
        engine.backward(engine(**data[1]).loss)
    call = {"forward": lambda: engine(**data[1]), "step": engine.step}[name]
    # Grad mode is still off on the first line of a no_grad exit: the interrupt lands where it cannot be restored.
    with pytest.raises(KeyboardInterrupt), InterruptAt([torch.no_grad.__exit__], n=1) as interrupt:
        call()
    assert interrupt.fired_at is not None, f"{name} ran no torch.no_grad() block: the case was not tested"
    assert torch.is_grad_enabled(), f"a Ctrl-C in a no_grad exit inside {name} left grad mode off"
    if name == "forward":  # the interrupted micro-batch is dropped and training goes on
        for batch in data[2:]:
            loss = engine(**batch).loss
            assert loss.grad_fn is not None
            engine.backward(loss)
            engine.step()
        assert torch.isfinite(loss)
    engine.destroy()
