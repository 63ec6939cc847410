"""A module's forward replaced on the instance (never on its class), and put back as it was.

Both the MLP chunks (memory/mlp_chunks.py) and the compiled blocks (integrations/compile.py) swap a module's
`forward` this way: `nn.Module.__call__` looks `forward` up on the instance first, so the module's hooks still run
around the replacement, other instances of the class are untouched, and `restore` leaves the instance as found.
"""
from __future__ import annotations

import types
from typing import Callable

from torch import nn


def install(module: nn.Module, key: str, forward: Callable) -> bool:
    """Make `forward` (a function taking the module first) the instance's forward, keeping the instance's own forward
    (or None) under `key`; False, and nothing changed, where `key` already holds one."""
    if key in module.__dict__:
        return False
    module.__dict__[key] = module.__dict__.get("forward")
    module.__dict__["forward"] = types.MethodType(forward, module)
    return True


def restore(module: nn.Module, key: str) -> None:
    """Undo `install`: the instance's own forward back, or none (the class's) where it had none."""
    own = module.__dict__.pop(key)
    if own is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = own
