# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench clean gpu-wheels gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet 'torch==2.13.0'
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

serve: install
	$(BIN)/dsflash serve $(ARGS)

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

test: install lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache

# The GPU check (README "GPU check"): `make gpu-wheels` on a networked machine puts the wheels it needs into .whl/,
# then `make gpu-check` on the GPU machine, offline, runs every GPU test and the decode benchmark on its own CUDA
# torch and Triton. Neither depends on `install` (its CPU torch must not land there) nor touches .venv.
GPU_PYTHON ?= python3

gpu-wheels:
	@PYTHON='$(PYTHON)' bash scripts/gpu_check.sh wheels

gpu-check:
	@GPU_PYTHON='$(GPU_PYTHON)' bash scripts/gpu_check.sh check
