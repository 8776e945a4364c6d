# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench clean gpu-wheels gpu-check

install: $(STAMP)

# each step says what it does and pip shows its downloads: a first install takes about a minute, and a silent one
# looks hung
$(STAMP): pyproject.toml
	@echo "[1/4] virtual environment in $(VENV)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[2/4] pip (latest)"
	@$(BIN)/pip install --quiet --upgrade pip
	@echo "[3/4] torch 2.13.0 (the largest download)"
	@$(BIN)/pip install --progress-bar on 'torch==2.13.0'
	@echo "[4/4] dsflash (editable) and its dependencies"
	@$(BIN)/pip install --progress-bar on -e '.[dev]'
	@touch $(STAMP) && echo "ready: $(BIN)/dsflash"

serve: install
	$(BIN)/dsflash serve $(ARGS)

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

# two workers, one thread each: most tests are single-threaded Python over tiny models, and a second torch thread per
# process only contended with the servers and TP ranks the tests start (tests that need threads set their own).
# Whole files go to a worker in collection order (tests/conftest.py puts the slowest first); xdist's default reorder
# by test count handed the slow one-test files out last, and one worker ran them alone. Bytecode is written even where
# the environment says not to (PYTHONDONTWRITEBYTECODE): else every worker, server and TP rank the suite starts
# compiles dsflash, and pytest rewrites ~340 modules' asserts, from source again (~8 s of each worker's collection)
TEST_WORKERS ?= 2

test: install lint
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

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
