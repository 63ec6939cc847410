# Entry points. `make train` and `make test` each do all set-up first (scripts/setup.sh).
PY ?= python3
HAS_GPU := $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
ifeq ($(HAS_GPU),1)
  TRAIN_CONFIG ?= ds_configs/stronghold.json
  DEVICE_ENV :=
else
  TRAIN_CONFIG ?= ds_configs/stronghold_cpu.json
  DEVICE_ENV := DS_ACCELERATOR=cpu
endif

.PHONY: setup train test test-gpu test-newest

setup:
	bash scripts/setup.sh

# The main job: trains the embedded default model on the embedded corpus (GPU if present, else CPU).
train: setup
	$(DEVICE_ENV) deepspeed examples/train.py --deepspeed_config $(TRAIN_CONFIG) $(ARGS)

# After the main suite, the kernel, HF and engine tests (tests/ops, tests/hf, tests/engine) again on the newest Triton and transformers
# (requirements-newest.txt, in a venv: scripts/test_newest.sh). Runs where there is no GPU, as in CI;
# TEST_NEWEST=0 leaves it out. A GPU machine runs the compiled kernels with its image's Triton instead
# (the device machines have no network to install another).
TEST_NEWEST ?= $(if $(filter 1,$(HAS_GPU)),0,1)

test: setup
	$(PY) -m pytest -q tests $(PYTEST_ARGS)
ifeq ($(TEST_NEWEST),1)
	PYTHON=$(PY) bash scripts/test_newest.sh
endif

test-newest: setup
	PYTHON=$(PY) bash scripts/test_newest.sh $(PYTEST_ARGS)

# GPU-marked tests only (run on the device machine).
test-gpu:
	$(PY) -m pytest -q -m gpu tests $(PYTEST_ARGS)

# Benchmarks (issue 5): one target per figure of the seed's evaluation. Each run stops within its
# time budget (--budget-s, default 500 s) and resumes where it stopped: rerun until it says "complete".
BENCH := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m examples.bench
BENCH_ARGS ?=
.PHONY: fig6a fig6a-uncapped fig7a fig8a fig8b fig9 bench-engine bench-report bench-cpu-adam
fig6a:
	$(BENCH) fig6a $(BENCH_ARGS)
fig6a-uncapped:
	$(BENCH) fig6a --caps none $(BENCH_ARGS)
fig7a fig8a:
	$(BENCH) fig7a $(BENCH_ARGS)
fig8b:
	$(BENCH) fig8b $(BENCH_ARGS)
fig9:
	$(BENCH) fig9 $(BENCH_ARGS)
bench-engine:
	$(BENCH) engine $(BENCH_ARGS)
bench-report:
	$(BENCH) report $(REPORT_ARGS)
# CPU AdamW against DeepSpeedCPUAdam and torch (issue 2).
bench-cpu-adam:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m examples.bench.cpu_adam --out results/engine/cpu_adam.jsonl
