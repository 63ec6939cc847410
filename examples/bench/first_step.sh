#!/usr/bin/env bash
# The first optimizer step against a steady one, as a user's first and later runs see it: the 2.70 B Llama through
# the HF Trainer one line (h2560, 20 heads, 32 layers, vocab 32000, seq 2048, micro-batch 2, accumulation 4, bf16,
# checkpointing, 32 GiB), in one call:
#   cold:  the one line on an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR made fresh here): a first run;
#   warm:  the one line again PAIRS times (default 2), each after a run of BASE_DIR's tree when one is given (an A/B of
#          a change: base, warm, base, warm, ...);
#   plain: plain Trainer (no line, the whole GPU) once, after the cold run: its set-up and first step beside (PLAIN=0
#          leaves it out).
# Usage: examples/bench/first_step.sh OUT_DIR [BASE_DIR]
#   BASE_DIR: the root of another tree, e.g. `git archive REV stronghold stronghold_ops examples setup.py | tar -x -C
#   DIR`; BASE_COMMIT names its commit in the records (else "base"). This tree's commit: STRONGHOLD_COMMIT or git.
#   HEAD_ENV: VAR=value assignments (space-separated) set for this tree's runs only, and named in their records
#   ("head_env"): with BASE_DIR the same tree, an A/B of a setting of torch or the engine, e.g.
#   HEAD_ENV="TORCH_CACHING_PRECOMPILE=1" (torch's experimental cache of Dynamo's output, for the first compile).
# Records: OUT_DIR/first_step.jsonl (each tree's own hf_trainer.py's, with "run", "commit" and "same_call": SAME_CALL,
# default the date), logs beside; the table last (python3 -m examples.bench.first_step_summary OUT_DIR). Each run
# is stopped at RUN_LIMIT_S (default 150 s); on the GPU machine carry .whl (DeepSpeed's wheels), installed into
# /tmp/site first where DeepSpeed is not importable.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:?usage: $0 OUT_DIR [BASE_DIR]}")
BASE=${2:+$(realpath "$2")}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null && ! python3 -c "import deepspeed" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export TORCHINDUCTOR_CACHE_DIR
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/first_step_inductor.XXXXXX)
SAME_CALL=${SAME_CALL:-first-step-$(date -u +%Y-%m-%dT%H:%M)}
HEAD_COMMIT=${STRONGHOLD_COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}
POINT=${POINT:-"--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 4 --vocab 32000
  --steps 7 --warmup-steps 2 --bf16 --gradient-checkpointing"}  # POINT: hf_trainer.py's flags for another point

run() {  # run NAME TREE COMMIT FLAGS...: the tree's own hf_trainer.py, its record labelled and appended
  local name=$1 tree=$2 commit=$3 rc; shift 3
  local assigned=() labels=()
  if [ "$tree" = . ] && [ -n "${HEAD_ENV:-}" ]; then
    read -ra assigned <<< "$HEAD_ENV"
    labels=("head_env=$HEAD_ENV")
  fi
  rm -f "$OUT/$name.jsonl"
  (cd "$tree" && env "${assigned[@]}" timeout "${RUN_LIMIT_S:-150}" python3 examples/hf_trainer.py $POINT "$@" \
    --json "$OUT/$name.jsonl" --output-dir "/tmp/first_step_$name") > "$OUT/$name.log" 2>&1
  rc=$?
  python3 -m examples.bench.first_step_summary --label "$OUT/$name.jsonl" "$OUT/first_step.jsonl" \
    "run=$name" "commit=$commit" "same_call=$SAME_CALL" "${labels[@]}"
  echo "$name ($commit) -> rc $rc"
}

run cold . "$HEAD_COMMIT" --gpu-memory-limit-gb 32
# Plain Trainer second: it neither reads nor fills Inductor's cache, and a call that runs out of time loses a last pair
# rather than the reference. PLAIN=0: no plain Trainer run (an A/B only).
[ "${PLAIN:-1}" = 1 ] && run plain . "$HEAD_COMMIT" --no-stronghold
for i in $(seq "${PAIRS:-2}"); do
  [ -n "$BASE" ] && run "base$i" "$BASE" "${BASE_COMMIT:-base}" --gpu-memory-limit-gb 32
  run "warm$i" . "$HEAD_COMMIT" --gpu-memory-limit-gb 32
done
python3 -m examples.bench.first_step_summary "$OUT"
