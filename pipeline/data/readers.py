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

Broken files lose as little as can be told apart, and every loss is one bad record with its place:
  * JSONL: a line that does not decode (`not_utf8`) or parse (`invalid_json`, a last line cut short too) is
    that line only.
  * JSON list: a record holding an undecodable byte is `not_utf8` (its byte offset) and the records around it
    are kept; a syntax error has no resync point, so the records before it are kept and one `invalid_json`
    names its line, column and byte offset ("rest of file unread"); a file cut short says so, with its length.
  * `.gz`: not gzip data, or a stream that breaks (cut short, corrupt): `bad_gzip`; what decompressed before
    the break is read as above.
  * Binary data (a NUL byte in the first SNIFF_BYTES, not starting like JSON): one `binary_file` for the file.

Normalisation and validation, in this order:
  * Leading assistant turns (after an optional first system turn) are dropped: ShareGPT dumps split long
    conversations into pieces and the later pieces start mid-exchange. Counted as the fix
    `leading_assistant_dropped` for records that are kept.
  * Then, turn by turn, the first problem found rejects the record: `system_not_first`, `turn_too_long`
    (over `data.max_turn_chars`; MT-bench follow-ups too), `empty_content` (empty or whitespace-only),
    `not_alternating`. Consecutive same-role turns are NOT merged: in ShareGPT
    scrapes they mark lost or duplicated turns, and merging would silently move turn boundaries (and so
    the loss mask), so the record is reported instead.
  * `no_user_turn` if no user turn is left. A record that ends with a user turn (prompt only) is valid.
Ids come from `id`, `question_id` or `conversation_id`, else `<prefix>-<index in file>`; a repeated id
is `duplicate_id`. Every rejected record goes to the `BadRecordReport` with its location.
"""
from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import re
import zlib
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

# First bytes of a file that tell binary data from text (what git looks at too).
SNIFF_BYTES = 8000

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
# What `surrogateescape` decodes an undecodable byte to: such a character in a file's text marks a bad byte.
_BAD_BYTE = re.compile("[\udc80-\udcff]")
# How a `.gz` file that is not gzip data, or whose stream is cut short or corrupt, fails to read.
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


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


def _gzip_bad(e: Exception, n_bytes: int) -> _Bad:
    """A `.gz` file that is not gzip data, or whose stream breaks (cut short, corrupt) after `n_bytes`."""
    if n_bytes == 0 and not isinstance(e, EOFError):
        return _Bad("bad_gzip", f"not gzip data ({e}); file skipped")
    return _Bad("bad_gzip", f"the gzip stream breaks after {n_bytes} uncompressed bytes ({type(e).__name__}: {e}); "
                            "rest of file unread")


def _binary(path: Path) -> Optional[tuple[int, _Bad]]:
    """(line, bad record) for a file of binary data: a NUL byte in its first SNIFF_BYTES (JSON text never holds
    one) when it does not start like JSON. Read line by line, random bytes or a Parquet file named .jsonl
    would be thousands of bad records; they are one. A NUL further on, or in a file that starts like JSON,
    costs only what holds it (a JSONL line; in a JSON list, the rest of the file)."""
    try:
        with _open(path) as f:
            head = f.read1(SNIFF_BYTES)  # one read: enough to tell, whatever the file's size
    except _GZIP_ERRORS:
        return None  # the reader reports it where it happens
    nul = head.find(b"\0")
    if nul < 0 or head.removeprefix(codecs.BOM_UTF8).lstrip()[:1] in (b"[", b"{"):
        return None
    return head.count(b"\n", 0, nul) + 1, _Bad("binary_file", f"a NUL byte at byte {nul}: binary data, not JSON "
                                                                "text; file skipped")


def _lines(path: Path) -> Iterator[bytes | _Bad]:
    """The lines of a file; a gzip stream that breaks ends them with a `_Bad` (the lines before it are kept)."""
    n_bytes = 0
    with _open(path) as f:
        try:
            for raw in f:
                n_bytes += len(raw)
                yield raw
        except _GZIP_ERRORS as e:
            yield _gzip_bad(e, n_bytes)


def _iter_jsonl(path: Path, shown: str) -> Iterator[tuple[Location, Any]]:
    if (binary := _binary(path)) is not None:
        yield Location(shown, line=binary[0], index=0), binary[1]
        return
    index = 0
    for lineno, raw in enumerate(_lines(path), 1):
        loc = Location(shown, line=lineno, index=index)
        if isinstance(raw, _Bad):
            yield loc, raw
            return
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


def _read_all(path: Path) -> tuple[bytes, Optional[_Bad]]:
    """The whole file, and how its gzip stream broke (None: it did not); a broken one gives what came before."""
    chunks: list[bytes] = []
    try:
        with _open(path) as f:
            while block := f.read1(1 << 20):  # read1: what a break leaves behind is kept
                chunks.append(block)
    except _GZIP_ERRORS as e:
        return b"".join(chunks), _gzip_bad(e, sum(map(len, chunks)))
    return b"".join(chunks), None


class _Text:
    """A JSON file's decoded text, with text positions -> lines and byte offsets in the file (asked for in
    increasing order: one pass over the text). Undecodable bytes are kept as marked characters
    (`surrogateescape`), so the records around one still decode and only the record holding it is lost."""

    def __init__(self, raw: bytes, broken: Optional[_Bad]):
        self.bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
        data = memoryview(raw)[self.bom:]  # no copy of the bytes
        try:
            self.text, self.any_bad_byte = str(data, "utf-8"), False
        except UnicodeDecodeError:
            self.text, self.any_bad_byte = str(data, "utf-8", "surrogateescape"), True
        self.n_bytes = len(raw)
        self.broken = broken  # the gzip stream's break, where the text ends
        self._pos, self._line, self._byte = 0, 1, self.bom

    def _advance(self, pos: int) -> None:
        if pos < self._pos:
            self._pos, self._line, self._byte = 0, 1, self.bom
        seg = self.text[self._pos:pos]
        self._line += seg.count("\n")
        self._byte += len(seg.encode("utf-8", "surrogateescape"))
        self._pos = pos

    def line(self, pos: int) -> int:
        self._advance(pos)
        return self._line

    def byte(self, pos: int) -> int:
        self._advance(pos)
        return self._byte

    def bad_byte(self, start: int, end: int) -> Optional[_Bad]:
        """`not_utf8` for the record at text[start:end] when it holds an undecodable byte."""
        m = _BAD_BYTE.search(self.text, start, end) if self.any_bad_byte else None
        return None if m is None else _Bad("not_utf8", f"byte {self.byte(m.start())}")

    def ends_at(self, pos: int) -> bool:
        return _WS.match(self.text, pos).end() == len(self.text)

    def cut(self, where: str) -> _Bad:
        """The text ends early: the gzip stream broke there, or the file was cut short."""
        if self.broken is not None:
            return self.broken
        return _Bad("invalid_json", f"file cut short: it ends at byte {self.n_bytes}, {where}")

    def error(self, pos: int, msg: str, rest: bool = True) -> _Bad:
        """A JSON syntax error at text position `pos`: an undecodable byte there, the end of a file cut short
        (or of a broken gzip stream), or plain bad JSON. `rest`: the records after it are lost too."""
        tail = "; rest of file unread" if rest else ""
        if self.any_bad_byte and _BAD_BYTE.match(self.text, pos):
            return _Bad("not_utf8", f"byte {self.byte(pos)}{tail}")
        # Only the end of the text leaves a string unterminated (json's scanner).
        if msg.startswith("Unterminated string") or self.ends_at(pos):
            return self.cut("inside this record")
        column = pos - self.text.rfind("\n", 0, pos)
        return _Bad("invalid_json", f"{msg} at line {self.line(pos)} column {column} (byte {self.byte(pos)}){tail}")


def _iter_json(path: Path, shown: str) -> Iterator[tuple[Location, Any]]:
    if (binary := _binary(path)) is not None:
        yield Location(shown, line=binary[0]), binary[1]
        return
    raw, broken = _read_all(path)
    doc = _Text(raw, broken)
    text = doc.text
    start = _WS.match(text).end()
    if start == len(text):
        yield Location(shown, line=1), broken or _Bad("invalid_json", "empty file")
        return
    if text.startswith("[", start):
        yield from _iter_json_list(doc, start, shown)
        return
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        yield Location(shown, line=doc.line(e.pos)), doc.error(e.pos, e.msg, rest=False)
        return
    if _WS.match(text, end).end() < len(text):
        # More than one top-level value: JSON Lines under a .json name.
        yield from _iter_jsonl(path, shown)
        return
    yield Location(shown, line=doc.line(start), index=0, json_list=True), doc.bad_byte(start, end) or obj
    if broken is not None:
        yield Location(shown, line=doc.line(len(text)), index=1, json_list=True), broken


def _list_ends(text: str, pos: int) -> bool:
    """The list closes at `pos` and nothing but white space follows."""
    return text.startswith("]", pos) and _WS.match(text, pos + 1).end() == len(text)


def _iter_json_list(doc: _Text, start: int, shown: str) -> Iterator[tuple[Location, Any]]:
    """Decode a top-level JSON list element by element, so each record knows its index and first line, and a
    record with a bad byte costs only itself."""
    text = doc.text
    pos = _WS.match(text, start + 1).end()
    index = 0
    while not (index == 0 and _list_ends(text, pos)):  # `[]` holds no record
        loc = Location(shown, line=doc.line(pos), index=index, json_list=True)
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # A syntax error inside a list leaves no reliable resync point: the rest of the file is lost.
            yield loc, doc.error(e.pos, e.msg)
            return
        yield loc, doc.bad_byte(pos, end) or obj
        index += 1
        pos = _WS.match(text, end).end()
        if _list_ends(text, pos):
            break
        if not text.startswith(",", pos):
            loc = Location(shown, line=doc.line(pos), index=index, json_list=True)
            yield loc, (doc.cut("before the list's closing ']'") if doc.ends_at(pos) else
                        doc.error(pos, "expected ',' or a final ']' after the previous record"))
            return
        pos = _WS.match(text, pos + 1).end()
    if doc.broken is not None:  # the list closed, but the stream broke after it
        yield Location(shown, line=doc.line(len(text)), index=index, json_list=True), doc.broken


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


def _check_length(text: str, what: str, max_chars: Optional[int]) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise _Bad("turn_too_long", f"{what}: {len(text):,} characters, data.max_turn_chars={max_chars:,}")


def _validate(msgs: list[dict], max_turn_chars: Optional[int] = None) -> tuple[list[dict], bool]:
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
        _check_length(content, f"turn {i} ({role})", max_turn_chars)
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


def _to_conversation(rec: Any, fmt: str = "auto", default_id: str = "", columns: Optional[Mapping] = None,
                     max_turn_chars: Optional[int] = None):
    """One raw record -> (Conversation, leading_assistant_dropped). Raises `_Bad` for a bad record."""
    if not isinstance(rec, Mapping):
        raise _Bad("invalid_json", f"record is a {type(rec).__name__}, not an object")
    if columns:
        rec = _apply_columns(rec, columns)
    if fmt in ("auto", "hf"):
        fmt = _detect_format(rec)
    msgs, meta = _PARSERS[fmt](rec)
    msgs, dropped = _validate(msgs, max_turn_chars)
    for i, turn in enumerate(meta.get("followup_turns", ()), 1):
        _check_length(turn, f"turns[{i}]", max_turn_chars)
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
    max_turn_chars: Optional[int] = DataConfig.max_turn_chars,
) -> Iterator[dict]:
    """Yield the Conversations of one source; bad records go to `report` (or raise `BadRecordError` at
    the first one when `on_bad_record="fail"`). `limit` counts yielded records. `seen_ids` (shared by
    `read_sources`) extends the id-uniqueness check beyond this source; `prompts` leaves out repeated and
    held-out prompts (counted in `report` as skipped, with their locations); a turn longer than
    `max_turn_chars` (data.max_turn_chars) rejects its record."""
    on_bad_record = OnBadRecord.parse(on_bad_record, "data.on_bad_record")
    if src.limit is not None and src.limit <= 0:
        return
    seen = set() if seen_ids is None else seen_ids
    n_yielded = 0
    for prefix, loc, rec in _located_records(src):
        try:
            if isinstance(rec, _Bad):
                raise rec
            conv, dropped = _to_conversation(rec, src.format, f"{prefix}-{loc.index}", src.columns, max_turn_chars)
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
        yield from read_source(src, report, cfg.on_bad_record, seen_ids=seen, prompts=prompts,
                               max_turn_chars=cfg.max_turn_chars)
