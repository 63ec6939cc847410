"""Checkpoints: save, load and the on-disk files (safetensors + manifest), in one format for any world size."""
