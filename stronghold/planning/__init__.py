"""Placement: what stays on the GPU and what streams, predicted from measured rates (pure data in, frozen plan out)."""
