"""Generation through any OpenAI-compatible `/v1/chat/completions` server (vLLM, SGLang, llama.cpp's server).

The server applies the chat template and batches requests itself; here `concurrency` conversations are kept in
flight, each asking its next turn as soon as its answer returns (waves.py), so a server with parallel slots and
continuous batching stays full. Each request has a timeout and retries with exponential backoff on transient
errors (connection, timeout, 408/409/429/5xx). A request that still fails becomes a `Failure` with its reason;
the run goes on. Standard library HTTP only, so nothing else needs installing.
"""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

from pipeline.regen.batching import RegenItem
from pipeline.regen.config import OpenAIBackendConfig
from pipeline.regen.waves import Answer, Failure, Request

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}


class ServerUnavailable(RuntimeError):
    pass


class _RequestError(Exception):
    """`retryable`: the same request may succeed later (connection, timeout, overload); an HTTP 400 (e.g. a
    prompt longer than the server's context) will not."""

    def __init__(self, reason: str, detail: str, retryable: bool = True):
        super().__init__(reason, detail)
        self.reason, self.detail, self.retryable = reason, detail, retryable
        self.attempts = 1


class OpenAIBackend:
    name = "openai"

    def __init__(self, cfg: OpenAIBackendConfig, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 tokenizer=None, server=None):
        self.cfg = cfg
        self.server = server  # a server regen started for this run (llama_server.LlamaServer): closed with us
        self.base_url = cfg.base_url.rstrip("/")
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.tokenizer = tokenizer  # only to count tokens when the server reports no usage
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.concurrency = max(1, cfg.concurrency)  # conversations in flight (set it to the server's slots)
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regen-openai")
        self.model = self._resolve_model()

    # -- HTTP ------------------------------------------------------------------------------------------

    def _http(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None) -> dict:
        timeout_s = timeout_s or self.cfg.timeout_s
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            raise _RequestError(f"http_{e.code}", detail, retryable=e.code in RETRYABLE_STATUS) from None
        except (socket.timeout, TimeoutError) as e:
            raise _RequestError("timeout", f"no answer within {timeout_s:g} s ({e})") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise _RequestError("timeout", f"no answer within {timeout_s:g} s") from None
            raise _RequestError("connection_error", str(e.reason)) from None
        except (ConnectionError, OSError) as e:  # reset mid-response, remote closed, ...
            raise _RequestError("connection_error", str(e)) from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise _RequestError("bad_response", f"not JSON: {raw[:200]!r}") from None

    def _with_retries(self, method: str, path: str, body: Optional[dict] = None,
                      timeout_s: Optional[float] = None) -> tuple[dict, int]:
        """(response, attempts); raises a non-retryable error at once, a retryable one once retries are spent."""
        for attempt in range(1, self.cfg.max_retries + 2):
            try:
                return self._http(method, path, body, timeout_s), attempt
            except _RequestError as e:
                e.attempts = attempt
                if not e.retryable or attempt > self.cfg.max_retries:
                    raise
                # Exponential backoff with jitter, so concurrent workers do not retry in lockstep.
                delay = self.cfg.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                log.debug("%s %s: %s (%s); retry %d in %.1f s", method, path, e.reason, e.detail, attempt, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _resolve_model(self) -> str:
        """Checks the server is up (fail fast rather than log a failure per request) and resolves the model:
        `default` takes the server's first model (llama.cpp and single-model vLLM/SGLang serve just one)."""
        try:
            # A cheap call: a generous timeout even when generation timeouts are tight.
            listing, _ = self._with_retries("GET", "/models", timeout_s=max(self.cfg.timeout_s, 10.0))
        except _RequestError as e:
            raise ServerUnavailable(f"regen.openai.base_url={self.cfg.base_url}: {e.reason} ({e.detail})") from None
        ids = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
        if self.cfg.model in ids:
            return self.cfg.model
        if self.cfg.model == "default" and ids:
            return ids[0]
        raise ServerUnavailable(f"server {self.cfg.base_url} does not serve model {self.cfg.model!r} (serves {ids})")

    # -- generation -------------------------------------------------------------------------------------

    def prompt_length(self, item: RegenItem) -> int:
        return item.prompt_chars()  # the server tokenizes; characters rank prompts well enough

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]:
        return list(self.pool.map(self.complete, requests))

    def complete(self, request: Request) -> Union[Answer, Failure]:
        body = {"model": self.model, "messages": request.messages, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": request.seed, "stream": False}
        try:
            resp, attempts = self._with_retries("POST", "/chat/completions", body)
        except _RequestError as e:
            if self.server is not None and self.server.proc.poll() is not None:
                # Our own server died: these are not the conversations' failures. Raise, so the batch is not
                # saved and a rerun (which starts a new server) generates it.
                raise ServerUnavailable(f"llama-server exited with code {self.server.proc.returncode} during "
                                        f"the run; see {self.server.log_path}") from None
            return Failure(e.reason, e.detail, e.attempts)
        try:
            choice = resp["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError(f"content is {type(text).__name__}")
        except (KeyError, IndexError, TypeError) as e:
            return Failure("bad_response", f"{type(e).__name__}: {e}; response {str(resp)[:200]}", attempts)
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        n_tokens = (resp.get("usage") or {}).get("completion_tokens")
        if n_tokens is None:
            n_tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if self.tokenizer else 0
        return Answer(text=text, n_tokens=int(n_tokens), finish_reason=finish)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.server is not None:
            self.server.close()


# -- registry entry (pipeline/regen/backends.py) ------------------------------------------------------------

def unavailable(cfg) -> Optional[str]:
    return None  # servers the user runs: whether they answer is checked when the run starts


def version() -> Optional[str]:
    return None  # the servers' own


def refuse_own_template(cfg, name: str) -> None:
    if cfg.target.chat_template:
        raise ValueError(f"target.chat_template={cfg.target.chat_template!r} with regen.backend={name}: the server "
                         f"renders each chat with its own template, so the answers would not be the ones that "
                         f"template asks for; use regen.backend=hf")


def served_tokenizer(cfg):
    """The target's tokenizer, as load_target pads it, so every backend digests the same tokenizer."""
    from pipeline.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.target)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def served_fingerprint(cfg, tokenizer, served) -> dict:
    """`compute_fingerprint`'s fields for the configured target (what the served model must be), from its config
    and tokenizer only: the weights that generate are on the server, so `weights_digest` is None rather than a
    digest of local weights that did not generate."""
    from transformers import AutoConfig

    from pipeline.target import compute_fingerprint, materialize

    location, source = materialize(cfg.target)
    hf_config = AutoConfig.from_pretrained(location, revision=cfg.target.revision)
    return {**compute_fingerprint(hf_config, tokenizer, cfg.target, source, weights=None),
            "served": {"base_url": served.base_url, "model": served.model}}


def make(cfg, info):
    rcfg = cfg.regen
    refuse_own_template(cfg, "openai")
    tokenizer = served_tokenizer(cfg)
    backend = OpenAIBackend(rcfg.openai, rcfg.max_new_tokens, rcfg.temperature, rcfg.top_p, tokenizer=tokenizer)
    return backend, served_fingerprint(cfg, tokenizer, rcfg.openai), {"served_model": backend.model,
                                                                      "base_url": backend.base_url}
