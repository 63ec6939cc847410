#!/usr/bin/env bash
# The automatic-placement acceptance points (issue 9), each comparison in one run, on a GPU machine:
#   gpt2:  GPT-2 1.72 B (the seed's shape), plain DeepSpeed uncapped vs stronghold with no knobs at 32 GiB
#   llama: Llama 2.70 B (h2560, 20 heads, 32 layers, seq 2048, micro-batch 2, accumulation 8), same pair, and
#          stronghold again with one knob set each (gpu_accumulation false / true, window_size 2: the A/B)
#   hf:    the same Llama through HF Trainer: plain (uncapped) vs the one-line stronghold.initialize (32 GiB)
# Usage: scripts/placement_acceptance.sh OUT_DIR [gpt2] [llama] [hf]   (default: all three; LLAMA_AB=0 skips the A/B)
# Results: OUT_DIR/bench/placement.jsonl, OUT_DIR/hf/llama.jsonl, logs beside them; a summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT_DIR [gpt2] [llama] [hf]}; shift
PARTS=${*:-gpt2 llama hf}
LLAMA="--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000"
mkdir -p "$OUT/hf"
bench() { timeout "${BENCH_TIMEOUT:-150}" python3 -m examples.bench one --results-dir "$OUT/bench" --figure placement "$@" \
  > "$OUT/bench_$(echo "$*" | tr -c 'a-z0-9' _ | cut -c1-80).log" 2>&1; echo "bench $* -> rc $?"; }
for part in $PARTS; do
  case $part in
    gpt2) bench --system no_offload --gpu-cap-gb none --layers 32 --timed-steps 6
          bench --system stronghold --layers 32 --timed-steps 6 ;;
    llama) bench --system no_offload --gpu-cap-gb none $LLAMA
           bench --system stronghold --gpu-cap-gb 32 $LLAMA
           # A/B of the same point, one knob each: accumulation on the host / on the GPU (device_accum.py), and
           # the window held at 2 slots (no caching of streamed blocks across micro-steps, planner._walk).
           [ "${LLAMA_AB:-1}" = 1 ] && for knob in '{"gpu_accumulation": false}' '{"gpu_accumulation": true}' '{"window_size": 2}'; do
             bench --system stronghold --gpu-cap-gb 32 $LLAMA --stronghold "$knob"; done ;;
    hf) for mode in "--no-stronghold" "--gpu-memory-limit-gb 32"; do
          timeout "${HF_TIMEOUT:-200}" python3 examples/hf_trainer.py $LLAMA --steps 12 --bf16 --gradient-checkpointing \
            $mode --json "$OUT/hf/llama.jsonl" > "$OUT/hf/$(echo "$mode" | tr -c 'a-z0-9' _).log" 2>&1
          echo "hf $mode -> rc $?"; done ;;
    *) echo "unknown part $part (gpt2, llama, hf)"; exit 2 ;;
  esac
done
python3 -m examples.bench.placement_summary "$OUT"
