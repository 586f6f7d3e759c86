# The README's commands. `make train` and `make test` each install what they need first.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: setup setup-dev train test test-fast lint gpu-suite

setup:
	$(PIP) install -q -e .

setup-dev:
	$(PIP) install -q -e ".[dev]"

# Embedded default: tiny Llama on Python's own source text, CPU or one GPU, ~2 minutes.
train: setup
	$(PYTHON) train.py

# CPU unit tests + multi-process gloo tests; `gpu` tests skip without CUDA + TE.
test: setup-dev
	$(PYTHON) -m pytest -q

test-fast: setup-dev
	$(PYTHON) -m pytest -q -m "not slow"

lint: setup-dev
	ruff check . && ruff format --check .

# On a GPU machine with TE: the gpu-marked tests and the multi-GPU checks, as a table.
gpu-suite:
	bash tests/gpu/suite.sh
