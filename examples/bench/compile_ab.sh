#!/usr/bin/env bash
# Regional compilation of the blocks, off against on, each pair in one run on a GPU machine:
#   gpt2:  GPT-2 1.72 B (h2048, 16 heads, 32 layers, seq 1024, micro-batch 4, checkpointing) at 32 GiB, no other knobs
#   llama: Llama 2.70 B (h2560, 20 heads, 32 layers, seq 2048, micro-batch 2, accumulation 8) through the HF Trainer
#          one-liner (examples/hf_trainer.py) at 32 GiB
# Off first: the compiled point then starts from a cold Inductor cache, as a first run on a machine does, so its
# compile_s is the cold one (TORCHINDUCTOR_CACHE_DIR keeps it for the next run).
# Usage: examples/bench/compile_ab.sh OUT_DIR [gpt2] [llama]   (default: both; GPT2_STEPS / LLAMA_STEPS: timed steps)
# Results: OUT_DIR/bench/compile.jsonl, OUT_DIR/hf/llama.jsonl, logs beside them; OUT_DIR/summary.json and a table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: $0 OUT_DIR [gpt2] [llama]}; shift
PARTS=${*:-gpt2 llama}
LLAMA="--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000"
mkdir -p "$OUT/hf"
for part in $PARTS; do
  case $part in
    gpt2) for setting in false true; do
            timeout "${BENCH_TIMEOUT:-200}" python3 -m examples.bench one --results-dir "$OUT/bench" --figure compile \
              --system stronghold --layers 32 --gpu-cap-gb 32 --warmup-steps 2 --timed-steps "${GPT2_STEPS:-4}" \
              --no-floor --point-timeout-s 190 --stronghold "{\"compile\": $setting}" > "$OUT/gpt2_compile_$setting.log" 2>&1
            echo "gpt2 compile $setting -> rc $?"; done ;;
    llama) for setting in false true; do
             timeout "${HF_TIMEOUT:-200}" python3 examples/hf_trainer.py $LLAMA --steps "$((3 + ${LLAMA_STEPS:-3}))" \
               --warmup-steps 3 --bf16 --gradient-checkpointing --gpu-memory-limit-gb 32 \
               --stronghold-config "{\"compile\": $setting}" --json "$OUT/hf/llama.jsonl" > "$OUT/hf/llama_compile_$setting.log" 2>&1
             echo "llama compile $setting -> rc $?"; done ;;
    *) echo "unknown part $part (gpt2, llama)"; exit 2 ;;
  esac
done
python3 -m examples.bench.compile_summary "$OUT"
