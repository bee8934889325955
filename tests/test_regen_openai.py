"""regen.backend=openai against a real OpenAI-compatible server: llama.cpp's llama-server (the one `make
llama-server` builds) serving the same SmolLM2 GGUF on 127.0.0.1, started by hand as a user runs their own. A
request the server rejects goes to the error file with its reason and the run goes on; one that times out after
its retries leaves its conversation pending for a rerun."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline.config import EagletConfig
from pipeline.data.bad_records import BadRecordReport
from pipeline.data.config import DataConfig
from pipeline.data.readers import read_sources
from pipeline.manifest import load_manifest
from pipeline.regen import run as regen_run
from pipeline.regen.config import OpenAIBackendConfig, RegenConfig
from pipeline.regen.managed_server import free_port
from pipeline.regen.openai_backend import OpenAIBackend, ServerUnavailable
from pipeline.regen.shards import regen_sources
from pipeline.target import TargetConfig, packaged_gguf
from tests.support.served import ServedModel, start_llama_server

N_CTX = 512


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory, server_binary):
    cfg = TargetConfig()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    server = start_llama_server(server_binary, packaged_gguf(cfg.gguf_package, cfg.gguf_file), log, N_CTX,
                                threads=torch.get_num_threads())
    try:
        yield server
    finally:
        server.stop()


def _cfg(tmp_path, base_url, rows, name, **openai) -> EagletConfig:
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EagletConfig(
        name=name, output_root=str(tmp_path / "out"), target=TargetConfig(),
        data=DataConfig(sources=[str(source)]),
        regen=RegenConfig(backend="openai", batch_size=4, batches_per_shard=1, max_new_tokens=12, progress=False,
                          openai=OpenAIBackendConfig(base_url=base_url, concurrency=2, **openai)))


@pytest.mark.slow
def test_openai_backend_regenerates_and_records_failures(tmp_path, llama_server, smollm2):
    rows = [
        {"id": "cats", "conversations": [{"from": "human", "value": "Why do cats purr?"},
                                         {"from": "gpt", "value": "ORIGINAL"}]},
        {"question_id": "mt", "turns": ["Name a fruit.", "What colour is it?"]},
        {"id": "hi", "messages": [{"role": "user", "content": "Say hi."}]},
        {"id": "too-long", "messages": [{"role": "user", "content": "word " * (2 * N_CTX)}]},
    ]
    cfg = _cfg(tmp_path, llama_server.base_url, rows, "served")
    summary = regen_run.main(cfg)
    out = cfg.stage_dir("regen")
    manifest = load_manifest(out, expect_stage="regen")

    assert summary["written"] == 3 and manifest["counts"]["failures_by_reason"] == {"http_400": 1}, (
        f"{manifest['counts']['failures_by_reason']}; {llama_server.diagnose()}")
    [error_file] = manifest["errors"]
    [error] = [json.loads(line) for line in (out / error_file["path"]).read_text().splitlines()]
    assert error["id"] == "too-long" and error["reason"] == "http_400" and error["attempts"] == 1  # not retried
    assert "context" in error["detail"]

    report = BadRecordReport()
    convs = {c["id"]: c["messages"] for c in read_sources(DataConfig(sources=regen_sources(out)), report)}
    assert report.total == 0 and set(convs) == {"cats", "mt", "hi"}
    assert [m["role"] for m in convs["mt"]] == ["user", "assistant", "user", "assistant"]
    answers = [m["content"] for msgs in convs.values() for m in msgs if m["role"] == "assistant"]
    assert len(answers) == 4 and all(a.strip() for a in answers) and "ORIGINAL" not in answers
    assert 4 <= manifest["counts"]["tokens_generated"] <= 4 * 12
    assert manifest["generation"]["served_model"].endswith(".gguf")
    # The served model's fingerprint: the local target's architecture and tokenizer, weights unknown.
    fp = manifest["target"]
    assert fp["weights_digest"] is None and fp["served"]["base_url"] == llama_server.base_url
    for key in ("config_digest", "tokenizer_digest"):
        assert fp[key] == smollm2.fingerprint[key]

    # At temperature 0 the server is deterministic: a second run answers identically.
    again = _cfg(tmp_path, llama_server.base_url, rows, "served-again")
    regen_run.main(again)
    shard = lambda c: sorted((c.stage_dir("regen") / "shards").glob("*.jsonl"))  # noqa: E731
    assert [p.read_text() for p in shard(cfg)] == [p.read_text() for p in shard(again)]


@pytest.mark.slow
def test_timeouts_are_retried_then_left_pending_for_a_rerun(tmp_path, llama_server):
    """A timeout is transient: retried, then its conversation is pending, not failed (no error file, no
    manifest); a rerun with a timeout the server can meet answers exactly those."""
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Count to {i + 3}."}]} for i in range(2)]
    cfg = _cfg(tmp_path, llama_server.base_url, rows, "timeouts", timeout_s=0.001, max_retries=1, backoff_s=0.01)
    cfg.regen.max_new_tokens = 2
    with pytest.raises(regen_run.RegenPending, match=r"2 conversations of rank 0 are still pending after failed "
                                                     r"requests \(timeout 2"):
        regen_run.main(cfg)
    out = cfg.stage_dir("regen")
    assert not (out / "manifest.json").exists() and not list((out / "errors").glob("*"))
    cfg.regen.openai.timeout_s = 60
    summary = regen_run.main(cfg)
    assert summary["written"] == 2 and summary["failed"] == 0, llama_server.diagnose()


def test_unreachable_server_fails_fast():
    cfg = OpenAIBackendConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=1, backoff_s=0.01)
    with pytest.raises(ServerUnavailable, match="connection_error"):
        OpenAIBackend(cfg, max_new_tokens=4)


def test_server_probe_reports_the_signal_and_log_of_a_dead_server(tmp_path):
    """The fixture's probe, on a server that crashes the way the AMX build did: the failure names the signal
    and quotes the server's own log."""
    log = tmp_path / "server.log"
    crash = "import os, signal; print('loading model', flush=True); os.kill(os.getpid(), signal.SIGILL)"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", crash], stdout=f, stderr=subprocess.STDOUT)
    proc.wait(timeout=30)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)died: killed by SIGILL.*loading model"):
        ServedModel(proc, log, f"http://127.0.0.1:{free_port()}/v1").wait_ready(deadline_s=5)


def test_server_probe_refuses_a_server_that_answers_chat_with_nothing(tmp_path):
    """A server that lists its models but answers every chat request with empty text is not ready."""
    import http.server
    import threading

    class Empty(http.server.BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._send({"data": [{"id": "m.gguf"}]})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send({"choices": [{"message": {"content": ""}}]})

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Empty)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log = tmp_path / "server.log"
    log.write_text("serving\n")
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = ServedModel(idle, log, f"http://127.0.0.1:{httpd.server_port}/v1")
        with pytest.raises(pytest.fail.Exception, match=r"(?s)no text.*is running.*serving"):
            server.wait_ready(deadline_s=5)
    finally:
        httpd.shutdown()
        idle.kill()
        idle.wait()
