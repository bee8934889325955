"""Secrets out of every file eaglet writes: the one redaction of URLs, command lines, configs and log lines.

A base URL may carry a password (`http://user:secret@host`) or a key in its query (`?api_key=...`), and a
command line or an override may carry one (`--api-key X`, `regen.openai.api_key=X`, `hf_token=X`). Lock files
record the command line, manifests the resolved config, W&B its config, logs what they print: each goes
through here first, so a secret never persists. A redacted value reads `***`; the rest (scheme, host, user,
path, the other parameters) stays, so a record still says which server it was.

Which names are secret (`secret_name`): the last part of a dotted key, split into words at `_`, `-`, `.`:
any word password / passwd / passphrase / secret / credential(s) / apikey / accesstoken / authtoken; a last
word `token` or `key` after a word that makes it a credential (api_key, access_token, hf_token, private_key,
...); `token`, `auth`, `authorization` alone. A name whose last word is `env` names an environment variable
and is kept (regen.openai.api_key_env). In a URL's query also `key`, `sig`, `signature`, `code`. In an LLM
project "token" mostly means a text token: eos_token, max_new_tokens, token_loss_weight are not secrets.
"""
from __future__ import annotations

import functools
import logging
import re
from typing import Any, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"

_SECRET_WORDS = {"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials", "apikey",
                 "accesstoken", "authtoken", "bearer"}
_CREDENTIAL_OF = {  # last word -> the words before it that make it a credential
    "key": {"api", "access", "secret", "private", "client", "auth", "signing", "encryption", "license"},
    "token": {"access", "auth", "api", "hf", "bearer", "refresh", "id", "session", "github", "gh", "wandb",
              "private", "secret", "client", "oauth", "csrf", "personal", "security", "sas"},
}
_ALONE = {"token", "auth", "authorization"}
_QUERY_ALSO = {"key", "sig", "signature", "code"}
_SCHEMES = {"bearer", "basic", "token", "digest"}  # what an Authorization header's value starts with

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`,]+")  # a comma ends it: URL lists are comma-separated
_AUTH_HEADER = re.compile(rf"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)(?:({'|'.join(sorted(_SCHEMES))})\s+)?"
                          r"[^\s,;'\"]+")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}")
# Basic and Digest credentials outside a header (an echoed header dict, a curl line): the scheme as HTTP writes
# it, then a base64-like value that holds a digit, '+', '/' or '=' ("Basic arithmetic" is no credential).
_BASIC = re.compile(r"\b(Basic|Digest)\s+(?=[A-Za-z0-9+/=._~-]*[0-9+/=])[A-Za-z0-9+/=._~-]{8,}")
_OPTION = re.compile(r"[+~-]*[A-Za-z0-9_.-]+")  # an option's or an override's name (not a URL's head)
# Every pattern here needs a ':' or '=' (a URL, a header, an assignment) or whitespace (Bearer/Basic/Digest and
# their value): text with none is returned as it is, unsearched (a 100k-shard manifest holds 200k such names).
_MAY_HOLD_SECRET = re.compile(r"[:=\s]")
# name=value, name: value, and the quoted keys of JSON or a Python dict ({"api_key": "sk-..."}).
_ASSIGNMENT = re.compile(r"(?P<open>[\"']?)(?P<name>[A-Za-z0-9_.+~-]*[A-Za-z0-9])(?P=open)(?P<sep>\s?(?:=|:)\s?)"
                         r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s&,;'\"}\]]+)")


@functools.lru_cache(maxsize=4096)  # the same few keys, once per record of a large manifest
def secret_name(name: str) -> bool:
    """Whether an option, config key or override named `name` holds a secret (see the module's doc)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower().lstrip("-+~").rsplit(".", 1)[-1]) if w]
    if not words or words[-1] == "env":
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if len(words) == 1:
        return words[0] in _ALONE
    return words[-2] in _CREDENTIAL_OF.get(words[-1], ())


def _query_secret(name: str) -> bool:
    words = re.split(r"[^a-z0-9]+", name.lower())
    return secret_name(name) or words[-1] in _QUERY_ALSO  # X-Amz-Signature, key, sig


def _query(query: str) -> str:
    parts = []
    for part in query.split("&") if query else []:
        name, eq, _ = part.partition("=")
        parts.append(f"{name}={MASK}" if eq and _query_secret(unquote(name)) else part)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """`url` with its userinfo password and its secret query (and fragment) parameters made `***`."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not parseable as a URL (a bad port, a stray bracket): mask after the scheme
        return re.sub(r"://[^/]*@", f"://{MASK}@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else netloc
    return urlunsplit((parts.scheme, netloc, parts.path, _query(parts.query), _query(parts.fragment)))


def _assignment(m: re.Match) -> str:
    value = m["value"].strip("\"'")
    if value in (MASK, "") or value.lower() in _SCHEMES or not secret_name(m["name"]):
        return m.group(0)
    quote = m["value"][0] if m["value"][0] in "\"'" else ""
    return f"{m['open']}{m['name']}{m['open']}{m['sep']}{quote}{MASK}{quote}"


def redact_text(text: str) -> str:
    """Free text (a log line, an error message, one command-line argument): every URL in it redacted, every
    `secret_name=value` / `secret_name: value` made `secret_name=***`, Authorization headers and Bearer tokens
    masked."""
    if not isinstance(text, str) or not _MAY_HOLD_SECRET.search(text):
        return text
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _AUTH_HEADER.sub(lambda m: f"{m[1]}{m[2] + ' ' if m[2] else ''}{MASK}", text)
    text = _BEARER.sub(lambda m: f"{m[1]} {MASK}", text)
    text = _BASIC.sub(lambda m: f"{m[1]} {MASK}", text)
    return _ASSIGNMENT.sub(_assignment, text)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line, argument by argument: `--api-key X` (the value after a secret-named option) and
    `--api-key=X`, `regen.openai.api_key=X` made `***`; every URL redacted."""
    out, hide_next = [], False
    for arg in map(str, argv):
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if arg.startswith("-") and not eq and secret_name(arg):
            hide_next = True
            out.append(arg)
        elif eq and _OPTION.fullmatch(name) and secret_name(name):
            out.append(f"{name}={MASK}")
        else:
            out.append(redact_text(arg))
    return out


def _filled(value: Any) -> bool:
    """A value a secret-named key may hide: a non-empty string or a number (`password: 123456` is read as an
    int); not a flag, a null or a section."""
    return (isinstance(value, str) and value != "") or (isinstance(value, (int, float)) and not isinstance(value, bool))


def redact(obj: Any) -> Any:
    """A plain config or record (dicts, lists, strings, numbers): a secret-named key's value made `***`, lists
    of strings read as command lines (redact_argv), every other string as free text (redact_text)."""
    if isinstance(obj, dict):
        return {k: MASK if secret_name(str(k)) and _filled(v) else redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(v, str) for v in obj):
            return redact_argv(obj)
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


class RedactingFilter(logging.Filter):
    """A log handler's filter that redacts each record's message (the entry point puts it on every handler:
    run.log and the console), for what a library logs beyond eaglet's own redacted messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (clean := redact_text(message)) != message:
            record.msg, record.args = clean, ()
        return True
