"""Regen output directory: complete shards only, crash-safe resumption, multi-rank bookkeeping.

    regen/
      manifest.json                 written last, once every shard is done, by the rank that finds them so
      shards/shard-00000.jsonl      ShareGPT records; only complete shards ever carry this name
      errors/shard-00000.jsonl      requests that failed for good: {id, turn, reason, detail, attempts}
      state/run.json                what this directory is a run of (plan digest, generation, target)
      state/batches/batch-000000.json   finished batches of a shard not yet complete
      state/journal/batch-000000.jsonl  finished conversations of a batch not yet finished (server schedule;
                                        either schedule: those an answer store restored)
      state/done/shard-00000.json   shard done-marker: its counts, sha256, the rank that wrote it, its records' tokens

Every file is written to a `*.tmp` name and renamed into place, so a `kill -9` at any moment leaves either the
whole file or none (a temporary name never matches `*.json*`, so readers never see it). A shard is complete
when its done-marker exists; the marker is written after the shard and its error file, and batch files are
deleted only after it. A rerun therefore finds each batch either inside a complete shard, or as a batch file,
or not at all (then it is generated again), and writes each conversation exactly once. Inside an unfinished
batch, the journal keeps each finished conversation as one appended line (a kill can cut only the last
line, which is then ignored): a rerun asks only the conversations it lacks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Optional

from pipeline.data.config import SourceConfig
from pipeline.files import atomic_write_text
from pipeline.regen.batching import RegenItem
from pipeline.regen.waves import Answer, BatchResult

log = logging.getLogger(__name__)


class RegenStateError(RuntimeError):
    pass


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=1) + "\n"


class RegenDir:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.shards = self.root / "shards"
        self.errors = self.root / "errors"
        self.state = self.root / "state"

    def shard_path(self, shard: int) -> Path:
        return self.shards / f"shard-{shard:05d}.jsonl"

    def error_path(self, shard: int) -> Path:
        return self.errors / f"shard-{shard:05d}.jsonl"

    def done_path(self, shard: int) -> Path:
        return self.state / "done" / f"shard-{shard:05d}.json"

    def batch_path(self, batch: int) -> Path:
        return self.state / "batches" / f"batch-{batch:06d}.json"

    def journal_path(self, batch: int) -> Path:
        return self.state / "journal" / f"batch-{batch:06d}.jsonl"

    @property
    def run_path(self) -> Path:
        return self.state / "run.json"

    # -- run identity -------------------------------------------------------------------------------------

    def claim(self, identity: dict, overwrite: bool = False, single_rank: bool = True) -> bool:
        """Binds the directory to this run. Returns True when it resumes an earlier run of the same identity;
        refuses a directory holding another run (other input, plan, generation settings or target)."""
        if self.run_path.exists():
            theirs = json.loads(self.run_path.read_text())
            if theirs == identity:
                return True
            if not overwrite:
                diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
                raise RegenStateError(
                    f"{self.root} holds a regen run with different {', '.join(diff)}:\n"
                    f"  existing: {json.dumps({k: theirs.get(k) for k in diff}, sort_keys=True)}\n"
                    f"  this run: {json.dumps({k: identity.get(k) for k in diff}, sort_keys=True)}\n"
                    f"rerun with regen.overwrite=true (single rank) or remove the directory")
            if not single_rank:
                raise RegenStateError("regen.overwrite=true needs a single rank (ranks would delete each "
                                      "other's shards); clear the directory first")
            log.warning("regen.overwrite=true: removing the previous run in %s", self.root)
            for sub in (self.shards, self.errors, self.state):
                shutil.rmtree(sub, ignore_errors=True)
            (self.root / "manifest.json").unlink(missing_ok=True)
        atomic_write_text(self.run_path, _dumps(identity))  # every rank writes the same content
        return False

    def remove_stale_tmp(self) -> None:
        """Temporary files of killed processes (single rank only: others' may be in flight)."""
        for d in (self.root, self.shards, self.errors, self.state, self.state / "batches", self.state / "done"):
            for tmp in d.glob(".*.tmp") if d.is_dir() else ():
                tmp.unlink(missing_ok=True)

    # -- batches and shards -------------------------------------------------------------------------------

    def shard_done(self, shard: int) -> bool:
        return self.done_path(shard).exists() and self.shard_path(shard).exists()

    def load_batch(self, batch: int) -> Optional[BatchResult]:
        path = self.batch_path(batch)
        return BatchResult.from_dict(json.loads(path.read_text())) if path.exists() else None

    def save_batch(self, batch: int, result: BatchResult) -> None:
        atomic_write_text(self.batch_path(batch), json.dumps(result.to_dict(), ensure_ascii=False))
        self.journal_path(batch).unlink(missing_ok=True)  # the batch file now holds every conversation

    def journal(self, batch: int, items: list[RegenItem]) -> "ConversationJournal":
        return ConversationJournal(self.journal_path(batch), items)

    def drop_batches(self, batches) -> None:
        for b in batches:
            self.batch_path(b).unlink(missing_ok=True)
            self.journal_path(b).unlink(missing_ok=True)

    def finish_shard(self, shard: int, batches: range, results: list[BatchResult], rank: int) -> dict:
        records = [r for res in results for r in res.records]
        failures = [f for res in results for f in res.failures]
        text = shard_text(records)
        atomic_write_text(self.shard_path(shard), text)
        if failures:
            atomic_write_text(self.error_path(shard), shard_text(failures))
        else:
            self.error_path(shard).unlink(missing_ok=True)  # left by an earlier, failed attempt
        marker = {
            "shard": shard,
            "path": str(self.shard_path(shard).relative_to(self.root)),
            "errors": str(self.error_path(shard).relative_to(self.root)) if failures else None,
            "batches": [batches.start, batches.stop],
            "rank": rank,
            "conversations": len(records),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "stats": sum_stats([res.stats for res in results]),
            # Per record, its answers' tokens per turn (the records hold only text): an answer store keeps them.
            "answer_tokens": {k: v for res in results for k, v in res.tokens.items()},
        }
        atomic_write_text(self.done_path(shard), _dumps(marker))
        self.drop_batches(batches)
        return marker

    def markers(self, n_shards: int) -> list[Optional[dict]]:
        return [json.loads(self.done_path(s).read_text()) if self.shard_done(s) else None for s in range(n_shards)]

    def manifest_written(self, plan_digest: str, markers: list[dict]) -> bool:
        """Whether manifest.json is complete and lists exactly these shards (then it is left as it is: the
        next stage may be reading it already)."""
        path = self.root / "manifest.json"
        from pipeline.manifest import RegenManifest

        try:
            manifest = RegenManifest.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return False
        return (manifest.complete and manifest.plan.get("digest") == plan_digest
                and [s.get("sha256") for s in manifest.shards] == [m["sha256"] for m in markers])


class ConversationJournal:
    """Finished conversations of one batch, one JSON line each, appended and fsynced as they finish
    (`waves.Journal`). The run's identity (plan digest) fixes which conversations a batch holds; a line
    naming another conversation means the directory was tampered with, and stops the run. Each line carries
    its conversation's item digest (RegenItem.digest), so an answer store can tell which prompt it answers."""

    def __init__(self, path: Path, items: list[RegenItem]):
        self.path = Path(path)
        self.digests = {item.id: item.digest() for item in items}
        self.ids = set(self.digests)
        self.lock = threading.Lock()

    def load(self) -> tuple[dict[str, list[Answer]], float]:
        if not self.path.exists():
            return {}, 0.0
        finished, spent = {}, 0.0
        lines = self.path.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if n >= len(lines) - 1:  # the last line, cut by a kill: that conversation is asked again
                    log.info("%s:%d: incomplete last line (a killed run), ignored", self.path, n)
                    continue
                raise RegenStateError(f"{self.path}:{n}: not a JSON line; remove the file to regenerate "
                                      f"this batch from scratch") from None
            if entry["id"] not in self.ids:
                raise RegenStateError(f"{self.path}:{n}: conversation {entry['id']!r} is not in this batch; "
                                      f"remove the file to regenerate the batch from scratch")
            finished[entry["id"]] = [Answer(**a) for a in entry["answers"]]
            spent = max(spent, entry["elapsed_s"])
        if finished:
            log.info("%s: resuming a batch with %d of %d conversations finished", self.path, len(finished),
                     len(self.ids))
        return finished, spent

    def record(self, conversation_id: str, answers: list[Answer], elapsed_s: float) -> None:
        line = json.dumps({"id": conversation_id, "digest": self.digests[conversation_id], "elapsed_s": elapsed_s,
                           "answers": [a.to_dict() for a in answers]}, ensure_ascii=False) + "\n"
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())


def shard_text(records: list[dict]) -> str:
    """A shard's (or its error file's) bytes: one JSON line per record. The shard's sha256 is its done-marker's,
    checked by readers and by a restore from an answer store."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def sum_stats(stats: list[dict]) -> dict:
    total: dict = {}
    for s in stats:
        for key, value in s.items():
            if isinstance(value, dict):
                total[key] = dict(Counter(total.get(key, {})) + Counter(value))
            else:
                total[key] = total.get(key, 0) + value
    return total


def regen_sources(regen_dir: Path) -> list[SourceConfig]:
    """Data-layer sources of a finished regen run (the shards its manifest lists), for the next stage."""
    from pipeline.manifest import ManifestError, RegenManifest, file_problem

    manifest = RegenManifest.load(regen_dir)
    for s in manifest.shards:  # a changed answer file would silently train on other text
        if problem := file_problem(Path(regen_dir) / s["path"], None, s.get("sha256")):
            done = RegenDir(regen_dir).done_path(int(Path(s["path"]).stem.removeprefix("shard-")))
            raise ManifestError(f"regen {regen_dir}: shard {s['path']}: {problem}; delete it and {done}, then rerun "
                                f"the regen stage: it regenerates that shard only")
    return [SourceConfig(path=str(Path(regen_dir) / s["path"]), format="sharegpt",
                         id_prefix=Path(s["path"]).stem) for s in manifest.shards]
