"""Secrets never persist (issue 38): a base URL's password and key, a secret-named option or override, are
redacted (pipeline/redact.py) from every file eaglet writes: the lock file's command line, every manifest,
Hydra's run log (Hydra keeps no copy of the config), W&B's config and metadata, log lines and error records."""
from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from pipeline.lock import OutputLock
from pipeline.manifest import load_manifest, write_manifest
from pipeline.redact import MASK, RedactingFilter, redact, redact_argv, redact_text, redact_url, secret_name
from tests.support.paths import REPO

SECRETS = ("SECRET1", "SECRET2", "SECRET3", "SECRET4", "SECRET5", "SECRET6", "SECRET7")
BASIC = base64.b64encode(b"alice:SECRET1").decode()


def files_holding(root: Path, secrets=SECRETS) -> dict[str, list[str]]:
    """Every file under `root` that holds one of `secrets`, with the ones it holds."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if held := [s for s in secrets if s.encode() in data]:
                found[str(path.relative_to(root))] = held
    return found


# --- the redaction ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url,want", [
    ("http://alice:s3cr3t@host:8000/v1", f"http://alice:{MASK}@host:8000/v1"),
    ("https://host/v1?api_key=K&model=m&key=K2", f"https://host/v1?api_key={MASK}&model=m&key={MASK}"),
    ("https://b/o?X-Amz-Signature=S&X-Amz-Credential=C&X-Amz-Security-Token=T&v=1",
     f"https://b/o?X-Amz-Signature={MASK}&X-Amz-Credential={MASK}&X-Amz-Security-Token={MASK}&v=1"),
    ("http://h/cb#access_token=T&state=s", f"http://h/cb#access_token={MASK}&state=s"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
])
def test_urls_lose_passwords_and_secret_parameters_only(url, want):
    assert redact_url(url) == want


@pytest.mark.parametrize("name", ["api_key", "regen.openai.api_key", "--api-key", "token", "hf_token", "access_token",
                                  "password", "db_password", "client_secret", "wandb.token", "apiKey", "private_key",
                                  "authorization"])
def test_secret_names(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", ["api_key_env", "max_new_tokens", "token_loss_weight", "eos_token", "key",
                                  "plan.key", "tokens_key", "num_key_value_heads", "tokenizer", "base_url"])
def test_names_that_are_not_secrets_keep_their_values(name):
    assert not secret_name(name)


def test_command_lines_lose_secret_option_values_and_url_secrets():
    argv = ["pipeline.run", "--api-key", "A", "--api-key=B", "regen.openai.api_key=C", "+x.hf_token=D",
            "regen.openai.base_url='http://u:E@h/v1?api_key=F'", "--hf-token", "G", "regen.max_new_tokens=8",
            "regen.openai.api_key_env=MY_KEY"]
    assert redact_argv(argv) == [
        "pipeline.run", "--api-key", MASK, f"--api-key={MASK}", f"regen.openai.api_key={MASK}", f"+x.hf_token={MASK}",
        f"regen.openai.base_url='http://u:{MASK}@h/v1?api_key={MASK}'", "--hf-token", MASK, "regen.max_new_tokens=8",
        "regen.openai.api_key_env=MY_KEY"]


def test_text_and_records():
    assert redact_text("GET http://u:pw@h/x?token=t failed; Authorization: Bearer sk-abcdefgh1234, "
                       "password: hunter2") == (f"GET http://u:{MASK}@h/x?token={MASK} failed; Authorization: Bearer "
                                                f"{MASK}, password: {MASK}")
    record = {"plan": {"key": "digest"}, "api_key": "x", "max_new_tokens": 8, "eos_token": "</s>",
              "served": {"base_url": ["http://a:pw@h1/v1?api_key=k", "http://h2/v1?key=k"]},
              "command": ["--api-key", "s"]}
    assert redact(record) == {"plan": {"key": "digest"}, "api_key": MASK, "max_new_tokens": 8, "eos_token": "</s>",
                              "served": {"base_url": [f"http://a:{MASK}@h1/v1?api_key={MASK}", f"http://h2/v1?key={MASK}"]},
                              "command": ["--api-key", MASK]}


@pytest.mark.parametrize("text,want", [
    # what a server or proxy that echoes the request puts in an error body: JSON or a Python dict
    ('{"authorization": "Basic YWxpY2U6U0VDUkVUMQ==", "x": 1}', f'{{"authorization": "{MASK}", "x": 1}}'),
    ("{'api_key': 'sk-abc123', 'model': 'm'}", f"{{'api_key': '{MASK}', 'model': 'm'}}"),
    ('curl -H "X: Basic YWxpY2U6U0VDUkVUMQ=="', f'curl -H "X: Basic {MASK}"'),
    ("Basic arithmetic, digest of the plan, time 12:30, ratio: 0.5", None),  # no credential: unchanged
    ('{"eos_token": "</s>", "max_new_tokens": 8}', None),
])
def test_quoted_keys_and_basic_credentials_in_text(text, want):
    assert redact_text(text) == (text if want is None else want)


def test_a_secret_read_as_a_number_is_masked_too():
    assert redact({"password": 123456, "api_key": 0.5, "token": True, "secret": None, "hf_token": ""}) == \
        {"password": MASK, "api_key": MASK, "token": True, "secret": None, "hf_token": ""}


def test_a_log_handler_with_the_filter_writes_no_secret(tmp_path):
    handler = logging.FileHandler(tmp_path / "run.log")
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test_secrets.filter")
    logger.addHandler(handler)
    try:
        logger.warning("server %s does not answer", "http://u:SECRET1@h/v1?api_key=SECRET2")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert files_holding(tmp_path) == {} and "http://u:***@h/v1?api_key=***" in (tmp_path / "run.log").read_text()


# --- the files eaglet writes -------------------------------------------------------------------------------------

def test_the_lock_file_and_a_manifest_hold_no_secret(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pipeline.run", "--api-key", "SECRET1", "regen.openai.api_key=SECRET2",
                                      "regen.openai.base_url=http://u:SECRET3@h/v1?access_token=SECRET4"])
    with OutputLock(tmp_path / "stage", "regen"):
        holder = json.loads(next((tmp_path / "stage").glob(".eaglet-lock.*")).read_text())
    assert holder["command"] == (f"pipeline.run --api-key {MASK} regen.openai.api_key={MASK} "
                                 f"regen.openai.base_url=http://u:{MASK}@h/v1?access_token={MASK}")
    write_manifest(tmp_path / "stage", "custom", {"openai": {"base_url": "http://u:SECRET5@h/v1", "token": "SECRET6"}},
                   counts={}, timings={}, generation={"server": {"command": ["srv", "--api-key", "SECRET7"]}})
    assert files_holding(tmp_path) == {}
    doc = load_manifest(tmp_path / "stage")
    assert doc["config"]["openai"] == {"base_url": f"http://u:{MASK}@h/v1", "token": MASK}


def test_wandb_keeps_no_secret_in_its_config_or_metadata(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from pipeline.tracking import start_wandb_run

    monkeypatch.setattr(sys, "argv", ["pipeline.run", "regen.openai.base_url=http://u:SECRET1@h/v1?api_key=SECRET2",
                                      "--api-key", "SECRET3"])
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = types.SimpleNamespace(mode="offline", dir=None, project="eaglet-test", entity=None)
    run = start_wandb_run(cfg, tmp_path, {"openai": {"base_url": "http://u:SECRET4@h", "api_key": "SECRET5"}},
                          "r", "train")
    run.log({"loss": 1.0})
    run.finish()
    assert sys.argv[1].endswith("api_key=SECRET2")  # the process's own argv is left as it was
    assert files_holding(tmp_path) == {}


class FakeOpenAIServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server that asks for the base URL's credentials (HTTP Basic alice:SECRET1 and
    ?api_key=SECRET2) and rejects a prompt holding REJECT with an error that echoes the request's path."""

    def _send(self, code: int, body) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") != f"Basic {BASIC}" or not self.path.endswith("?api_key=SECRET2"):
            self._send(401, {"error": "unauthorized"})
            return False
        return True

    def do_GET(self):  # noqa: N802
        if self._authorized():
            self._send(200, {"data": [{"id": "fake"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorized():
            return
        prompt = body["messages"][-1]["content"]
        if "REJECT" in prompt:
            self._send(400, f"bad request to {self.path} with Authorization: {self.headers['Authorization']}")
            return
        self._send(200, {"choices": [{"message": {"content": f"An answer to: {prompt}"}, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 5}})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAIServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_port
    httpd.shutdown()
    httpd.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_regen_through_a_url_with_credentials_writes_them_nowhere(tmp_path, tiny_model_dir, fake_server):
    """The CLI (Hydra, its run log, the lock, regen's shards, error file and manifest) on a base URL with a
    password and a key, beside a dead server whose URL holds a token too: the run uses the credentials (the fake
    server refuses requests without them) and no file under the output folder holds one."""
    data = tmp_path / "prompts.jsonl"
    prompts = ["What is 2+2?", "Name a colour.", "REJECT this one.", "Say hi."]
    data.write_text("".join(json.dumps({"id": f"p{i}", "conversations": [{"from": "human", "value": p}]}) + "\n"
                            for i, p in enumerate(prompts)))
    dead = _closed_port()
    urls = (f"http://alice:SECRET1@127.0.0.1:{fake_server}/v1?api_key=SECRET2,"
            f"http://bob:SECRET3@127.0.0.1:{dead}/v1?token=SECRET4")
    out_root = tmp_path / "out"
    cmd = [sys.executable, "-m", "pipeline.run", "stage=regen", "target=hf", f"target.path={tiny_model_dir}",
           "target.name=tiny", "name=s", f"output_root={out_root}", f"data.sources=[{{path: '{data}'}}]",
           "regen.backend=openai", f"regen.openai.base_url='{urls}'", "regen.openai.backoff_s=60",
           "regen.openai.max_retries=1", "regen.progress=false", "regen.max_new_tokens=8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = load_manifest(out_root / "s" / "regen", "regen")
    assert manifest["counts"]["failed_conversations"] == 1  # the REJECT prompt: its error was recorded
    assert manifest["config"]["regen"]["openai"]["base_url"] == (
        f"http://alice:{MASK}@127.0.0.1:{fake_server}/v1?api_key={MASK},http://bob:{MASK}@127.0.0.1:{dead}/v1?token={MASK}")
    errors = "".join(p.read_text() for p in (out_root / "s" / "regen" / "errors").iterdir())
    assert "http_400" in errors and "api_key=***" in errors
    assert list(out_root.rglob("run.log")) and not list(out_root.rglob("overrides.yaml"))
    secrets = SECRETS + (BASIC,)  # the password as the Authorization header carries it too
    assert files_holding(out_root, secrets) == {}
    assert not [s for s in secrets if s in out.stdout + out.stderr]


def test_a_multirun_keeps_no_secret_in_hydras_sweep_record(tmp_path):
    """Hydra's sweeper writes multirun.yaml (config and overrides) before the jobs start; the jobs redact it. The
    jobs here fail at once (no dump to train from): the record is redacted before a stage runs."""
    out_root = tmp_path / "out"
    cmd = [sys.executable, "-m", "pipeline.run", "-m", "stage=train", "name=s", f"output_root={out_root}",
           "regen.openai.base_url='http://u:SECRET1@h/v1?api_key=SECRET2'", "train.lr=1e-4,2e-4"]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    records = list(out_root.rglob("multirun.yaml"))
    assert records and "base_url: http://u:***@h/v1?api_key=***" in records[0].read_text(), out.stderr[-2000:]
    assert files_holding(out_root) == {}


def test_the_one_line_error_holds_no_secret(cli, tmp_path):
    """The refusal printed on stderr (which Slurm keeps in its job log) is redacted like every file."""
    out = cli(["stage=train", f"output_root={tmp_path}", "head.name='http://alice:SECRET9@host/v1'"],
              env={**os.environ, "WANDB_MODE": "disabled"})
    assert out.returncode == 1 and "is not a valid name" in out.stderr, out.stderr[-2000:]
    assert "SECRET9" not in out.stdout + out.stderr and f"alice:{MASK}@host" in out.stderr
