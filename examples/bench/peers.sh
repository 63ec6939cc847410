#!/usr/bin/env bash
# stronghold beside the peers a user would pick (torchao CPUOffloadOptimizer, FSDP2 CPUOffloadPolicy, DeepSpeed ZeRO-3
# offload, ZenFlow, ZeRO-Offload), each configured as its own documentation recommends, every ratio from one call:
#   llama8b: the Llama-3-8B shape (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, vocab 128256), HF
#            Trainer (examples/bench/hf_peers.py), mb 1, seq 2048, GA 8, bf16, checkpointing, clipping 1.0, under a
#            CAP GiB cap (default 24): stronghold's one line, then zero3_offload and torchao (the peers that fit a
#            24 GiB cap; their set-up and first steps take minutes, so they fill one call)
#   llama8b_rest: the same point for fsdp2, zenflow and torchao_accumulate (torchao with offload_gradients=False,
#            the setting its README leaves for gradient accumulation; at 24 GiB fsdp2 and zenflow ran out of GPU memory)
#   qwen7b:  the Qwen2.5-7B shape (hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 KV heads, vocab 152064,
#            Qwen2 blocks) at llama8b's settings: stronghold's one line, then torchao and zero3_offload
#   gpt2:    GPT-2 1.72 B (h2048, 32 layers, seq 1024, mb 4; `python -m examples.bench one`): stronghold, torchao,
#            fsdp2_offload and zero_offload under 32 GiB, plain DeepSpeed uncapped
#   smoke:   every HF peer and every bench peer system on a tiny Llama, 2-3 steps each: does each path run here?
# Usage: examples/bench/peers.sh OUT_DIR [llama8b] [llama8b_rest] [qwen7b] [gpt2] [smoke]   (default: llama8b)
# Each point has its own wall-clock limit, start-up included (a peer that needs minutes to start gets them, and one
# that cannot fit or fails leaves a record with the reason); each part's defaults sum to under 570 s, and the whole
# script keeps within BUDGET_S (560): a point's limit is cut to what is left, and none starts late. On one GPU of a 2x
# H200 host, stronghold's set-up took 75-95 s and its first two steps 16-31 s (steady steps 5 s), ZeRO-3 offload's
# set-up 100-130 s and its steps 15-20 s: the limits leave each a few steady steps.
# Override one with T_<POINT>=seconds (T_STRONGHOLD, T_TORCHAO, T_FSDP2, T_ZERO3, T_ZENFLOW; gpt2: G_STRONGHOLD,
# G_NO_OFFLOAD, G_TORCHAO, G_FSDP2, G_ZERO_OFFLOAD; smoke: T_SMOKE), the peers with HF_PEERS="torchao zenflow" or
# GPT2_SYSTEMS="stronghold zenflow", the steps with LLAMA_STEPS (default 12: each point stops at its limit), llama8b's
# stronghold point's config beyond the cap with STRONGHOLD_CONFIG='{"nvme_path": "/mnt/nvme"}', and a second stronghold
# point right after the first with STRONGHOLD_CONFIG_B='{"block_major_forward": true}' (a setting beside the default)
# and/or STRONGHOLD_FLAGS_B='--max-grad-norm 0' (hf_trainer.py flags: e.g. what exact clipping costs).
# Records: OUT_DIR/hf/peers_<part>.jsonl, OUT_DIR/bench/peers.jsonl, logs under OUT_DIR/logs; summary tables last
# (python -m examples.bench.peers_summary OUT_DIR: also OUT_DIR/peers_summary.json).
# On the GPU machine, carry .whl (DeepSpeed and its dependencies from shared/tools/device-wheels.sh, plus torchao's
# wheel): they are installed into /tmp/site first. Set BENCH_COMMIT to the commit measured (the copy has no .git).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: $0 OUT_DIR [llama8b] [llama8b_rest] [qwen7b] [gpt2] [smoke]}; shift
PARTS=${*:-llama8b}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torchao.optim" 2> /dev/null || echo "torchao is not importable: its points will record the ImportError"
mkdir -p "$OUT/hf" "$OUT/bench" "$OUT/logs"

LLAMA8B="--arch llama --hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 --seq 2048
  --batch 1 --accumulation 8 --bf16 --gradient-checkpointing"
QWEN7B="--arch qwen2 --hidden 3584 --intermediate 18944 --layers 28 --heads 28 --kv-heads 4 --vocab 152064 --seq 2048
  --batch 1 --accumulation 8 --bf16 --gradient-checkpointing"
GPT2="--hidden 2048 --heads 16 --layers 32 --seq 1024 --batch 4"
TINY="--arch llama --hidden 256 --intermediate 688 --layers 4 --heads 4 --kv-heads 2 --vocab 32000 --seq 256 --batch 2
  --accumulation 2"

BUDGET_S=${BUDGET_S:-560}  # the whole script's wall seconds: a point's limit is cut to what is left, none starts under 30 s
fit() {  # the limit $1 cut to the budget left (minus the summary's seconds), or nothing when under 30 s are left
  local left=$((BUDGET_S - SECONDS - 10))
  [ "$left" -lt 30 ] && return 1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
hf() {  # hf PART PEER LIMIT_S FLAGS...
  local part=$1 peer=$2 limit; shift 2
  limit=$(fit "$1") || { echo "hf $part $peer: skipped, the budget is spent (BUDGET_S=$BUDGET_S)"; return; }; shift
  python3 -m examples.bench.hf_peers --peer "$peer" --time-limit-s "$limit" --json "$OUT/hf/peers_$part.jsonl" \
    --log-dir "$OUT/logs" --output-dir "/tmp/hf_peers_$peer" "$@"
  echo "hf $part $peer (limit $limit s) -> rc $?"
}
one() {  # one SYSTEM LIMIT_S FLAGS...
  local system=$1 limit; shift
  limit=$(fit "$1") || { echo "bench one $system: skipped, the budget is spent (BUDGET_S=$BUDGET_S)"; return; }; shift
  local log="$OUT/logs/one_${system}_$(date +%s).log"
  python3 -m examples.bench one --results-dir "$OUT/bench" --figure peers --log-dir "$OUT/logs" --no-floor \
    --point-timeout-s "$limit" --budget-s "$((limit + 30))" --min-start-s 1 --system "$system" "$@" > "$log" 2>&1
  echo "bench one $system (limit $limit s) -> rc $?"; tail -n 4 "$log"
}
limit_of() {  # the default limit of a llama8b or qwen7b peer, or its T_ override
  case $1 in
    stronghold) echo "${T_STRONGHOLD:-200}" ;; torchao|torchao_accumulate) echo "${T_TORCHAO:-100}" ;;
    fsdp2) echo "${T_FSDP2:-150}" ;;
    zero3_offload) echo "${T_ZERO3:-240}" ;; zenflow) echo "${T_ZENFLOW:-250}" ;; *) echo "${T_PLAIN:-100}" ;;
  esac
}
gpt2_limit_of() {
  case $1 in
    stronghold) echo "${G_STRONGHOLD:-100}" ;; no_offload) echo "${G_NO_OFFLOAD:-70}" ;;
    torchao) echo "${G_TORCHAO:-80}" ;; fsdp2_offload) echo "${G_FSDP2:-110}" ;; zero_offload) echo "${G_ZERO_OFFLOAD:-130}" ;;
    *) echo "${G_OTHER:-150}" ;;
  esac
}

for part in $PARTS; do
  case $part in
    llama8b|llama8b_rest|qwen7b)
      peers="stronghold zero3_offload torchao"; shape=$LLAMA8B; name=llama8b
      [ "$part" = llama8b_rest ] && peers="torchao_accumulate fsdp2 zenflow"
      [ "$part" = qwen7b ] && peers="stronghold torchao zero3_offload" && shape=$QWEN7B && name=qwen7b
      for peer in ${HF_PEERS:-$peers}; do
        extra=()
        [ "$peer" = stronghold ] && [ -n "${STRONGHOLD_CONFIG:-}" ] && extra=(--stronghold-config "$STRONGHOLD_CONFIG")
        hf "$name" "$peer" "$(limit_of "$peer")" $shape --gpu-memory-limit-gb "${CAP:-24}" \
          --steps "${LLAMA_STEPS:-12}" --warmup-steps 1 "${extra[@]}"
        if [ "$peer" = stronghold ] && [ -n "${STRONGHOLD_CONFIG_B:-}${STRONGHOLD_FLAGS_B:-}" ]; then  # a second point
          extra=()
          [ -n "${STRONGHOLD_CONFIG_B:-}" ] && extra=(--stronghold-config "$STRONGHOLD_CONFIG_B")
          hf "$name" stronghold "$(limit_of stronghold)" $shape --gpu-memory-limit-gb "${CAP:-24}" \
            --steps "${LLAMA_STEPS:-12}" --warmup-steps 1 "${extra[@]}" ${STRONGHOLD_FLAGS_B:-}
        fi
      done ;;
    gpt2)
      for system in ${GPT2_SYSTEMS:-stronghold no_offload torchao fsdp2_offload zero_offload}; do
        cap=32; [ "$system" = no_offload ] && cap=none
        one "$system" "$(gpt2_limit_of "$system")" $GPT2 --gpu-cap-gb "$cap"
      done ;;
    smoke)
      for peer in stronghold plain torchao torchao_accumulate fsdp2 zero3_offload zenflow; do
        hf smoke "$peer" "${T_SMOKE:-90}" $TINY --bf16 --gradient-checkpointing --gpu-memory-limit-gb 8 --steps 3 \
          --warmup-steps 1
      done
      for system in torchao fsdp2_offload zenflow; do
        one "$system" "${T_SMOKE:-90}" $TINY --gpu-cap-gb 8 --warmup-steps 1 --timed-steps 2
      done ;;
    *) echo "unknown part $part (llama8b, llama8b_rest, qwen7b, gpt2, smoke)"; exit 2 ;;
  esac
done
python3 -m examples.bench.peers_summary "$OUT"
