"""Triton code. Importing anything here imports Triton: the op modules do so lazily, at first call."""
