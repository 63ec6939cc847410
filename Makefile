# Entry points: `make train` and `make test` each do all set-up first (scripts/setup.sh: the project's
# virtual environment in .venv, which both use). `make help` lists the targets.
VENV := .venv
PY := $(VENV)/bin/python
# Targets that do no set-up (benchmarks and GPU tests, on machines whose image has the packages): the
# project's venv where there is one, else the system's python3.
HOST_PY := $(if $(wildcard $(PY)),$(PY),python3)
# Recursive (=): evaluated in a recipe, after `setup` has made the venv.
HAS_GPU = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
TRAIN_CONFIG ?= $(if $(filter 1,$(HAS_GPU)),ds_configs/stronghold.json,ds_configs/stronghold_cpu.json)
DEVICE_ENV = $(if $(filter 1,$(HAS_GPU)),,DS_ACCELERATOR=cpu)
# After the main suite, the tests that exercise Triton and transformers again on their newest releases
# (requirements-newest.txt, in a venv over .venv: scripts/test_newest.sh). Runs where there is no GPU, as in CI;
# TEST_NEWEST=0 leaves it out. A GPU machine runs the compiled kernels with its image's Triton instead
# (the device machines have no network to install another).
TEST_NEWEST ?= $(if $(filter 1,$(HAS_GPU)),0,1)
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup train test test-slow test-newest test-gpu

help:  ## list the targets
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-zA-Z0-9_ -]+:[^=]*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup:  ## create .venv and install the pinned requirements (done by train and test; quick when nothing changed)
	@bash scripts/setup.sh

train: setup  ## train the default model on the built-in corpus (GPU if present, else CPU); ARGS="--help" for flags
# One process, no launcher: stronghold.initialize sets up the single-process environment itself (the launcher
# would only add its own log lines). Several GPUs: torchrun or deepspeed, as the README shows.
	$(DEVICE_ENV) $(PY) examples/train.py --deepspeed_config $(TRAIN_CONFIG) $(ARGS)

test: setup  ## the test suite on the CPU, without the slow tests, then the newest-releases pass
	$(PY) -m pytest -m "not slow" --durations=10 tests $(PYTEST_ARGS)
	@if [ "$(TEST_NEWEST)" = 1 ]; then PYTHON=$(PY) bash scripts/test_newest.sh; fi

test-slow: setup  ## the tests marked slow (CI runs them after make test)
	$(PY) -m pytest -m "slow" tests $(PYTEST_ARGS)

test-newest: setup  ## Triton and transformers tests on their newest releases (requirements-newest.txt)
	PYTHON=$(PY) bash scripts/test_newest.sh $(PYTEST_ARGS)

test-gpu:  ## the GPU-marked tests (on a CUDA machine; no set-up)
	$(HOST_PY) -m pytest -q -m gpu tests $(PYTEST_ARGS)

# Benchmarks: one target per figure of the STRONGHOLD paper's evaluation (examples/bench/README.md). Each run
# stops within its time budget (--budget-s, default 500 s) and resumes where it stopped: rerun until it says
# "complete".
BENCH := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(HOST_PY) -m examples.bench
BENCH_ARGS ?=
.PHONY: fig6a fig6a-uncapped fig7a fig8a fig8b fig9 bench-engine bench-report bench-cpu-adam
fig6a:  ## benchmark: largest trainable model per system under a 32 GiB cap
	$(BENCH) fig6a $(BENCH_ARGS)
fig6a-uncapped:  ## benchmark: largest trainable model per system, whole GPU
	$(BENCH) fig6a --caps none $(BENCH_ARGS)
fig7a fig8a:  ## benchmark: throughput per system and model size
	$(BENCH) fig7a $(BENCH_ARGS)
fig8b:  ## benchmark: step time against the number of layers
	$(BENCH) fig8b $(BENCH_ARGS)
fig9:  ## benchmark: throughput against the window size
	$(BENCH) fig9 $(BENCH_ARGS)
bench-engine:  ## benchmark: the engine sweep of examples/bench
	$(BENCH) engine $(BENCH_ARGS)
bench-report:  ## tables, plots and claim verdicts from the benchmark records
	$(BENCH) report $(REPORT_ARGS)
bench-cpu-adam:  ## the CPU AdamW against DeepSpeedCPUAdam and torch
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(HOST_PY) -m examples.bench.cpu_adam --out results/engine/cpu_adam.jsonl
