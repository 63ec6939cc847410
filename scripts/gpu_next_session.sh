#!/usr/bin/env bash
# The next GPU session's measurements, in order, each stage with its own time limit and surviving the
# failure of the one before:
#   tests    pytest -m gpu tests/engine tests/hf                                   (~2 min)
#   train    examples/train.py, ds_configs/stronghold.json, 30 steps -> train_gpu.jsonl (~2 min)
#   kernels  issue 10's end-to-end kernel A/B, 16 layers -> bench/kernels.jsonl, kernels/e2e_ab.md (~8 min)
#   defaults issue 10's check of the default kernel sets: none, default, all, twice each, per family -> defaults/kernels.jsonl,
#            kernels/e2e_defaults.md (~7 min)
#   seqlen   issue 13's longest sequence, 3 variants + the timed pair -> bench/seqlen.jsonl (~10 min a command)
#   longseq  issue 13 with no knobs: offload_activations "auto" decides from the batch (long_context.py), MLPs
#            chunked: Llama 2.7 B under 32 GiB at seq 131072, 196608, 262144 -> bench/seqlen.jsonl (~9 min)
#   largest32  issue 9: stronghold's largest GPT-2 (h2048, seq 1024, mb 4) with no knobs under the 32 GiB cap, by
#            search from 200 layers (10.2 B) -> bench/fig6a.jsonl (again while it prints "incomplete"; ~9 min)
#   largest  issue 9: the same on the whole GPU (no cap), from 300 layers (15.2 B); run it on nvidia-h200
#   profile  issue 9's Llama gap: Llama 2.70 B GA 8, plain DeepSpeed uncapped and stronghold under 32 GiB, one
#            profiled step each after the timed ones (run_one --profile: GPU busy per stream, top kernels, the engine's
#            host ranges; the report's overlap.host_hook_s_per_step unprofiled) -> bench/profile.jsonl (~4 min)
#   variants issue 9's Llama GA 8: plain, then stronghold with STRONGHOLD_BENCH_CPU_VARIANTS=${VARIANTS:-default,skip}
#            over 20 timed steps (examples/bench/cpu_variants.py: variants alternated inside one run) -> bench/variants.jsonl
#            (~4 min)
#   llama3   issue 9's Llama GA 8 ratio, the plain/stronghold pair three times back to back (placement_acceptance.sh
#            llama, LLAMA_REPEAT=3, 5 timed steps; each pair's own file; per_step in every record) (~6 min)
#   dp       issue 11's acceptance, NEEDS nvidia-h200-x2: GPT-2 5.14 B, 32 GiB cap, stronghold on 1 and 2 GPUs and
#            ZeRO-Offload on 2, node memory sampled -> bench/data_parallel.jsonl (~9 min; refused below 2 GPUs)
#   dp-largest  issue 11: stronghold's largest layer count on 2 GPUs, by search, resumed from
#            bench/data_parallel.jsonl (one or two probes a command; again while it prints "incomplete")
#   scale    issue 14, NEEDS nvidia-h200-x8 (or -x4): stronghold on 1, 2, 4 and 8 GPUs (those visible) at 5.14 B, 32 GiB
#            cap per GPU -> bench/data_parallel.jsonl, scaling.json, scaling.png (examples.bench.scaling)
#   scale-zo issue 14: ZeRO-Offload on the same GPU counts, same files. Both skip what this commit measured already
#            (--resume), so copy bench/data_parallel.jsonl back to results/bench/ between calls and run each again
#            until every configuration has its line (~1-2.5 min a configuration)
# Usage (repo root, OUT set; the device tool's $OUT): scripts/gpu_next_session.sh [STAGE...] (default: all)
# The device tool allows 600 s a command, so run it as: `tests train`, then `kernels`, then `seqlen`
# (again while it prints "incomplete": a sweep resumes from the records in results/bench/ copied back).
# `dp` and `dp-largest` need 2 GPUs: run them as their own commands on kind nvidia-h200-x2; `scale`, `scale-zo` on -x8.
# Everything lands under $OUT, at most 8 files: session.log (every stage's output), gpu_tests.xml,
# train_gpu.jsonl, bench/kernels.jsonl, bench/seqlen.jsonl, bench/fig6a.jsonl, kernels/e2e_ab.md, bench/data_parallel.jsonl
# (bench/profile.jsonl in place of one of them: call that stage on its own or with `tests`; `llama3` writes summary.json and
# bench/placement{,_r2,_r3}.jsonl: call it on its own or with `tests`).
# Name the commit measured (the copied tree has no .git): BENCH_COMMIT=<sha> [BENCH_DIRTY=0].
cd "$(dirname "$0")/.." || exit 1
if compgen -G ".whl/*.whl" > /dev/null; then  # DeepSpeed's wheels, carried: no network on the GPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  echo "no .whl/*.whl: using the DeepSpeed installed here"; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT/bench" "$OUT/kernels"
exec > >(tee -a "$OUT/session.log") 2>&1
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}  # empty: the harness hashes the code
# examples/train.py's record too: the device copy's .git (if any) is the session's starting checkout, not the code.
export STRONGHOLD_COMMIT=${STRONGHOLD_COMMIT:-$BENCH_COMMIT}
STAGES=${*:-tests train kernels seqlen}
# Stage limits in seconds (each under the device tool's 600 s a command, wheel install included).
TESTS_S=${TESTS_S:-240}; TRAIN_S=${TRAIN_S:-240}; KERNELS_BUDGET_S=${KERNELS_BUDGET_S:-470}; SEQLEN_BUDGET_S=${SEQLEN_BUDGET_S:-500}
DP_BUDGET_S=${DP_BUDGET_S:-500}
# 2-GPU stages: the rank processes' logs stay on the machine; the JSON lines carry each failure's stderr tail.
DP=(--out "$OUT/bench/data_parallel.jsonl" --log-dir /tmp/bench-logs/dp --budget-s "$DP_BUDGET_S")
gpus() { python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }
LLAMA_SEQ=(--arch llama --hidden 2560 --heads 20 --layers 32 --batch 1 --vocab 32000 --caps 32)
LLAMA_POINT="--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000"
# Each point at most 240 s (a longer one is recorded as a timeout, a capacity failure to the search);
# no floor-term probes: these sweeps compare step times only.
SWEEP=(--results-dir "$OUT/bench" --log-dir /tmp/bench-logs --point-timeout-s 240 --min-start-s 60 --no-floor)

stage() { echo "[session] $(date -u +%FT%TZ) stage $1: start"; }
done_() { echo "[session] $(date -u +%FT%TZ) stage $1: exit $2 after $SECONDS s of this command"; }
# Several GPUs: $1 the stage, $2 what it needs. Fewer than 2 visible: a note and false; else the records so far copied.
multi_gpu() {
  local n; n=$(gpus)
  if [ "$n" -lt 2 ]; then echo "[session] stage $1 needs $2; $n visible: not run"; return 1; fi
  resume data_parallel
}
resume() { [ -f "results/bench/$1.jsonl" ] && [ ! -f "$OUT/bench/$1.jsonl" ] && cp "results/bench/$1.jsonl" "$OUT/bench/"; true; }

for s in $STAGES; do
  stage "$s"
  case $s in
    tests) timeout "$TESTS_S" python3 -m pytest -m gpu tests/engine tests/hf -q -rfE -p no:cacheprovider \
             --junitxml "$OUT/gpu_tests.xml" ;;
    train) timeout "$TRAIN_S" python3 examples/train.py --deepspeed_config ds_configs/stronghold.json --steps 30 \
             --json "$OUT/train_gpu.jsonl" ;;
    kernels) resume kernels
             timeout $((KERNELS_BUDGET_S + 90)) python3 -m examples.bench kernels --layers 16 --warmup-steps 2 \
               --timed-steps 5 --budget-s "$KERNELS_BUDGET_S" "${SWEEP[@]}"
             rc=$?; python3 -m examples.bench kernels-report --results-dir "$OUT/bench" --out "$OUT/kernels/e2e_ab.md"
             (exit $rc) ;;
    defaults) mkdir -p "$OUT/defaults"
              timeout $((KERNELS_BUDGET_S + 90)) python3 -m examples.bench kernels --kernel-sets defaults --layers 16 \
                --warmup-steps 2 --timed-steps 8 --budget-s "$KERNELS_BUDGET_S" "${SWEEP[@]}" --results-dir "$OUT/defaults"
              rc=$?; python3 -m examples.bench kernels-report --results-dir "$OUT/defaults" --out "$OUT/kernels/e2e_defaults.md"
              (exit $rc) ;;
    seqlen) resume seqlen
            timeout $((SEQLEN_BUDGET_S + 60)) python3 -m examples.bench seqlen "${LLAMA_SEQ[@]}" --start-seq 16384 \
              --step-seq 4096 --max-seq 262144 --warmup-steps 1 --timed-steps 3 --budget-s "$SEQLEN_BUDGET_S" "${SWEEP[@]}" ;;
    longseq) resume seqlen
             for seq in 131072 196608 262144; do
               timeout 280 python3 -m examples.bench one --figure seqlen --system stronghold "${LLAMA_SEQ[@]/--caps/--gpu-cap-gb}" \
                 --seq "$seq" --warmup-steps 1 --timed-steps 1 "${SWEEP[@]}" --point-timeout-s 270 || break
             done ;;
    largest32|largest)
        resume fig6a
        if [ "$s" = largest32 ]; then cap=(--caps 32 --start stronghold=200); else cap=(--caps none --start stronghold=300); fi
        timeout $((SEQLEN_BUDGET_S + 60)) python3 -m examples.bench fig6a --systems stronghold "${cap[@]}" --step-layers 4 \
          --growth 1.1 --max-layers 480 --budget-s "$SEQLEN_BUDGET_S" "${SWEEP[@]}" ;;
    profile)
        for args in "--system no_offload --gpu-cap-gb none" "--system stronghold --gpu-cap-gb 32"; do
          timeout 220 python3 -m examples.bench one --figure profile $args --arch llama --hidden 2560 --heads 20 \
            --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000 --profile --results-dir "$OUT/bench" \
            --log-dir /tmp/bench-logs --no-floor --point-timeout-s 200
        done ;;
    variants)
        timeout 150 python3 -m examples.bench one --figure variants --system no_offload --gpu-cap-gb none $LLAMA_POINT \
          --timed-steps 6 --results-dir "$OUT/bench" --log-dir /tmp/bench-logs --no-floor --point-timeout-s 140
        STRONGHOLD_BENCH_CPU_VARIANTS=${VARIANTS:-default,skip} timeout 250 python3 -m examples.bench one \
          --figure variants --system stronghold --gpu-cap-gb 32 $LLAMA_POINT --timed-steps 20 --results-dir "$OUT/bench" \
          --log-dir /tmp/bench-logs --no-floor --point-timeout-s 240 ;;
    llama3)
        LOG_DIR=/tmp/placement-logs LLAMA_REPEAT=3 LLAMA_STEPS=5 LLAMA_AB= BENCH_TIMEOUT=140 timeout 560 \
          bash scripts/placement_acceptance.sh "$OUT" llama ;;
    dp|dp-largest)
        if ! multi_gpu "$s" "2 GPUs (device kind nvidia-h200-x2)"; then
          false
        else
          # GPT-2 h2048, 16 heads, seq 1024, micro-batch 4, bf16, checkpointing, 100 layers, 32 GiB cap: the defaults.
          if [ "$s" = dp ]; then
            # 8 timed steps after 2 warm-up ones, every system: the first steps after the placement defer every update
            # (no forecast of the norm yet, speculation.py), and 3 timed steps (run34_dp) were mostly those.
            timeout $((DP_BUDGET_S + 60)) python3 -m examples.bench_data_parallel "${DP[@]}" \
              --configs stronghold:1,stronghold:2,zero_offload:2 --config-timeout-s 300 --warmup-steps 2 --timed-steps 8
          else
            timeout $((DP_BUDGET_S + 60)) python3 -m examples.bench_data_parallel "${DP[@]}" --largest --probe-timeout-s 400
          fi
        fi ;;
    scale|scale-zo)
        if ! multi_gpu "$s" "several GPUs (device kind nvidia-h200-x8 or -x4)"; then
          false
        else
          n=$(gpus)
          system=stronghold; [ "$s" = scale-zo ] && system=zero_offload
          configs=$(for w in 1 2 4 8; do [ "$w" -le "$n" ] && printf '%s:%s,' "$system" "$w"; done)
          timeout $((DP_BUDGET_S + 60)) python3 -m examples.bench_data_parallel "${DP[@]}" --configs "${configs%,}" \
            --resume --config-timeout-s 300 --warmup-steps 2 --timed-steps 8
          rc=$?
          python3 -m examples.bench.scaling "$OUT/bench/data_parallel.jsonl" --json "$OUT/scaling.json" --plot "$OUT/scaling.png"
          (exit $rc)
        fi ;;
    *) echo "unknown stage $s (tests, train, kernels, defaults, seqlen, longseq, largest32, largest, profile, variants, llama3, dp, dp-largest, scale, scale-zo)"; false ;;
  esac
  done_ "$s" $?
done
