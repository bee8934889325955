"""A real OpenAI-compatible server for the `openai` regen backend's tests: llama.cpp's `llama-server` (the one
`make llama-server` builds, the same binary regen.backend=llamacpp runs) started by hand on 127.0.0.1, as a
user runs their own server, and a readiness probe that says how it died, with the end of its own log."""
from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.regen.managed_server import free_port


def describe_exit(returncode: int) -> str:
    """'exit code 1' or 'killed by SIGILL (illegal instruction)' for a child's returncode."""
    if returncode >= 0:
        return f"exit code {returncode}"
    sig = signal.Signals(-returncode)
    return f"killed by {sig.name} ({signal.strsignal(sig)})"


class ServedModel:
    """A server process on 127.0.0.1 and its log. `diagnose()` says whether it is alive or how it died, with
    the end of its own log: every assertion on a served run carries it, so a server that dies or answers
    nothing fails the test with its signal and log instead of a wall of connection errors."""

    def __init__(self, proc: subprocess.Popen, log: Path, base_url: str):
        self.proc, self.log, self.base_url = proc, log, base_url

    def diagnose(self, lines: int = 25) -> str:
        code = self.proc.poll()
        state = "is running" if code is None else f"died: {describe_exit(code)}"
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return f"server {state}; the end of its log ({self.log}):\n{tail}"

    def chat(self, content: str, max_tokens: int = 8) -> str:
        """One real multi-token chat completion at temperature 0 (the readiness probe: a server can list
        its models and still crash or answer empty on every chat request)."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0.0}
        request = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"] or ""

    def wait_ready(self, deadline_s: float = 120) -> None:
        deadline = time.monotonic() + deadline_s
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the server did not start. {self.diagnose()}")
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /models in {deadline_s:.0f} s. {self.diagnose()}")
                time.sleep(0.5)
        try:
            answer = self.chat("Why do cats purr? Answer in a sentence.")
        except OSError as e:
            time.sleep(0.5)  # let a crashing server finish dying, so diagnose() reports its signal
            pytest.fail(f"the server failed a chat completion ({e!r}). {self.diagnose()}")
        if not answer.strip():
            pytest.fail(f"the server answered a chat completion with no text. {self.diagnose()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_llama_server(binary: Path, gguf: Path, log: Path, n_ctx: int, threads: int = 2) -> ServedModel:
    """llama-server serving `gguf` with one slot of `n_ctx` tokens: requests queue for that slot, so each is
    decoded alone and an answer at temperature 0 does not depend on what else is in flight."""
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "-np", "1", "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads),
                                 "--no-webui"], stdout=f, stderr=subprocess.STDOUT)
    server = ServedModel(proc, log, f"http://127.0.0.1:{port}/v1")
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server
