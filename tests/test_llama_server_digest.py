"""The llama-server eaglet builds runs only while its bytes match the sha256 that `make llama-server` recorded
beside it when it built it (issue 38); a binary the user names is the user's choice unless a record lies beside
it. The check precedes every execution, so a small fake executable stands in for the real server."""
from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from pipeline.regen.config import LlamaCppConfig
from pipeline.regen.llama_server import BinaryMismatch, built_path, checked_binary, digest_record
from pipeline.target import TargetConfig


def _fake_binary(path: Path, record: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'version: 1 (fake)'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    if record:  # what `make llama-server` writes beside the binary it builds
        digest = subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout
        digest_record(path).write_text(digest.split()[0] + "\n")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    target = TargetConfig()
    return built_path(target), target


def test_the_built_binary_runs_only_while_it_matches_its_record(cache):
    path, target = cache
    _fake_binary(path)
    assert checked_binary(LlamaCppConfig(), target) == path
    path.write_text(path.read_text() + "echo changed\n")  # its bytes changed since it was built
    with pytest.raises(BinaryMismatch) as e:
        checked_binary(LlamaCppConfig(), target)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and "make llama-server" in message
    assert digest_record(path).read_text().strip() in message  # the expected digest, and the one found
    assert subprocess.run(["sha256sum", str(path)], capture_output=True, text=True).stdout.split()[0] in message


def test_the_built_binary_without_a_record_is_refused(cache):
    path, target = cache
    _fake_binary(path, record=False)
    with pytest.raises(BinaryMismatch, match=r"has no sha256 record .*make llama-server"):
        checked_binary(LlamaCppConfig(), target)
    # Named explicitly, eaglet's own build is held to its record all the same.
    with pytest.raises(BinaryMismatch, match="has no sha256 record"):
        checked_binary(LlamaCppConfig(binary=str(path)), target)


def test_a_binary_the_user_names_is_their_choice_unless_a_record_lies_beside_it(tmp_path, cache):
    _, target = cache
    own = _fake_binary(tmp_path / "mine" / "llama-server", record=False)
    assert checked_binary(LlamaCppConfig(binary=str(own)), target) == own
    recorded = _fake_binary(tmp_path / "kept" / "llama-server")
    recorded.write_bytes(recorded.read_bytes().replace(b"fake", b"evil"))
    with pytest.raises(BinaryMismatch, match="the binary changed since it was built"):
        checked_binary(LlamaCppConfig(binary=str(recorded)), target)


def test_regen_refuses_a_changed_binary_before_executing_it(tmp_path, cache):
    """Through the llamacpp backend: the changed binary (which would leave a mark if it ran) is never started,
    and `auto` passes it over, saying why."""
    from pipeline.config import EagletConfig
    from pipeline.regen import llamacpp_backend
    from pipeline.regen.config import RegenConfig

    path, target = cache
    _fake_binary(path)
    mark = tmp_path / "ran"
    path.write_text(f"#!/bin/sh\ntouch {mark}\necho 'version: 1 (fake)'\n")
    cfg = EagletConfig(output_root=str(tmp_path / "out"), target=target, regen=RegenConfig(backend="llamacpp"))
    with pytest.raises(BinaryMismatch):
        llamacpp_backend.version(cfg)
    with pytest.raises(BinaryMismatch):
        llamacpp_backend.start_server(cfg, None)
    assert "sha256" in (llamacpp_backend.unavailable(cfg) or "")
    assert not mark.exists()
