"""Data parallel: the node-shared host copy, sharded optimizer states, gradient reduction."""
