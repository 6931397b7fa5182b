# Quick start: `make demo` (the main job) and `make test` (the test suite). Each installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned first: this machine class has a CPU build of 2.13.0 on disk; an unpinned torch pulls CUDA.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps bfcl-eval==2026.3.23
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/agentspec demo

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check agentspec tests benchmarks

bench: install
	$(BIN)/python benchmarks/speedup.py

gpu-check:
	bash benchmarks/gpu_check.sh
