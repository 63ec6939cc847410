"""Activation memory: offload of saved activations, chunked MLPs, long-context decisions."""
