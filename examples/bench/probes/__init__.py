"""Probes: one-question measurements of the host or the engine that the sweeps do not make.

Each prints (and with --json appends) one JSON line with the commit and the host it ran on; nothing here is a test
or a benchmark of record. `docs/design-notes.md` keeps the answers of the probes that were retired.
"""
