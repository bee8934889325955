"""Shared fixtures: the seeded tiny Llama and its tokenizer (tests/support/tiny.py) for unit tests, and the tiny
dump the train tests share (tests/support/tiny_runs.py); the real SmolLM2 target for `slow` integration tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO
from tests.support.tiny import build_tiny_llama, build_tiny_tokenizer

# The suite runs in `-n` pytest-xdist workers (make test: TEST_WORKERS, 2 by default). Each worker takes an equal
# share of the cores for torch, and so do the processes it starts that size themselves from OMP_NUM_THREADS
# (pipeline.run, torchrun ranks); a test that sets its own thread count keeps it (the managed llama-server takes
# the CPUs it may run on, as regen's default). One process alone (plain `pytest`) keeps 2 threads, as it had.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = int(os.environ.get("EAGLET_TEST_THREADS") or (max(1, len(os.sched_getaffinity(0)) // WORKERS)
                                                          if WORKERS > 1 else 2))
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
# `auto` precision resolves to float32 in the suite on every machine (the exactness tests mean the same with
# and without fast bf16); tests of bf16 pick it explicitly. Subprocesses (pipeline.run, torchrun, Slurm
# jobs) inherit it.
os.environ["EAGLET_FAST_BF16"] = "0"

SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def single_thread():
    """Batch-1 decoding is overhead-bound on CPU: a second thread only adds synchronization (and slows a
    neighbouring job). Modules opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A local HF directory (config, safetensors, tokenizer with chat template) of the tiny Llama."""
    path = tmp_path_factory.mktemp("tiny_llama")
    model = build_tiny_llama(len(tiny_tokenizer))
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


# The device of the tiny fp32 model: cpu here; the GPU kit (tools/gpu) runs the lossless tests with cuda.
TEST_DEVICE = os.environ.get("EAGLET_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).to(TEST_DEVICE).eval()


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (cached dequantized SmolLM2-135M-Instruct)."""
    from pipeline.config import TargetConfig
    from pipeline.target import load_target

    return load_target(TargetConfig(dtype="float32"))


@pytest.fixture
def fresh_precision():
    """The capability decision recomputed inside the test (after it sets EAGLET_FAST_BF16) and after it."""
    from pipeline import precision

    precision.fast_bf16.cache_clear()
    yield precision
    precision.fast_bf16.cache_clear()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared datasets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def cli():
    """`cli(args, cwd=..., env=...)`: `python -m pipeline.run *args` in a child of one warm interpreter (a
    CompletedProcess with its exit status, stdout and stderr); for checks of what the command line prints."""
    from tests.support.cli import CliServer

    server = CliServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def dump_root(tmp_path_factory, tiny_model_dir, shared_data) -> Path:
    """The tiny dump (tests/support/tiny_runs.py), one per test module that trains on it."""
    from tests.support.tiny_runs import build_tiny_dump

    return build_tiny_dump(tmp_path_factory.mktemp("train"), tiny_model_dir, shared_data)


@pytest.fixture(scope="session")
def server_binary():
    """llama.cpp's llama-server that `make llama-server` builds into eaglet's cache (make test builds it), checked
    against the sha256 recorded beside it as regen checks it."""
    from pipeline.regen.config import LlamaCppConfig
    from pipeline.regen.llama_server import BinaryMismatch, binary_path, checked_binary, find_binary
    from pipeline.target import TargetConfig

    binary = find_binary(LlamaCppConfig(), TargetConfig())
    if binary is None:
        message = f"no llama-server at {binary_path(LlamaCppConfig(), TargetConfig())}: run `make llama-server`"
        if os.environ.get("CI"):
            pytest.fail(message)  # make test builds it; CI must not silently skip
        pytest.skip(message)
    try:
        return checked_binary(LlamaCppConfig(), TargetConfig())
    except BinaryMismatch as e:
        pytest.fail(str(e))


# ---------------------------------------------------------------------------------------------------------
# Cost tiers (markers, pyproject.toml): `-m "not slow"` is make test-fast's tier. A test that uses the SmolLM2
# fixture is marked `smollm2`, one that uses a llama.cpp server `server`, one on the local Slurm cluster `cluster`;
# tests that reach these otherwise (a subprocess, torchrun ranks) and whole CLI chains (`chain`) and the GPU kit's
# dry run (`kit`) are marked where they are written.
FIXTURE_TIERS = {"smollm2": "smollm2", "server_binary": "server", "llama_server": "server", "cluster": "cluster"}
# The order the costliest modules start in, so that xdist's workers end together (the longest first).
FIRST = ("kit", "cluster", "chain", "server", "smollm2", "slow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, tier in FIXTURE_TIERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(tier)

    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(module: str) -> int:
        tiers = {m.name for i in by_module[module] for m in i.iter_markers()}
        return min((FIRST.index(t) for t in tiers if t in FIRST), default=len(FIRST))

    items[:] = [i for module in sorted(by_module, key=rank) for i in by_module[module]]  # stable within a rank
