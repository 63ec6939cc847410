#!/usr/bin/env bash
# A change against the tree before it: two exported trees of this repo alternated at the same points in one call on a
# GPU machine (absolute times move between machines of one kind; a ratio holds within one call).
#   examples/bench/tree_ab.sh prepare DIR REV
#       here, with git: REV's code (stronghold, stronghold_ops, examples, setup.py) into DIR, its short commit in
#       DIR/.commit. Carry both trees' folders (and .whl) to the GPU machine.
#   examples/bench/tree_ab.sh run OUT_DIR BASE_DIR HEAD_DIR [POINT...]
#       each point base, head, base, head, ... PAIRS times (default 2), every run through `python -m examples.bench
#       one` from its own tree, no knob but the cap:
#         llama8b  the Llama-3-8B shape under 24 GiB, mb 1, seq 2048, GA 8   (limit per run T_LLAMA8B, 170 s)
#         llama27  Llama 2.70 B under 32 GiB, mb 2, seq 2048, GA 8             (T_LLAMA27, 90 s)
#         qwen7b   the Qwen2.5-7B shape under 24 GiB, mb 1, seq 2048, GA 8   (T_QWEN7B, 170 s)
#         gpt2     GPT-2 1.72 B under 32 GiB, mb 4, seq 1024                   (T_GPT2, 100 s)
#         custom   the flags in $POINT (a tiny model on the CPU: the script's own test; T_CUSTOM, 300 s)
#       (default llama8b). A run starts only where BUDGET_S (560) leaves it its point's limit; a skipped run is said.
# Records: OUT_DIR/bench/tree_ab.jsonl (each tree's commit from DIR/.commit, the pair in `repeat`), the children's logs
# under OUT_DIR/logs; the table last (python3 -m examples.bench.tree_ab_summary OUT_DIR, which with --same-call NAME
# --out FILE also appends the records to FILE, e.g. results/kernels/e2e.jsonl).
set -uo pipefail
cd "$(dirname "$0")/../.."
usage="usage: $0 prepare DIR REV | $0 run OUT_DIR BASE_DIR HEAD_DIR [llama8b] [llama27] [qwen7b] [gpt2] [custom]"
case ${1:-} in
  prepare)
    dir=${2:?$usage}; rev=${3:?$usage}
    commit=$(git rev-parse --short "$rev") || { echo "tree_ab: $rev is not a revision of this repo"; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir" || exit 1
    git archive "$rev" stronghold stronghold_ops examples setup.py | tar -x -C "$dir" || exit 1
    echo "$commit" > "$dir/.commit"
    echo "tree_ab: $rev ($commit) in $dir"
    exit 0 ;;
  run) ;;
  *) echo "$usage"; exit 2 ;;
esac
OUT=${2:?$usage}; BASE=${3:?$usage}; HEAD=${4:?$usage}; shift 4
POINTS=${*:-llama8b}
for tree in "$BASE" "$HEAD"; do
  if [ ! -f "$tree/.commit" ] || [ ! -d "$tree/examples/bench" ]; then
    echo "tree_ab: $tree is not a prepared tree ($0 prepare DIR REV makes one)"; exit 2
  fi
done
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
# The GPU machine's image lacks DeepSpeed: its wheels (shared/tools/device-wheels.sh) are installed where it is missing.
if ! python3 -c "import deepspeed" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed"; exit 1; }
  SITE=/tmp/site
fi
LLAMA8B="--arch llama --hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 --seq 2048
  --batch 1 --accumulation 8 --gpu-cap-gb 24"
LLAMA27="--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000
  --gpu-cap-gb 32"
QWEN7B="--arch qwen2 --hidden 3584 --intermediate 18944 --layers 28 --heads 28 --kv-heads 4 --vocab 152064 --seq 2048
  --batch 1 --accumulation 8 --gpu-cap-gb 24"
GPT2="--hidden 2048 --heads 16 --layers 32 --seq 1024 --batch 4 --gpu-cap-gb 32"
BUDGET_S=${BUDGET_S:-560}

# One run of `point` from `tree`, within the budget: `one` stores the record with the tree's commit. Its child gets the
# limit less 20 s, so that a child that runs out of time is killed and recorded by `one` (whose own start-up, importing
# torch, counts against the outer limit) rather than the whole run by `timeout`, which leaves no record.
run() {
  local tree=$1 point=$2 limit=$3 flags=$4 pair=$5 left commit
  commit=$(cat "$tree/.commit"); left=$((BUDGET_S - SECONDS - 5))
  if [ "$left" -lt "$limit" ]; then
    echo "tree_ab: $point $commit pair $pair skipped: $left s of BUDGET_S left, the point needs $limit"
    return
  fi
  (cd "$tree" && BENCH_COMMIT=$commit STRONGHOLD_COMMIT=$commit PYTHONPATH=${SITE:+$SITE:}$PWD \
    timeout "$limit" python3 -m examples.bench one --results-dir "$OUT/bench" --log-dir "$OUT/logs" --figure tree_ab \
    --system stronghold $flags --no-floor --warmup-steps "${WARMUP_STEPS:-2}" --timed-steps "${TIMED_STEPS:-4}" \
    --repeat "$pair" --point-timeout-s "$((limit - 20))" > "$OUT/logs/$point-$commit-$pair.log" 2>&1)
  echo "tree_ab: $point $commit pair $pair -> rc $?"
}

mkdir -p "$OUT/logs"
for point in $POINTS; do
  case $point in
    llama8b) flags=$LLAMA8B; limit=${T_LLAMA8B:-170} ;;
    llama27) flags=$LLAMA27; limit=${T_LLAMA27:-90} ;;
    qwen7b) flags=$QWEN7B; limit=${T_QWEN7B:-170} ;;
    gpt2) flags=$GPT2; limit=${T_GPT2:-100} ;;
    custom) flags=${POINT:?custom needs the flags in POINT}; limit=${T_CUSTOM:-300} ;;
    *) echo "unknown point $point (llama8b, llama27, qwen7b, gpt2, custom)"; exit 2 ;;
  esac
  for pair in $(seq 1 "${PAIRS:-2}"); do
    run "$BASE" "$point" "$limit" "$flags" "$pair"
    run "$HEAD" "$point" "$limit" "$flags" "$pair"
  done
done
python3 -m examples.bench.tree_ab_summary "$OUT"
