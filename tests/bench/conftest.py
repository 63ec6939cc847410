"""tests/bench: the benchmark runner's logic on the CPU (no GPU, tiny shapes, temp dirs only).

`python -m pytest` from the repo root puts the root on sys.path; this makes `examples.bench`
importable however pytest is started.
"""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
