"""Conversation readers: every supported record format -> one canonical `Conversation`.

    Conversation = {"id": str,
                    "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...],
                    "meta": {...}}   # e.g. {"category": "writing"}; may be empty

Record formats (`SourceConfig.format`; `auto` resolves each record on its own, so one file may mix them):
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system"|aliases, "value": str}]}
  openai    {"messages": [{"role": ..., "content": str | [{"type": "text", "text": str}]}]}
  alpaca    {"instruction", "input"?, "output"?, "history"?: [[query, answer], ...], "system"?};
            self-instruct seed tasks (`instances: [{"input", "output"}]`) use their first instance.
  mtbench   {"question_id", "category"?, "turns": [str, ...]}: user turns without answers. The first turn
            becomes the prompt; later turns go to meta["followup_turns"] (they depend on the answer to the
            previous turn, so whoever generates answers must ask them one at a time).
  hf        rows of `datasets.load_dataset` (local file/dir or hub id, `split`); each row is then read as `auto`.
`SourceConfig.columns` (canonical field -> record field) renames fields before any of this, for every
format, e.g. gsm8k: {"instruction": "question", "output": "answer"}.

Files: `.json` (a list, or one object; a `.json` file that holds JSON Lines is read as such), `.jsonl`,
either gzipped (`.gz`); a directory reads its json/jsonl(.gz) files (not subdirectories) in sorted order.

Normalisation and validation, in this order:
  * Leading assistant turns (after an optional first system turn) are dropped: ShareGPT dumps split long
    conversations into pieces and the later pieces start mid-exchange. Counted as the fix
    `leading_assistant_dropped` for records that are kept.
  * Then, turn by turn, the first problem found rejects the record: `system_not_first`, `empty_content`
    (empty or whitespace-only), `not_alternating`. Consecutive same-role turns are NOT merged: in ShareGPT
    scrapes they mark lost or duplicated turns, and merging would silently move turn boundaries (and so
    the loss mask), so the record is reported instead.
  * `no_user_turn` if no user turn is left. A record that ends with a user turn (prompt only) is valid.
Ids come from `id`, `question_id` or `conversation_id`, else `<prefix>-<index in file>`; a repeated id
is `duplicate_id`. Every rejected record goes to the `BadRecordReport` with its location.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.data.bad_records import BadRecord, BadRecordError, BadRecordReport, Location
from pipeline.data.config import DataConfig, OnBadRecord, SourceConfig

DEMO_PROMPTS = Path(__file__).resolve().parent / "demo" / "prompts.jsonl"

# The field that identifies each record format, in the order `auto` tries them.
FORMAT_KEYS = {"sharegpt": "conversations", "openai": "messages", "mtbench": "turns", "alpaca": "instruction"}
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
ID_KEYS = ("id", "question_id", "conversation_id")
META_KEYS = ("category", "dataset")
DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# `datasets` builder for a local file given to an `hf` source.
HF_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


class _Bad(Exception):
    """A record-level failure: becomes a `BadRecord` at the record's location."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------------------------------------
# Files -> (Location, raw record | _Bad)
# ---------------------------------------------------------------------------------------------------------


def _strip_data_suffix(name: str) -> str:
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def data_files(path: Path) -> list[Path]:
    """The files a source path stands for: the file itself, or a directory's json/jsonl(.gz) files."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(DATA_SUFFIXES))
    if not path.exists():
        raise FileNotFoundError(f"data source not found: {path}")
    return [path]


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _iter_jsonl(path: Path, shown: str) -> Iterator[tuple[Location, Any]]:
    index = 0
    with _open(path) as f:
        for lineno, raw in enumerate(f, 1):
            loc = Location(shown, line=lineno, index=index)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                index += 1
                yield loc, _Bad("not_utf8", f"byte {e.start} of the line")
                continue
            if not line.strip():
                continue  # blank lines are not records
            index += 1
            try:
                yield loc, json.loads(line.rstrip("\r\n"))  # so an error at the end reports this line's column
            except json.JSONDecodeError as e:
                yield loc, _Bad("invalid_json", f"{e.msg} at column {e.colno}")


def _iter_json(path: Path, shown: str) -> Iterator[tuple[Location, Any]]:
    with _open(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        # One undecodable byte makes the whole document unreadable: one bad record for the file.
        yield Location(shown, line=raw.count(b"\n", 0, e.start) + 1), _Bad("not_utf8", f"byte {e.start}")
        return
    start = _WS.match(text).end()
    if text.startswith("[", start):
        yield from _iter_json_list(text, start, shown)
        return
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        yield Location(shown, line=e.lineno), _Bad("invalid_json", f"{e.msg} at column {e.colno}")
        return
    if _WS.match(text, end).end() < len(text):
        # More than one top-level value: JSON Lines under a .json name.
        yield from _iter_jsonl(path, shown)
        return
    yield Location(shown, line=text.count("\n", 0, start) + 1, index=0, json_list=True), obj


def _iter_json_list(text: str, start: int, shown: str) -> Iterator[tuple[Location, Any]]:
    """Decode a top-level JSON list element by element, so each record knows its index and first line."""
    pos = _WS.match(text, start + 1).end()
    line, counted_to = 1 + text.count("\n", 0, pos), pos
    index = 0
    if text.startswith("]", pos):
        return
    while True:
        line += text.count("\n", counted_to, pos)
        counted_to = pos
        loc = Location(shown, line=line, index=index, json_list=True)
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # A syntax error inside a list leaves no reliable resync point: the rest of the file is lost.
            yield loc, _Bad("invalid_json", f"{e.msg} at line {e.lineno} column {e.colno}; rest of file unread")
            return
        yield loc, obj
        index += 1
        pos = _WS.match(text, end).end()
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()
        elif text.startswith("]", pos) and _WS.match(text, pos + 1).end() == len(text):
            return
        else:
            line += text.count("\n", counted_to, pos)
            loc = Location(shown, line=line, index=index, json_list=True)
            yield loc, _Bad("invalid_json", "expected ',' or a final ']' after the previous record")
            return


def _iter_hf(src: SourceConfig) -> Iterator[tuple[Location, Any]]:
    import datasets  # heavy import, only for hf sources

    path = Path(src.path)
    if path.is_file():
        builder = HF_BUILDERS.get(Path(path.name.removesuffix(".gz")).suffix, "json")
        ds = datasets.load_dataset(builder, data_files=str(path), split=src.split)
    else:
        ds = datasets.load_dataset(src.path, split=src.split)
    shown = f"{src.path}[{src.split}]"
    for i, row in enumerate(ds):
        yield Location(shown, index=i), row


def _located_records(src: SourceConfig) -> Iterator[tuple[str, Location, Any]]:
    """(id prefix, location, raw record or _Bad) over every record of a source."""
    if src.format == "hf":
        prefix = src.id_prefix or _strip_data_suffix(Path(src.path).name)
        for loc, rec in _iter_hf(src):
            yield prefix, loc, rec
        return
    root = Path(src.location())
    for path in data_files(root):
        shown = str(path) if root.is_dir() or src.package else src.path
        prefix = src.id_prefix or _strip_data_suffix(path.name)
        reader = _iter_jsonl if path.name.removesuffix(".gz").endswith(".jsonl") else _iter_json
        for loc, rec in reader(path, shown):
            yield prefix, loc, rec


# ---------------------------------------------------------------------------------------------------------
# Raw record -> Conversation
# ---------------------------------------------------------------------------------------------------------


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise _Bad("missing_field", what)
    raise _Bad("missing_field", f"{what} (a {type(value).__name__}, not a string)")


def _role(value: Any, what: str) -> str:
    if value is None:
        raise _Bad("missing_field", what)
    role = ROLE_ALIASES.get(str(value).lower())
    if role is None:
        raise _Bad("unknown_role", f"{what}={value!r}")
    return role


def _list(rec: Mapping, key: str) -> list:
    value = rec.get(key)
    if value is None:
        raise _Bad("missing_field", key)
    if not isinstance(value, list):
        raise _Bad("missing_field", f"{key} (a {type(value).__name__}, not a list)")
    return value


def _turn(t: Any, what: str) -> Mapping:
    if not isinstance(t, Mapping):
        raise _Bad("missing_field", f"{what} (a {type(t).__name__}, not an object)")
    return t


def _turns(rec: Mapping, key: str, role_key: str, content_key: str,
           content: Callable[[Any, str], str]) -> list[dict]:
    """A list of turn objects under `key` -> canonical messages, each field error naming its turn."""
    msgs = []
    for i, t in enumerate(_list(rec, key)):
        t = _turn(t, f"{key}[{i}]")
        role = _role(t.get(role_key), f"{key}[{i}].{role_key}")
        msgs.append({"role": role, "content": content(t.get(content_key), f"{key}[{i}].{content_key}")})
    return msgs


def _sharegpt(rec: Mapping) -> tuple[list[dict], dict]:
    return _turns(rec, "conversations", "from", "value", _text), {}


def _openai_content(content: Any, what: str) -> str:
    # Multimodal content is a list of parts; a text model only sees the text parts.
    if isinstance(content, list):
        return "".join(
            _text(p.get("text"), f"{what}[{j}].text")
            for j, p in enumerate(content)
            if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return _text(content, what)


def _openai(rec: Mapping) -> tuple[list[dict], dict]:
    return _turns(rec, "messages", "role", "content", _openai_content), {}


def _alpaca(rec: Mapping) -> tuple[list[dict], dict]:
    instruction = _text(rec.get("instruction"), "instruction")
    inp, out = rec.get("input"), rec.get("output")
    instances = rec.get("instances")
    if inp is None and out is None and isinstance(instances, list) and instances:
        # self-instruct seed task: the first instance is the worked example
        first = _turn(instances[0], "instances[0]")
        inp, out = first.get("input"), first.get("output")
    msgs = []
    if rec.get("system"):
        msgs.append({"role": "system", "content": _text(rec["system"], "system")})
    for i, pair in enumerate(rec.get("history") or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise _Bad("missing_field", f"history[{i}] (not a [query, answer] pair)")
        msgs.append({"role": "user", "content": _text(pair[0], f"history[{i}][0]")})
        msgs.append({"role": "assistant", "content": _text(pair[1], f"history[{i}][1]")})
    inp = "" if inp is None else _text(inp, "input")
    msgs.append({"role": "user", "content": f"{instruction}\n\n{inp}" if inp.strip() else instruction})
    if out is not None:
        msgs.append({"role": "assistant", "content": _text(out, "output")})
    return msgs, {}


def _mtbench(rec: Mapping) -> tuple[list[dict], dict]:
    turns = [_text(t, f"turns[{i}]") for i, t in enumerate(_list(rec, "turns"))]
    if not turns:
        raise _Bad("no_user_turn", "turns is empty")
    for i, t in enumerate(turns[1:], 1):
        if not t.strip():
            raise _Bad("empty_content", f"turns[{i}]")
    return [{"role": "user", "content": turns[0]}], ({"followup_turns": turns[1:]} if len(turns) > 1 else {})


_PARSERS = {"sharegpt": _sharegpt, "openai": _openai, "alpaca": _alpaca, "mtbench": _mtbench}


def _detect_format(rec: Mapping) -> str:
    for fmt, key in FORMAT_KEYS.items():
        if rec.get(key) is not None:
            return fmt
    raise _Bad("missing_field", "none of " + "/".join(FORMAT_KEYS.values()))


def _validate(msgs: list[dict]) -> tuple[list[dict], bool]:
    """Drop leading assistant turns, then check the turn structure. Returns (messages, dropped_any).
    Details name turns by their index in the record as read (before dropping)."""
    n_sys = 1 if msgs and msgs[0]["role"] == "system" else 0
    first = n_sys
    while first < len(msgs) and msgs[first]["role"] == "assistant":
        first += 1
    kept = list(range(n_sys)) + list(range(first, len(msgs)))
    prev = None
    for i in kept:
        role, content = msgs[i]["role"], msgs[i]["content"]
        if role == "system" and i > 0:
            raise _Bad("system_not_first", f"turn {i}")
        if not content.strip():
            raise _Bad("empty_content", f"turn {i} ({role})")
        if prev is not None and role == msgs[prev]["role"]:
            raise _Bad("not_alternating", f"turns {prev} and {i} are both {role}")
        prev = i
    if not any(msgs[i]["role"] == "user" for i in kept):
        raise _Bad("no_user_turn")
    return [msgs[i] for i in kept], first > n_sys


def _record_id(rec: Mapping, default: str) -> str:
    for key in ID_KEYS:
        value = rec.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != "":
            return str(value)
    return default


def _apply_columns(rec: Mapping, columns: Mapping) -> dict:
    rec = dict(rec)
    for canonical, column in columns.items():
        if column in rec:
            rec[canonical] = rec[column]
    return rec


def _to_conversation(rec: Any, fmt: str = "auto", default_id: str = "", columns: Optional[Mapping] = None):
    """One raw record -> (Conversation, leading_assistant_dropped). Raises `_Bad` for a bad record."""
    if not isinstance(rec, Mapping):
        raise _Bad("invalid_json", f"record is a {type(rec).__name__}, not an object")
    if columns:
        rec = _apply_columns(rec, columns)
    if fmt in ("auto", "hf"):
        fmt = _detect_format(rec)
    msgs, meta = _PARSERS[fmt](rec)
    msgs, dropped = _validate(msgs)
    meta.update({k: rec[k] for k in META_KEYS if rec.get(k) not in (None, "")})
    return {"id": _record_id(rec, default_id), "messages": msgs, "meta": meta}, dropped


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def read_source(
    src: SourceConfig,
    report: BadRecordReport,
    on_bad_record: str = "skip",
    *,
    seen_ids: Optional[set] = None,
    prompts: Optional["PromptFilter"] = None,
) -> Iterator[dict]:
    """Yield the Conversations of one source; bad records go to `report` (or raise `BadRecordError` at
    the first one when `on_bad_record="fail"`). `limit` counts yielded records. `seen_ids` (shared by
    `read_sources`) extends the id-uniqueness check beyond this source; `prompts` leaves out repeated and
    held-out prompts (counted in `report` as skipped, with their locations)."""
    on_bad_record = OnBadRecord.parse(on_bad_record, "data.on_bad_record")
    if src.limit is not None and src.limit <= 0:
        return
    seen = set() if seen_ids is None else seen_ids
    n_yielded = 0
    for prefix, loc, rec in _located_records(src):
        try:
            if isinstance(rec, _Bad):
                raise rec
            conv, dropped = _to_conversation(rec, src.format, f"{prefix}-{loc.index}", src.columns)
            if conv["id"] in seen:
                raise _Bad("duplicate_id", conv["id"])
        except _Bad as e:
            bad = BadRecord(loc, e.reason, e.detail)
            report.add(bad)
            if on_bad_record == "fail":
                raise BadRecordError(bad) from None
            continue
        if prompts is not None:
            skip = prompts.check(conv)
            if skip is not None:
                report.skip(BadRecord(loc, *skip))
                continue
        seen.add(conv["id"])
        if dropped:
            report.fix("leading_assistant_dropped")
        yield conv
        n_yielded += 1
        if src.limit is not None and n_yielded >= src.limit:
            return


def prompt_turns(conv: dict) -> tuple[Optional[str], list[str]]:
    """A Conversation as what a generator answers: (its system message or None, every user turn in order,
    MT-bench follow-ups (meta["followup_turns"]) appended). Original assistant turns are not part of it:
    regen and eval ask the target to answer each user turn itself, with its own answers as history."""
    messages = conv["messages"]
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    turns = [m["content"] for m in messages if m["role"] == "user"]
    turns += list((conv.get("meta") or {}).get("followup_turns") or [])
    return system, turns


def prompt_key(text: str) -> str:
    """What makes two prompts the same: the text with case and white space folded."""
    return hashlib.sha1(" ".join(text.casefold().split()).encode()).hexdigest()


class PromptFilter:
    """Leaves out a conversation whose first user turn an earlier kept one had (`dedupe`), or any of whose
    user turns is a held-out prompt (the evaluation sets). `check` says why, or None to keep it."""

    def __init__(self, dedupe: bool, held_out: Iterable[str] = ()):
        self.dedupe = dedupe
        self.held_out = {prompt_key(p) for p in held_out}
        self.seen: set[str] = set()

    def check(self, conv: dict) -> Optional[tuple[str, str]]:
        _, turns = prompt_turns(conv)
        keys = [prompt_key(t) for t in turns]
        for turn, key in zip(turns, keys):
            if key in self.held_out:
                return "held_out_prompt", _excerpt(turn)
        if self.dedupe and keys:
            if keys[0] in self.seen:
                return "duplicate_prompt", _excerpt(turns[0])
            self.seen.add(keys[0])
        return None


def _excerpt(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def held_out_prompts(sources: Iterable[SourceConfig]) -> list[str]:
    """Every user turn of the held-out sets (MT-bench follow-ups included)."""
    report = BadRecordReport()
    return [t for src in sources for conv in read_source(src, report) for t in prompt_turns(conv)[1]]


def read_sources(cfg: DataConfig, report: BadRecordReport) -> Iterator[dict]:
    """All sources of a data config in order, ids unique across all of them, repeated and held-out prompts
    left out when the config asks (`data.dedupe_prompts`, `data.held_out`). No sources: the packaged
    demo prompts (read as `auto`, so they may be `messages` or MT-bench-style `turns` records)."""
    sources = [SourceConfig.of(s) for s in cfg.sources] or [SourceConfig(path=str(DEMO_PROMPTS))]
    prompts = None
    if cfg.dedupe_prompts or cfg.held_out:
        prompts = PromptFilter(cfg.dedupe_prompts, held_out_prompts(cfg.held_out))
    seen: set = set()
    for src in sources:
        yield from read_source(src, report, cfg.on_bad_record, seen_ids=seen, prompts=prompts)
