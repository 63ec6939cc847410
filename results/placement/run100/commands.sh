python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD BENCH_DIRTY=0 BENCH_COMMIT=197ddb0
one(){ timeout 140 python3 -m examples.bench one --results-dir $OUT/$1 --figure $1 --no-floor --log-dir /tmp/bl --point-timeout-s 135 "${@:2}" 2>&1 | grep -E "^\| (no_off|stron)|Error|error" | tail -3; }
G="--arch gpt2 --hidden 2048 --layers 164 --seq 1024 --batch 4 --system stronghold --gpu-cap-gb 32 --timed-steps 8"
one huge1 $G
STRONGHOLD_BENCH_SMALL_PAGES=1 one small1 $G
one huge2 $G
STRONGHOLD_BENCH_SMALL_PAGES=1 one small2 $G
