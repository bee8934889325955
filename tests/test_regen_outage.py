"""Regen never loses a conversation to a server outage, and drives many servers: real llama.cpp servers
(`make llama-server`) on the SmolLM2 GGUF, killed with SIGKILL mid-run and started again on the same port.

- A server that dies and comes back within the retries: the run finishes as if nothing happened.
- An outage longer than the retries: the run stops with one line once too many conversations failed, keeps
  everything it finished, and a rerun asks exactly the conversations that were pending.
- Two servers, one killed for good: its in-flight requests go to the other, and nothing is lost.
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.regen import run as regen_run
from pipeline.regen.config import OpenAIBackendConfig, RegenConfig
from pipeline.regen.llama_server import free_port
from pipeline.regen.openai_backend import OpenAIBackend, ServerPool, base_urls
from pipeline.regen.run import RegenPending
from pipeline.regen.shards import RegenDir
from pipeline.regen.stream import FailureWindow, RegenFailing
from pipeline.target import TargetConfig, packaged_gguf

ROWS = [{"id": f"c{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate([
    "Name three fruits.", "Why is the sky blue?", "Write a haiku about rain.", "What is 12 times 7?",
    "Give a tip for sleeping well.", "Describe a cat in one sentence."])] + [
    {"id": "mt", "turns": ["Name a colour.", "Why do you like it?", "Name another."]}]



class Server:
    """A real llama-server on a fixed port, which the test kills and starts again."""

    def __init__(self, binary: Path, log: Path, port: int = 0):
        self.binary, self.log, self.port = binary, log, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = None

    def start(self) -> "Server":
        gguf = packaged_gguf(TargetConfig().gguf_package, TargetConfig().gguf_file)
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen([str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                                          str(self.port), "-np", "2", "-c", "2048", "-t", "1", "-tb", "1",
                                          "--no-webui"], stdout=f, stderr=subprocess.STDOUT)
        import urllib.request

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"llama-server did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def _cfg(tmp_path: Path, name: str, urls, **regen) -> EagletConfig:
    source = tmp_path / "convs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    openai = dict(concurrency=2, max_retries=6, backoff_s=0.5, timeout_s=60)
    openai.update(regen.pop("openai", {}))
    return EagletConfig(name=name, output_root=str(tmp_path / "out"), target=TargetConfig(device="cpu"),
                        data=DataConfig(sources=[str(source)]),
                        regen=RegenConfig(backend="openai", batch_size=4, batches_per_shard=1, max_new_tokens=16,
                                          progress=False, openai=OpenAIBackendConfig(base_url=urls, **openai),
                                          **regen))


def _records(cfg: EagletConfig) -> dict[str, list]:
    out = RegenDir(cfg.stage_dir("regen"))
    records = {}
    for path in sorted(out.shards.glob("shard-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["id"]] = record["conversations"]
    return records


def _finished(cfg: EagletConfig) -> set[str]:
    """Conversations a run kept: in saved shards, saved batches or batch journals."""
    out = RegenDir(cfg.stage_dir("regen"))
    done = set(_records(cfg))
    for path in (out.state / "batches").glob("*.json"):
        done |= {r["id"] for r in json.loads(path.read_text())["records"]}
    for path in (out.state / "journal").glob("*.jsonl"):
        done |= {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}
    return done


def _when_journaled(cfg: EagletConfig, action, n: int = 1) -> threading.Thread:
    """Runs `action` once `n` conversations were answered (journaled) in the run being made."""
    def watch():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(_finished(cfg)) < n:
            time.sleep(0.02)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def reference(server_binary, tmp_path_factory):
    """The records of an uninterrupted run on one server."""
    tmp = tmp_path_factory.mktemp("reference")
    server = Server(server_binary, tmp / "server.log").start()
    try:
        cfg = _cfg(tmp, "reference", server.url)
        assert regen_run.main(cfg)["written"] == len(ROWS)
        return _records(cfg)
    finally:
        server.kill()


@pytest.mark.slow
def test_a_server_killed_mid_run_and_started_again_loses_nothing(tmp_path, server_binary, reference, caplog):
    server = Server(server_binary, tmp_path / "server.log").start()
    cfg = _cfg(tmp_path, "restart", server.url)

    def outage():
        server.kill()
        time.sleep(2.0)  # requests in flight and new ones fail meanwhile, and are retried
        server.start()

    watcher = _when_journaled(cfg, outage, n=2)
    try:
        with caplog.at_level(logging.DEBUG, logger="pipeline.regen.openai_backend"):
            summary = regen_run.main(cfg)
        watcher.join(timeout=60)
    finally:
        server.kill()
    assert any("connection_error" in r.getMessage() for r in caplog.records), "the outage was never seen"
    assert summary["written"] == len(ROWS) and summary["failed"] == 0
    assert _records(cfg) == reference


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["window", "pending"])
def test_an_outage_stops_the_run_and_a_rerun_asks_exactly_the_pending_conversations(tmp_path, server_binary, reference,
                                                                                     monkeypatch, stop):
    """window: the run stops once 2 of the last 4 conversations failed. pending: the window never trips, the
    run asks every conversation and ends with the failed ones pending. Either way nothing is marked done
    that was not answered, and a rerun once the server is back asks exactly what was not."""
    server = Server(server_binary, tmp_path / "server.log").start()
    window = dict(max_failure_rate=0.25, failure_window=4) if stop == "window" else dict(max_failure_rate=1.0)
    # 2 retries with a 0.2 s backoff ride out no real outage.
    cfg = _cfg(tmp_path, f"outage-{stop}", server.url, openai=dict(max_retries=2, backoff_s=0.2), **window)
    watcher = _when_journaled(cfg, server.kill, n=3)
    expected = (RegenFailing, r"of the last 4 conversations failed .*connection_error.*rerun") if stop == "window" \
        else (RegenPending, r"conversations of rank 0 are still pending .*connection_error.*rerun the same command")
    with pytest.raises(expected[0], match=expected[1]):
        regen_run.main(cfg)
    watcher.join(timeout=60)
    kept = _finished(cfg)
    assert 3 <= len(kept) < len(ROWS)
    assert not (cfg.stage_dir("regen") / "manifest.json").exists()
    assert not list(RegenDir(cfg.stage_dir("regen")).errors.glob("*"))  # pending is not failed for good

    asked = []
    real_complete = OpenAIBackend.complete

    def counting(self, request):
        if sum(m["role"] == "user" for m in request.messages) == 1:
            asked.append(request.messages[-1]["content"])
        return real_complete(self, request)

    monkeypatch.setattr(OpenAIBackend, "complete", counting)
    server.start()
    try:
        summary = regen_run.main(cfg)
    finally:
        server.kill()
    first = {r["id"]: r["messages"][0]["content"] if "messages" in r else r["turns"][0] for r in ROWS}
    assert sorted(asked) == sorted(first[i] for i in first if i not in kept)
    assert summary["written"] == len(ROWS) and _records(cfg) == reference


@pytest.mark.slow
def test_two_servers_share_the_work_and_a_dead_ones_requests_go_to_the_other(tmp_path, server_binary, reference,
                                                                              monkeypatch):
    a = Server(server_binary, tmp_path / "a.log").start()
    b = Server(server_binary, tmp_path / "b.log").start()
    cfg = _cfg(tmp_path, "two", [a.url, b.url])
    answered = {}
    real_close = OpenAIBackend.close

    def close(self):  # what each server answered, from the backend's own pool
        answered.update({s.url: s.answered for s in self.pool_of_servers.servers})
        real_close(self)

    monkeypatch.setattr(OpenAIBackend, "close", close)
    live = {}  # answers per server as they come, so that `a` dies only once it answered one
    real_release = ServerPool.release

    def release(self, server, error=None, attempt=1):
        real_release(self, server, error, attempt)
        live[server.url] = server.answered

    monkeypatch.setattr(ServerPool, "release", release)

    def kill_a_once_it_answered():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and live.get(a.url, 0) < 1:
            time.sleep(0.02)
        a.kill()

    watcher = threading.Thread(target=kill_a_once_it_answered, daemon=True)
    watcher.start()
    try:
        summary = regen_run.main(cfg)
        watcher.join(timeout=60)
    finally:
        a.kill()
        b.kill()
    assert a.proc.returncode == -signal.SIGKILL  # killed mid-run, never restarted
    assert answered[a.url] >= 1 and answered[b.url] > answered[a.url], answered
    assert summary["written"] == len(ROWS) and summary["failed"] == 0
    assert _records(cfg) == reference


def test_the_failure_window_and_server_lists():
    window = FailureWindow(max_rate=0.05, size=200)
    for _ in range(10):
        window.add({"reason": "connection_error", "detail": "refused"})
        window.check()  # 10 of 200 is not more than 5%
    window.add({"reason": "connection_error", "detail": "refused"})
    with pytest.raises(RegenFailing, match=r"11 of the last 11 conversations failed"):
        window.check()
    for _ in range(200):
        window.add(None)
    window.check()  # the failures left the window
    assert base_urls("http://a/v1/, http://b/v1") == ["http://a/v1", "http://b/v1"]
    assert base_urls(["http://a/v1"]) == ["http://a/v1"]
    with pytest.raises(ValueError, match="twice"):
        base_urls(["http://a/v1", "http://a/v1/"])
