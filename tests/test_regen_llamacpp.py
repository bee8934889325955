"""regen.backend=llamacpp: regen starts the real llama.cpp server (`make llama-server`, built into eaglet's
cache) on the SmolLM2 GGUF, answers multi-turn conversations through it with one conversation per slot, and
stops it however the run ends; `auto` picks it for a GGUF target on CPU and HF generation otherwise."""
from __future__ import annotations

import json
import os
import socket

import pytest

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.manifest import load_manifest
from pipeline.regen import run as regen_run
from pipeline.regen.config import LlamaCppConfig, RegenConfig
from pipeline.regen.llama_server import binary_path, find_binary
from pipeline.target import TargetConfig

ROWS = [
    {"question_id": "mt", "turns": ["Name a fruit.", "What colour is it?", "And its taste?"]},
    {"id": "cats", "conversations": [{"from": "human", "value": "Why do cats purr?"},
                                     {"from": "gpt", "value": "ORIGINAL"}]},
    {"id": "hi", "messages": [{"role": "user", "content": "Say hi."}]},
]


@pytest.fixture(scope="module")
def server_binary():
    binary = find_binary(LlamaCppConfig(), TargetConfig())
    if binary is None:
        message = f"no llama-server at {binary_path(LlamaCppConfig(), TargetConfig())}: run `make llama-server`"
        if os.environ.get("CI"):
            pytest.fail(message)  # make test builds it; CI must not silently skip
        pytest.skip(message)
    return binary


def _cfg(tmp_path, backend: str, target: TargetConfig = None, **llamacpp) -> EagletConfig:
    source = tmp_path / "convs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return EagletConfig(name=f"llamacpp-{backend}", output_root=str(tmp_path / "out"),
                        target=target or TargetConfig(), data=DataConfig(sources=[str(source)]),
                        regen=RegenConfig(backend=backend, batch_size=3, batches_per_shard=1, max_new_tokens=16,
                                          progress=False, llamacpp=LlamaCppConfig(slots=2, ctx_per_slot=1024,
                                                                                  **llamacpp)))


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_managed_server_regenerates_every_turn_and_stops(tmp_path, server_binary):
    cfg = _cfg(tmp_path, "auto")
    summary = regen_run.main(cfg)
    manifest = load_manifest(cfg.stage_dir("regen"), expect_stage="regen")
    assert manifest["generation"]["backend"] == "llamacpp"  # auto: a GGUF target on CPU, the binary built
    assert summary["written"] == 3 and summary["turns"] == 5 and summary["failed"] == 0
    assert summary["schedule"] == {"conversation": 1}
    command = manifest["generation"]["server"]["command"]
    assert command[:2] == ["-m", str(manifest["target"]["source"])]
    assert not _listening(int(command[command.index("--port") + 1]))  # stopped at the end
    log = (cfg.stage_dir("regen") / "llama-server.rank0.log").read_text()
    assert "slot" in log  # the server's own log is kept beside the shards


def test_auto_falls_back_to_hf_and_explicit_llamacpp_needs_a_gguf(tmp_path, tiny_model_dir):
    tiny = TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None)
    assert regen_run.resolve_backend(_cfg(tmp_path, "auto", tiny)) == "hf"
    assert regen_run.resolve_backend(_cfg(tmp_path, "auto", binary=str(tmp_path / "none"))) == "hf"
    with pytest.raises(ValueError, match="serves a GGUF target"):
        regen_run.main(_cfg(tmp_path, "llamacpp", tiny))
    with pytest.raises(FileNotFoundError, match="make llama-server"):
        regen_run.main(_cfg(tmp_path, "llamacpp", binary=str(tmp_path / "none")))


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with code 3 at start; see .*llama-server\.rank0\.log"):
        regen_run.main(_cfg(tmp_path, "llamacpp", binary=str(fake)))
    assert "cannot load model" in (tmp_path / "out" / "llamacpp-llamacpp" / "regen" / "llama-server.rank0.log"
                                   ).read_text()
