#!/usr/bin/env bash
# The automatic-placement acceptance points (issue 9), each comparison in one run, on a GPU machine:
#   gpt2:  GPT-2 1.72 B (the seed's shape), plain DeepSpeed uncapped vs stronghold with no knobs at 32 GiB
#   llama: Llama 2.70 B (h2560, 20 heads, 32 layers, seq 2048, micro-batch 2, accumulation 8), same pair, and
#          stronghold again with placements set by hand (LLAMA_AB, JSON knobs separated by ';': the A/B)
#   noclip: the llama pair with gradient clipping off (the cost of waiting for the global norm, same run)
#   hf:    the same Llama through HF Trainer: plain (uncapped) vs the one-line stronghold.initialize (32 GiB)
# Usage: examples/bench/placement_acceptance.sh OUT_DIR [gpt2] [llama] [noclip] [hf]   (default: gpt2 llama hf; LLAMA_AB= skips
# the A/B; LLAMA_STEPS: timed steps of each Llama point, default 3; LLAMA_REPEAT: the plain/stronghold pair this many
# times, back to back, default 1)
# Results: OUT_DIR/bench/placement.jsonl, OUT_DIR/hf/llama.jsonl, logs beside them; a summary last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: $0 OUT_DIR [gpt2] [llama] [noclip] [hf]}; shift
PARTS=${*:-gpt2 llama hf}
LLAMA="--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000"
# The A/B default: the two placements the planner's search weighs on this shape under 32 GiB (it has chosen each):
# one more resident block with a small window, or every streamed block cached in a slot.
LLAMA_AB=${LLAMA_AB-'{"resident_blocks": 16, "window_size": 4};{"resident_blocks": 15, "window_size": 17}'}
mkdir -p "$OUT/hf"
LLAMA_STEPS="--timed-steps ${LLAMA_STEPS:-3}"
n=0  # numbers the logs: points of one shape differ only past the part of their flags a file name keeps
LOGS=${LOG_DIR:-$OUT}  # the points' logs (LOG_DIR: elsewhere, e.g. to keep $OUT small when only the records are copied back)
mkdir -p "$LOGS"
bench() { n=$((n + 1)); timeout "${BENCH_TIMEOUT:-150}" python3 -m examples.bench one --results-dir "$OUT/bench" \
  --figure placement "$@" > "$LOGS/bench${n}_$(echo "$*" | tr -c 'a-z0-9' _ | cut -c1-80).log" 2>&1; echo "bench $* -> rc $?"; }
for part in $PARTS; do
  case $part in
    gpt2) bench --system no_offload --gpu-cap-gb none --layers 32 --timed-steps 6
          bench --system stronghold --layers 32 --timed-steps 6 ;;
    llama) bench --system no_offload --gpu-cap-gb none $LLAMA $LLAMA_STEPS
           bench --system stronghold --gpu-cap-gb 32 $LLAMA $LLAMA_STEPS
           # Repeats of the pair, back to back, each in its own file (a store skips a point it already has).
           for rep in $(seq 2 "${LLAMA_REPEAT:-1}"); do
             bench --system no_offload --gpu-cap-gb none $LLAMA $LLAMA_STEPS --figure "placement_r$rep" --repeat "$rep"
             bench --system stronghold --gpu-cap-gb 32 $LLAMA $LLAMA_STEPS --figure "placement_r$rep" --repeat "$rep"
           done
           IFS=';' read -ra knobs <<< "$LLAMA_AB"
           for knob in "${knobs[@]}"; do bench --system stronghold --gpu-cap-gb 32 $LLAMA $LLAMA_STEPS --stronghold "$knob"; done ;;
    noclip) bench --system no_offload --gpu-cap-gb none $LLAMA $LLAMA_STEPS --gradient-clipping 0
            bench --system stronghold --gpu-cap-gb 32 $LLAMA $LLAMA_STEPS --gradient-clipping 0 ;;
    hf) for mode in "--no-stronghold" "--gpu-memory-limit-gb 32"; do
          timeout "${HF_TIMEOUT:-200}" python3 examples/hf_trainer.py $LLAMA --steps 12 --bf16 --gradient-checkpointing \
            $mode --json "$OUT/hf/llama.jsonl" > "$OUT/hf/$(echo "$mode" | tr -c 'a-z0-9' _).log" 2>&1
          echo "hf $mode -> rc $?"; done ;;
    *) echo "unknown part $part (gpt2, llama, noclip, hf)"; exit 2 ;;
  esac
done
python3 -m examples.bench.placement_summary "$OUT"
