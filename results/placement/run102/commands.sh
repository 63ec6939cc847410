python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD BENCH_DIRTY=0 BENCH_COMMIT=f72c68e
one(){ timeout 135 python3 -m examples.bench one --results-dir $OUT/$1 --figure $1 --no-floor --log-dir /tmp/bl --point-timeout-s 130 "${@:2}" 2>&1 | grep -E "^\| (no_off|stron)|Error|error" | tail -3; }
L="--arch llama --hidden 2560 --heads 20 --layers 32 --seq 2048 --batch 2 --accumulation 8 --vocab 32000 --timed-steps 6 --system stronghold --gpu-cap-gb 32"
one t15a $L
one t12a $L --stronghold '{"cpu_optimizer_threads": 12}'
one t15b $L
one t12b $L --stronghold '{"cpu_optimizer_threads": 12}'
