"""Generation through OpenAI-compatible `/v1/chat/completions` servers (vLLM, SGLang, llama.cpp's server).

The servers apply the chat template and batch requests themselves; here `concurrency` conversations per server
are kept in flight, each asking its next turn as soon as its answer returns (waves.py, stream.py), so servers
with parallel slots and continuous batching stay full.

`regen.openai.base_url` is one URL or a list. Each request goes to the healthy server with the fewest requests
in flight (at most `concurrency` each). A transient error (connection, timeout, 408/409/429/5xx) marks that
server down for a backoff that doubles with its consecutive failures (with jitter), and the request is asked
again at once on another server, or, when every server is down, on the first to come back. So a dead server's
in-flight requests go to the others, and a single server that restarts is waited for. A request that still
fails after `max_retries` retries becomes a retryable `Failure`: its conversation stays pending, and a rerun
asks it. An error that will not go away (an HTTP 400, say a prompt longer than the server's context) fails at
once, for good. Standard library HTTP only, so nothing else needs installing.

A base URL may carry credentials: `user:password@` is sent as HTTP Basic auth, a query (`?api_key=...`) is kept
after each request's path, and `api_key_env` names the variable of a Bearer key. Messages, logs and records name
a server by its redacted URL (pipeline/redact.py), so none of them holds the secret.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

from pipeline.redact import redact, redact_text, redact_url
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


def base_urls(value) -> list[str]:
    """`regen.openai.base_url` (one URL, a list, or a comma-separated string) as a list of URLs."""
    urls = [value] if isinstance(value, str) else list(value or [])
    urls = [u.strip().rstrip("/") for url in urls for u in str(url).split(",") if u.strip()]
    if len(set(urls)) != len(urls):
        raise ValueError(f"regen.openai.base_url lists a server twice: {urls}")
    return urls


def endpoint(base: str, path: str) -> tuple[str, dict]:
    """The URL of `path` on the server at `base`, and the headers of the credentials in it: urllib sends none
    for a URL's `user:password@`, so it becomes HTTP Basic auth; a query stays after the path."""
    parts = urllib.parse.urlsplit(base)
    host, headers = parts.netloc, {}
    if "@" in host:
        userinfo, host = host.rsplit("@", 1)
        headers["Authorization"] = "Basic " + base64.b64encode(urllib.parse.unquote(userinfo).encode()).decode()
    url = urllib.parse.urlunsplit((parts.scheme, host, parts.path.rstrip("/") + path, parts.query, parts.fragment))
    return url, headers


class Server:
    """One server's state in the pool: requests in flight, consecutive failures, down until when. `shown`: its
    URL as messages and logs name it (redacted)."""

    def __init__(self, url: str, concurrency: int):
        self.url, self.concurrency = url, concurrency
        self.shown = redact_url(url)
        self.in_flight = 0
        self.failures = 0  # consecutive
        self.down_until = 0.0  # time.monotonic()
        self.answered = 0

    def up(self, now: float) -> bool:
        return self.down_until <= now


class ServerPool:
    """Picks a server per request (healthy, least loaded, below its concurrency) and keeps their health."""

    def __init__(self, urls: list[str], concurrency: int, backoff_s: float):
        self.servers = [Server(u, concurrency) for u in urls]
        self.backoff_s = backoff_s
        self.cond = threading.Condition()

    def acquire(self) -> Server:
        with self.cond:
            while True:
                now = time.monotonic()
                free = [s for s in self.servers if s.up(now) and s.in_flight < s.concurrency]
                if free:
                    server = min(free, key=lambda s: (s.in_flight / s.concurrency, s.failures))
                    server.in_flight += 1
                    return server
                wake = [s.down_until - now for s in self.servers if not s.up(now)]
                # Every server down: wait for the first to come back; else for a slot to free up.
                self.cond.wait(timeout=min(wake) if wake and len(wake) == len(self.servers) else 1.0)

    def release(self, server: Server, error: Optional[_RequestError] = None, attempt: int = 1) -> None:
        """A request's end at `server`. A transient error leaves the server alone for the backoff of that
        request's attempt (doubling per retry, with jitter, at most 60 s): the longest backoff among the
        requests it failed, never one that grows with how many requests were in flight."""
        with self.cond:
            server.in_flight -= 1
            if error is None:
                server.failures, server.down_until = 0, 0.0
                server.answered += 1
            elif error.retryable:
                server.failures += 1
                delay = min(60.0, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random())
                server.down_until = max(server.down_until, time.monotonic() + delay)
                log.debug("%s: %s (%s); down for %.1f s", server.shown, error.reason, error.detail, delay)
            self.cond.notify_all()

    def mark_down(self, server: Server, seconds: float) -> None:
        with self.cond:
            server.down_until = time.monotonic() + seconds
            server.failures = max(server.failures, 1)


class OpenAIBackend:
    name = "openai"

    def __init__(self, cfg: OpenAIBackendConfig, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 tokenizer=None, server=None, chat_template_kwargs: Optional[dict] = None):
        self.cfg = cfg
        self.server = server  # a server regen started for this run (llama_server.LlamaServer): closed with us
        urls = base_urls(cfg.base_url)
        if not urls:
            raise ValueError("regen.openai.base_url is empty: give the server's URL, e.g. http://host:8000/v1")
        self.base_url = urls[0] if len(urls) == 1 else urls  # as configured: recorded in the manifest
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.tokenizer = tokenizer  # only to count tokens when the server reports no usage
        self.chat_template_kwargs = chat_template_kwargs or {}  # e.g. {"enable_thinking": False}
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.pool_of_servers = ServerPool(urls, max(1, cfg.concurrency), cfg.backoff_s)
        # Conversations in flight: `concurrency` per server (set it to each server's slots).
        self.concurrency = max(1, cfg.concurrency) * len(urls)
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regen-openai")
        self.model = self._resolve_model()

    # -- HTTP ------------------------------------------------------------------------------------------

    def _http(self, url: str, method: str, path: str, body: Optional[dict] = None,
              timeout_s: Optional[float] = None) -> dict:
        timeout_s = timeout_s or self.cfg.timeout_s
        url, credentials = endpoint(url, path)
        headers = {"Content-Type": "application/json", **credentials}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = redact_text(e.read().decode("utf-8", "replace")[:500])  # a server may echo the URL
            raise _RequestError(f"http_{e.code}", detail, retryable=e.code in RETRYABLE_STATUS) from None
        except (socket.timeout, TimeoutError) as e:
            raise _RequestError("timeout", f"no answer within {timeout_s:g} s ({e})") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise _RequestError("timeout", f"no answer within {timeout_s:g} s") from None
            raise _RequestError("connection_error", redact_text(str(e.reason))) from None
        except (ConnectionError, OSError) as e:  # reset mid-response, remote closed, ...
            raise _RequestError("connection_error", redact_text(str(e))) from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise _RequestError("bad_response", f"not JSON: {redact_text(repr(raw[:200]))}") from None

    def _with_retries(self, method: str, path: str, body: Optional[dict] = None,
                      timeout_s: Optional[float] = None) -> tuple[dict, int]:
        """(response, attempts) from whichever server answers; raises a non-retryable error at once, a
        retryable one once `max_retries` retries are spent (each on the best server at that moment)."""
        pool = self.pool_of_servers
        for attempt in range(1, self.cfg.max_retries + 2):
            server = pool.acquire()
            try:
                response = self._http(server.url, method, path, body, timeout_s)
            except _RequestError as e:
                pool.release(server, e, attempt)
                e.attempts = attempt
                e.detail = f"{server.shown}: {e.detail}"
                if not e.retryable or attempt > self.cfg.max_retries or self._own_server_died():
                    raise
                continue
            except BaseException:
                pool.release(server)
                raise
            pool.release(server)
            return response, attempt
        raise AssertionError("unreachable")

    def _own_server_died(self) -> bool:
        """The server this run started (llamacpp) has exited: retrying cannot help."""
        return self.server is not None and self.server.proc.poll() is not None

    def _resolve_model(self) -> str:
        """Checks the servers are up (fail fast rather than log a failure per request) and resolves the model:
        `default` takes the first server's first model (llama.cpp and single-model vLLM/SGLang serve just
        one). A server down at the start is left out until it answers; every server down stops here."""
        listings, errors = {}, {}
        for server in self.pool_of_servers.servers:
            try:  # a cheap call: a generous timeout even when generation timeouts are tight
                listings[server.shown] = self._http(server.url, "GET", "/models",
                                                  timeout_s=max(self.cfg.timeout_s, 10.0))
            except _RequestError as e:
                errors[server.shown] = f"{e.reason} ({e.detail})"
                self.pool_of_servers.mark_down(server, self.cfg.backoff_s)
        if not listings:
            raise ServerUnavailable(f"regen.openai.base_url={redact(self.cfg.base_url)}: "
                                    + "; ".join(f"{u}: {m}" for u, m in errors.items()))
        for url, message in errors.items():
            log.warning("regen: server %s does not answer (%s); the others take its requests", url, message)
        served = {url: [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
                  for url, listing in listings.items()}
        ids = next(iter(served.values()))
        model = self.cfg.model if self.cfg.model in ids else (ids[0] if self.cfg.model == "default" and ids else None)
        if model is None:
            raise ServerUnavailable(f"server {next(iter(served))} does not serve model {self.cfg.model!r} "
                                    f"(serves {ids})")
        if wrong := {url: m for url, m in served.items() if model not in m}:
            raise ServerUnavailable(f"the servers serve different models: {model!r} at {next(iter(served))}, "
                                    f"but {wrong}")
        return model

    # -- generation -------------------------------------------------------------------------------------

    def prompt_length(self, item: RegenItem) -> int:
        return item.prompt_chars()  # the server tokenizes; characters rank prompts well enough

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]:
        return list(self.pool.map(self.complete, requests))

    def complete(self, request: Request) -> Union[Answer, Failure]:
        body = {"model": self.model, "messages": request.messages, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": request.seed, "stream": False}
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        try:
            resp, attempts = self._with_retries("POST", "/chat/completions", body)
        except _RequestError as e:
            if self._own_server_died():
                # Our own server died: these are not the conversations' failures. Raise, so the batch is not
                # saved and a rerun (which starts a new server) generates it.
                name = getattr(self.server, "name", "the server")
                raise ServerUnavailable(f"{name} exited with code {self.server.proc.returncode} during the run; "
                                        f"see {self.server.log_path}") from None
            return Failure(e.reason, e.detail, e.attempts, retryable=e.retryable)
        try:
            choice = resp["choices"][0]
            message = choice["message"]
            text = message["content"] or ("" if message.get("reasoning_content") else message["content"])
            if not isinstance(text, str):
                raise TypeError(f"content is {type(text).__name__}")
            if reasoning := message.get("reasoning_content"):
                # A server that splits the reasoning out (vLLM --reasoning-parser, llama.cpp's reasoning
                # format): the target's answer is both, in the template's own form (Qwen3's think block).
                text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
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
    """The target's tokenizer, as load_target pads it, so every backend digests the same tokenizer; refuses
    regen.thinking=on/off for a template without the switch before any request is sent."""
    from pipeline.data.chat import check_thinking_template
    from pipeline.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.target)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_thinking_template(tokenizer, cfg.regen.thinking)
    return tokenizer


def server_options(cfg) -> dict:
    """OpenAIBackend's keyword arguments every server backend shares: the thinking switch goes to the
    server's template as `chat_template_kwargs` (vLLM, SGLang and llama.cpp's server take it)."""
    from pipeline.data.chat import template_kwargs

    return {"chat_template_kwargs": template_kwargs(cfg.regen.thinking)}


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
    backend = OpenAIBackend(rcfg.openai, rcfg.max_new_tokens, rcfg.temperature, rcfg.top_p, tokenizer=tokenizer,
                            **server_options(cfg))
    return backend, served_fingerprint(cfg, tokenizer, rcfg.openai), {"served_model": backend.model,
                                                                      "base_url": backend.base_url}


def make_managed(cfg, name: str, generation: dict, start, model: str, concurrency: int, timeout_s: float,
                 server_info: Optional[dict] = None):
    """`make` of a backend whose server regen starts itself (llamacpp, vllm): `start()` gives the running
    server (managed_server.ManagedServer), talked to through OpenAIBackend with `concurrency` requests in
    flight; `generation` (what names the served model) gains the server's command and start-up time."""
    import dataclasses

    rcfg = cfg.regen
    refuse_own_template(cfg, name)
    tokenizer = served_tokenizer(cfg)
    if rcfg.finalize_partial:  # writes a manifest only: nothing to serve
        generation["base_url"] = ""
        served = dataclasses.replace(rcfg.openai, base_url="", model="default")
        return None, served_fingerprint(cfg, tokenizer, served), generation
    server = start()
    try:
        served = dataclasses.replace(rcfg.openai, base_url=server.base_url, model=model, concurrency=concurrency,
                                     timeout_s=timeout_s)
        backend = OpenAIBackend(served, rcfg.max_new_tokens, rcfg.temperature, rcfg.top_p, tokenizer=tokenizer,
                                server=server, **server_options(cfg))
        fingerprint = served_fingerprint(cfg, tokenizer, served)
    except BaseException:
        server.close()
        raise
    generation["server"] = {"command": server.command[1:], "startup_s": round(server.startup_s, 2),
                            **(server_info or {})}
    generation["base_url"] = backend.base_url
    return backend, fingerprint, generation
