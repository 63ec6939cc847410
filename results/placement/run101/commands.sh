python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD BENCH_DIRTY=0 BENCH_COMMIT=197ddb0
one(){ timeout 270 python3 -m examples.bench one --results-dir $OUT/$1 --figure $1 --no-floor --log-dir $OUT/logs --point-timeout-s 260 "${@:2}" 2>&1 | tail -4; }
G="--arch gpt2 --hidden 2048 --layers 164 --seq 1024 --batch 4 --system stronghold --gpu-cap-gb 32 --timed-steps 8"
STRONGHOLD_BENCH_SMALL_PAGES=1 one small1 $G
STRONGHOLD_BENCH_SMALL_PAGES=1 one small2 $G
ls -la $OUT/logs | head
