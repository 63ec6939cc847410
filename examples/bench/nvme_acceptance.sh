#!/usr/bin/env bash
# The NVMe tier's acceptance (issue 34), on a GPU machine with a local NVMe drive:
#   io:        the drive's two I/O backends (stronghold's O_DIRECT thread pool; DeepSpeed's libaio op where it builds)
#   tier:      GPT-2 h2048 x LAYERS (default 96: 4.9 B; at 64 layers, 3.3 B, a 32 GiB GPU keeps so many blocks
#              resident that the rest fit 32 GiB of host, 25 GB at its peak), seq 1024, micro-batch 4, 32 GiB GPU cap,
#              stronghold with host_memory_limit_gb 32 and nvme_path (no other knob)
#   unlimited: the same stronghold point with the host unlimited (the tier's cost)
#   zero:      ZeRO-Infinity with parameters and optimizer states on NVMe (DeepSpeed's documented config). DeepSpeed's
#              async_io op needs libaio: where the machine has none, libaio's interface over the same system calls is
#              built from examples/bench/libaio_shim first (the record's `libaio` names the library loaded); recorded
#              as "unavailable", with the reason, where the op still does not build
# Usage: examples/bench/nvme_acceptance.sh OUT_DIR NVME_DIR [io] [tier] [unlimited] [zero]   (default: all, in that
# order; NVME_DIR: a directory on the drive, emptied before each point. STEPS: timed steps, default 3;
# WARMUP: untimed steps first, default 2; BENCH_TIMEOUT: seconds a point, default 280, so that two points fit a
# 10-minute call, or T_TIER, T_UNLIMITED, T_ZERO for one point; GPU_CAP: the card's GiB, default 32; run the parts in
# separate calls on the same warm machine where they do not fit one)
# Results: OUT_DIR/nvme_io.jsonl, OUT_DIR/bench/nvme.jsonl, logs beside them, OUT_DIR/nvme_summary.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: $0 OUT_DIR NVME_DIR [io] [tier] [unlimited] [zero]}
DRIVE=${2:?usage: $0 OUT_DIR NVME_DIR [io] [tier] [unlimited] [zero]}
shift 2
PARTS=${*:-io tier unlimited zero}
mkdir -p "$OUT" "$DRIVE"
if [[ " $PARTS " == *" io "* || " $PARTS " == *" zero "* ]] && ! python3 -c \
    "from stronghold.streaming.nvme_io import aio_available; raise SystemExit(0 if aio_available() else 1)" 2>/dev/null
then
  SHIM="${TMPDIR:-/tmp}/stronghold-libaio-shim"
  eval "$(bash examples/bench/libaio_shim/build.sh "$SHIM")" && echo "libaio: none here; the shim, built in $SHIM"
fi
# DeepSpeed's JIT builder cannot parse an architecture with a suffix (9.0a): the list without suffixes
[ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST=$(sed -E 's/([0-9])[a-z]+/\1/g' <<< "$TORCH_CUDA_ARCH_LIST")
# The drive's counts per step are read at the end without waiting for the last step's updates, which run behind it;
# they cover whole steps only where the warm-up's last step also left its updates running, which the first step
# (re-planned, its updates waited for) does not.
if (( ${WARMUP:-2} < 2 )); then
    echo "WARMUP=${WARMUP} leaves the drive's counts a step short: use 2 or more" >&2
    exit 2
fi
SHAPE="--layers ${LAYERS:-96} --gpu-cap-gb ${GPU_CAP:-32} --warmup-steps ${WARMUP:-2} --timed-steps ${STEPS:-3}"
LIMIT=${BENCH_TIMEOUT:-280}
n=0
bench() { local limit=$1; shift; n=$((n + 1)); rm -rf "${DRIVE:?}"/*; timeout $((limit + 30)) python3 -m examples.bench one \
  --results-dir "$OUT/bench" --figure nvme --point-timeout-s "$limit" --budget-s "$limit" "$@" \
  > "$OUT/bench${n}_$(date +%s).log" 2>&1; echo "bench $* -> rc $?"; }
for part in $PARTS; do
  case $part in
    io) python3 -m examples.bench.nvme_io --dir "$DRIVE" --json "$OUT/nvme_io.jsonl" > "$OUT/nvme_io.log" 2>&1
        echo "nvme_io -> rc $?" ;;
    tier) bench "${T_TIER:-$LIMIT}" --system stronghold $SHAPE --stronghold "{\"host_memory_limit_gb\": 32, \"nvme_path\": \"$DRIVE\"}" ;;
    unlimited) bench "${T_UNLIMITED:-$LIMIT}" --system stronghold $SHAPE ;;
    zero) bench "${T_ZERO:-$LIMIT}" --system zero_infinity_nvme $SHAPE --nvme-path "$DRIVE" ;;
    *) echo "unknown part $part (io, tier, unlimited, zero)"; exit 2 ;;
  esac
done
rm -rf "${DRIVE:?}"/*
python3 -m examples.bench.nvme_summary "$OUT"
