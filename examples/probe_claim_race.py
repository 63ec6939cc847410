"""Probe: do two runs of one clipped configuration end bit-identical whichever of the CPU worker and step() wins each
claim (cpu_records.UpdateRecord.claim / start)? Trains a tiny Llama (6 blocks, 1 resident, window 4, accumulation 4,
clipping 1.0, 8 micro-batches) with host accumulation and with the blockwise backward, once with every claim leaning
to the worker (step() waits up to 0.3 s for it to begin) and once leaning to step() (the worker waits up to 0.3 s for
the claim), and prints one JSON line: per schedule, the CPU optimizer's counts and how far the two runs' parameters
differ. The lean is set by wrapping the two methods in this process only.

    python examples/probe_claim_race.py
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29631").items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

from stronghold.optim import cpu_records  # noqa: E402
from tests.engine.helpers import batches, engine_for, named_params, relative_error, run_steps, tiny_llama  # noqa: E402

RECORD = cpu_records.UpdateRecord
ORIGINAL = RECORD.start, RECORD.claim
WAIT_S = 0.3


def lean(towards: str) -> None:
    start, claim = ORIGINAL

    def waiting(until):
        end = time.monotonic() + WAIT_S
        while not until() and time.monotonic() < end:
            time.sleep(0.002)

    if towards == "worker":
        RECORD.start, RECORD.claim = start, lambda self: (waiting(lambda: self._started), claim(self))[1]
    else:
        RECORD.start, RECORD.claim = lambda self: (waiting(lambda: self.claimed), start(self))[1], claim


def train(blockwise: bool) -> tuple[dict, dict]:
    model, data = tiny_llama(6), batches(8)
    engine = engine_for(model, lr=3e-3, gas=4, clip=1.0, window=4, resident=1, blockwise_backward=blockwise)
    run_steps(engine, data)
    stats = engine.stronghold_runtime.cpu.stats
    counts = {name: getattr(stats, name) for name in ("claimed_blocks", "deferred_blocks", "redo_blocks")}
    params = named_params(engine.module)
    engine.destroy()
    return params, counts


def main() -> None:
    out = {"probe": "claim_race", "torch": torch.__version__, "machine": platform.machine(), "wait_s": WAIT_S}
    for blockwise in (False, True):
        runs = {}
        for towards in ("worker", "step"):
            lean(towards)
            runs[towards] = train(blockwise)
        (a, counts_a), (b, counts_b) = runs["worker"], runs["step"]
        differing = [name for name in a if not torch.equal(a[name], b[name])]
        out["blockwise" if blockwise else "host_accumulation"] = {
            "worker_first": counts_a, "step_first": counts_b, "parameters": len(a),
            "bit_identical": not differing, "differing_parameters": len(differing),
            "max_abs_difference": max((float((a[n] - b[n]).abs().max()) for n in differing), default=0.0),
            "relative_error": relative_error(a, b)}
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
