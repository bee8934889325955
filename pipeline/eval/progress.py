"""Resumable eval: finished questions are appended to `answers.partial.jsonl` (one line per question, after
a header line naming the run's identity), so a killed or time-budgeted eval continues where it stopped.
A file written by another run (settings, head, question file) is refused unless `overwrite` discards it."""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
from pathlib import Path
from typing import Optional

from pipeline.eval.evaluate import TurnRecord, record_dict
from pipeline.files import atomic_write_text, text_lines

log = logging.getLogger(__name__)

PARTIAL = "answers.partial.jsonl"
_FIELDS = {f.name for f in dataclasses.fields(TurnRecord)}


class EvalProgress:
    def __init__(self, out_dir: Path, identity: dict, overwrite: bool = False):
        self.path = Path(out_dir) / PARTIAL
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
        self.done: dict[str, list[TurnRecord]] = {}
        if self.path.exists():
            self._load(overwrite)
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_line({"identity": self.identity})

    def _load(self, overwrite: bool) -> None:
        identity, self.done, kept_lines = read_answers(self.path)
        if identity != self.identity:
            if not overwrite:
                raise ValueError(f"{self.path}: partial eval of another run (settings, head or questions "
                                 "differ); rerun with eval.overwrite=true to discard it")
            log.warning("discarding %s (another run)", self.path)
            self.path.unlink()
            self.done = {}
            return
        if kept_lines is not None:
            log.warning("%s:%d: dropping a torn last line", self.path, len(kept_lines) + 1)
            atomic_write_text(self.path, "".join(line + "\n" for line in kept_lines))
        if self.done:
            log.info("resuming eval: %d questions already answered (%s)", len(self.done), self.path)

    def append(self, question_id: str, records: list[TurnRecord]) -> None:
        self.done[question_id] = records
        self._write_line({"question_id": question_id, "turns": [record_dict(r) for r in records]})

    def _write_line(self, doc: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_answers(path: Path) -> tuple[dict, dict[str, list[TurnRecord]], Optional[list[str]]]:
    """(identity, question id -> turn records, the intact lines if the last one is torn else None) of an
    answers file (or its gzipped copy in a results store, pipeline/eval/results_store.py). A kill mid-write leaves
    at most the last line torn; corruption elsewhere is an error."""
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = text_lines(data.decode("utf-8"))
    identity = json.loads(lines[0]).get("identity") if lines else None
    done: dict[str, list[TurnRecord]] = {}
    for n, line in enumerate(lines[1:], start=2):
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            if n != len(lines):
                raise ValueError(f"{path}:{n}: corrupt line in the middle of the file") from None
            return identity, done, lines[: n - 1]
        done[doc["question_id"]] = [TurnRecord(**{k: v for k, v in r.items() if k in _FIELDS}) for r in doc["turns"]]
    return identity, done, None
