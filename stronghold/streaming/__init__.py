"""Moving block weights and gradients: host buffers, pinned memory, side streams, the working window, its schedule and hooks."""
