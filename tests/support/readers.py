"""Source files for the data readers' tests (test_readers.py, shared with test_hostile.py): writing JSON lines,
reading one source with its bad-record report, and a ShareGPT record."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.config import SourceConfig
from pipeline.data.readers import read_source


def _write_jsonl(path: Path, rows: list) -> Path:
    """rows: dicts (dumped) or raw strings (written verbatim, to make broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _read(path, report=None, **kw) -> tuple[list[dict], BadRecordReport]:
    report = report if report is not None else BadRecordReport()
    return list(read_source(SourceConfig(path=str(path), **kw), report)), report


def _sg(*turns, **extra) -> dict:
    return {**extra, "conversations": [{"from": f, "value": v} for f, v in turns]}
