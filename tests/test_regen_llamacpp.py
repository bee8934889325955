"""regen.backend=llamacpp: regen starts the real llama.cpp server (`make llama-server`, built into eaglet's
cache) on the SmolLM2 GGUF, answers multi-turn conversations through it with one conversation per slot, and
stops it however the run ends; `auto` picks it for a GGUF target on CPU and HF generation otherwise."""
from __future__ import annotations

import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipeline.manifest import load_manifest
from pipeline.regen import run as regen_run
from pipeline.target import TargetConfig
from tests.support.llamacpp_regen import _cfg
from tests.support.paths import REPO


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


def test_a_killed_regen_takes_its_server_down(tmp_path, server_binary):
    """kill -9 skips regen's cleanup; the server still goes (the kernel signals it when its parent dies)."""
    script = ("import sys, time\n"
              "from pathlib import Path\n"
              "from tests.support.llamacpp_regen import _cfg\n"
              "from pipeline.regen import run\n"
              "from pipeline.regen.openai_backend import OpenAIBackend\n"
              "OpenAIBackend.complete = lambda self, request: time.sleep(3600)  # a request that never returns\n"
              "run.main(_cfg(Path(sys.argv[1]), 'llamacpp'))\n")
    # the script imports tests.support.llamacpp_regen, from the repository root (cwd)
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    log = tmp_path / "out" / "llamacpp-llamacpp" / "regen" / "llama-server.rank0.log"
    deadline, port = time.monotonic() + 120, None
    while port is None and time.monotonic() < deadline and child.poll() is None:
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text()) if log.exists() else None
        port = int(found.group(1)) if found else time.sleep(0.2)
    assert port is not None and _listening(port), "the server never came up"
    time.sleep(1.0)  # in the middle of the run now: its requests never return
    assert child.poll() is None
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 30
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listening(port), "llama-server outlived the regen that started it"


def test_a_server_that_dies_mid_run_loses_nothing(tmp_path, server_binary, monkeypatch):
    """Requests in flight when our own server dies are not recorded as the conversations' failures: the run
    stops with the server's exit code, saves nothing of that batch, and a rerun regenerates all of it."""
    from pipeline.regen.openai_backend import OpenAIBackend, ServerUnavailable
    from pipeline.regen.shards import RegenDir

    real_complete = OpenAIBackend.complete

    def dies_first(self, request):  # the server dies while a turn is being asked (deterministically: first)
        if self.server.proc.poll() is None:
            self.server.proc.kill()
            self.server.proc.wait()
        return real_complete(self, request)

    monkeypatch.setattr(OpenAIBackend, "complete", dies_first)
    cfg = _cfg(tmp_path, "llamacpp")
    with pytest.raises(ServerUnavailable, match=r"exited with code -9 during the run"):
        regen_run.main(cfg)
    assert not RegenDir(cfg.stage_dir("regen")).shard_done(0)
    monkeypatch.undo()
    assert regen_run.main(cfg)["written"] == 3


def test_auto_falls_back_to_hf_and_explicit_llamacpp_needs_a_gguf(tmp_path, tiny_model_dir):
    tiny = TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None)
    assert regen_run.resolve_backend(_cfg(tmp_path, "auto", tiny)) == "hf"
    assert regen_run.resolve_backend(_cfg(tmp_path, "auto", binary=str(tmp_path / "none"))) == "hf"
    with pytest.raises(ValueError, match="serves a GGUF target"):
        regen_run.main(_cfg(tmp_path, "llamacpp", tiny))
    with pytest.raises(FileNotFoundError, match="make llama-server"):
        regen_run.main(_cfg(tmp_path, "llamacpp", binary=str(tmp_path / "none")))


def _store(tmp_path, backend: str) -> str:
    """An answer store whose answers came from `backend` (its store.json: what auto reads of it)."""
    from pipeline.regen.answer_store import META

    store = tmp_path / f"answers-{backend}"
    store.mkdir()
    (store / META).write_text(json.dumps({"format": 2, "identity": {"generation": {"backend": backend}}}))
    return str(store)


def test_auto_keeps_the_engine_of_its_answer_store(tmp_path, server_binary):
    """A store's answers restore only into a run of their own engine: `auto` takes the store's (HF here, though
    llama-server is built), and refuses in one line where that engine cannot run on this machine."""
    from pipeline.regen.shards import RegenStateError

    cfg = _cfg(tmp_path, "auto")
    assert regen_run.resolve_backend(cfg) == "llamacpp"
    assert regen_run.resolve_backend(dataclasses.replace(
        cfg, regen=dataclasses.replace(cfg.regen, answer_store=_store(tmp_path, "hf")))) == "hf"
    no_server = _cfg(tmp_path, "auto", binary=str(tmp_path / "none"))
    store = _store(tmp_path, "llamacpp")
    with pytest.raises(RegenStateError, match=r"came from the llamacpp backend, which cannot run here \(no "
                                              r"llama-server at .*make llama-server"):
        regen_run.resolve_backend(dataclasses.replace(
            no_server, regen=dataclasses.replace(no_server.regen, answer_store=store)))


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with code 3 at start; see .*llama-server\.rank0\.log"):
        regen_run.main(_cfg(tmp_path, "llamacpp", binary=str(fake)))
    assert "cannot load model" in (tmp_path / "out" / "llamacpp-llamacpp" / "regen" / "llama-server.rank0.log"
                                   ).read_text()
