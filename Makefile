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

.PHONY: setup train test test-gpu

setup:
	bash scripts/setup.sh

# The main job: trains the embedded default model on the embedded corpus (GPU if present, else CPU).
train: setup
	$(DEVICE_ENV) deepspeed examples/train.py --deepspeed_config $(TRAIN_CONFIG) $(ARGS)

test: setup
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# GPU-marked tests only (run on the device machine).
test-gpu:
	$(PY) -m pytest -q -m gpu tests $(PYTEST_ARGS)
