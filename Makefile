# The README's commands. `make train` and `make test` each install what they need first:
# torch alone (a CPU build when this machine has no NVIDIA GPU), then the project and its
# dependencies from pyproject.toml, whose `torch>=...` is then already met, so pip keeps that
# torch instead of resolving the range to the CUDA build (several GB of nvidia-* packages).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

# --- which torch, from where (override any of these: `make train TORCH_INDEX=...`) -----------
# HAS_GPU: yes when nvidia-smi lists a GPU (an NVIDIA driver is loaded and sees one), else no.
HAS_GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo yes || echo no)
HAS_GPU := $(HAS_GPU)
# TORCH_SPEC: the requirement; by default pyproject.toml's own torch line.
TORCH_SPEC ?= $(or $(shell sed -n 's/^[[:space:]]*"\(torch[<>=!~][^"]*\)",*$$/\1/p' pyproject.toml),torch)
# TORCH_INDEX: the index it comes from; empty (TORCH_INDEX=) means pip's configured index
# (PyPI, whose Linux torch is the CUDA build). No GPU: PyTorch's CPU-only index. GPU: its
# CUDA 13.0 index (the build tested here; needs an NVIDIA driver >= 580, else pick cu126/cu128).
ifeq ($(HAS_GPU),yes)
TORCH_INDEX ?= https://download.pytorch.org/whl/cu130
else
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
endif

# Seconds to wait for TORCH_INDEX's answer before going on without it (pip's configured index):
# pip itself would retry each request 5 times, for torch and each of its dependencies.
INDEX_PROBE_S ?= 5

# Hydra overrides for `make train`, e.g. make train ARGS="train.steps=50"
ARGS ?=

.PHONY: torch setup setup-dev setup-gpu train test test-fast lint gpu-suite

# Each install step runs pip only when tools/deps_met.py finds something missing (a package,
# a version pyproject.toml does not allow, this checkout not installed with pip -e): the first
# `make train` shows pip's downloads, a second one prints one line per step and installs
# nothing. FORCE_INSTALL=1 runs pip anyway.
FORCE_INSTALL ?= 0
DEPS_MET = test "$(FORCE_INSTALL)" != 1 && $(PYTHON) tools/deps_met.py

# torch first and alone. pip shows what it downloads (no -q): the CPU build is ~200 MB.
torch:
	@if $(DEPS_MET) "$(TORCH_SPEC)"; then \
	    echo "== torch: $(TORCH_SPEC) already installed"; \
	else \
	    index="$(TORCH_INDEX)"; spec="$(TORCH_SPEC)"; \
	    if [ -n "$$index" ] && ! $(PYTHON) tools/index_reachable.py "$$index" --timeout $(INDEX_PROBE_S); then \
	        index=; \
	        if [ "$(HAS_GPU)" = yes ]; then \
	            echo "== torch: $(TORCH_INDEX) cannot be reached; going on with pip's configured index"; \
	        elif spec=$$(PIP="$(PIP)" $(PYTHON) tools/cpu_torch.py "$(TORCH_SPEC)"); then \
	            echo "== torch: $(TORCH_INDEX) cannot be reached; its CPU build $$spec is in pip's configured sources"; \
	        else \
	            echo "error: TORCH_INDEX=$(TORCH_INDEX) cannot be reached and pip's configured sources" \
	                "offer no CPU build of $(TORCH_SPEC); set TORCH_INDEX to a reachable copy of it, or" \
	                "TORCH_INDEX= for pip's own choice (on Linux the CUDA build: GBs)" >&2; \
	            exit 1; \
	        fi; \
	    fi; \
	    echo "== torch: NVIDIA GPU: $(HAS_GPU); installing $$spec from" \
	        "$${index:-pip's configured sources} (set HAS_GPU, TORCH_SPEC, TORCH_INDEX to change)"; \
	    echo "$(PIP) install \"$$spec\"$${index:+ --index-url $$index}"; \
	    $(PIP) install "$$spec" $${index:+--index-url "$$index"}; \
	fi
	@$(PYTHON) -W ignore -c "import torch; cuda = torch.version.cuda; \
	    print('== torch', torch.__version__, f'(CUDA {cuda})' if cuda else '(CPU build)'); \
	    cuda and '$(HAS_GPU)' == 'no' and print('== note: a CUDA build (GBs of nvidia-* packages)', \
	    'on a machine without a GPU; for the CPU build, start again in a fresh venv')"

setup: torch
	@$(DEPS_MET) --project && echo "== setup: this checkout and its dependencies already installed" \
	    || { echo '$(PIP) install -e .'; $(PIP) install -e .; }

setup-dev: torch
	@$(DEPS_MET) --project --extra dev \
	    && echo "== setup-dev: this checkout and its [dev] dependencies already installed" \
	    || { echo '$(PIP) install -e ".[dev]"'; $(PIP) install -e ".[dev]"; }

# GPU machine: torch with CUDA, then the project with TransformerEngine (the [gpu] extra). TE's
# torch extension is a source distribution that imports the installed torch to build against it
# (its CUDA version picks TE's core library), hence --no-build-isolation, which in turn needs
# the build tools installed first (the [gpu-build] extra). See docs/INSTALL.md.
setup-gpu: torch
	@$(PYTHON) -c "import sys, torch; torch.version.cuda or sys.exit('setup-gpu: torch ' \
	    + torch.__version__ + ' is a CPU build; TransformerEngine needs torch with CUDA')"
	@$(DEPS_MET) --project --extra gpu-build && echo "== setup-gpu: [gpu-build] already installed" \
	    || { echo '$(PIP) install -e ".[gpu-build]"'; $(PIP) install -e ".[gpu-build]"; }
	@$(DEPS_MET) --project --extra gpu && echo "== setup-gpu: [gpu] already installed" \
	    || { echo '$(PIP) install --no-build-isolation -e ".[gpu]"'; \
	         $(PIP) install --no-build-isolation -e ".[gpu]"; }
	@$(PYTHON) -c "import transformer_engine as te, transformer_engine.pytorch; \
	    print('== TransformerEngine', te.__version__)"

# Embedded default: tiny Llama on Python's own source text, CPU or one GPU, ~2 minutes.
train: setup
	$(PYTHON) train.py $(ARGS)

# CPU unit tests + multi-process gloo tests; `gpu` tests skip without CUDA + TE. TEST_JOBS
# test files run at once (pytest-xdist), one per core, at most 4. On 2 cores 3 jobs were
# faster (895 s against 1,028 s) but made timing-bound tests fail (docs/TESTING.md).
# TEST_JOBS=1 runs them one after another.
TEST_JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
test: setup-dev
	$(PYTHON) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-fast: setup-dev
	$(PYTHON) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow and not slurm"

# ruff, then the import layers of docs/ARCHITECTURE.md (import-linter; tools/lint_imports.py).
lint: setup-dev
	ruff check . && ruff format --check . && $(PYTHON) tools/lint_imports.py --no-logo

# On a GPU machine with TE: the gpu-marked tests and the multi-GPU checks, as a table.
gpu-suite:
	bash tests/gpu/suite.sh
