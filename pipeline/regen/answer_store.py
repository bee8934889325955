"""Regenerated answers that outlive the machine (`regen.answer_store=<folder>`): a small, committable copy of a
regen run's progress that holds the target's answers and never a prompt.

    <store>/store.json          the run it belongs to (state/run.json: plan digest, generation, target), the
                                done-markers of its finished shards, its saved batches' stats and failures
    <store>/answers.jsonl.gz    one line per finished conversation: {id, in: shard|batch|journal, unit, answers}

The prompts stay in the data sources. A restore rebuilds every record from this run's conversations (read from
the sources) and the stored answers, so a finished shard comes back byte for byte: its sha256 is checked against
its done-marker. It restores only into the same run: the plan digest covers every conversation's id, system
prompt and user turns, so a source whose text changed (or another selection, batch size, backend, generation
setting or target) is refused, naming what differs. Only what the folder lacks is restored; a rerun then
generates what neither holds.

    python -m pipeline.regen.answer_store save outputs/<experiment>/regen answers/<experiment>   # any time
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable, Iterator, Optional

from pipeline.files import atomic_file, atomic_write_text, text_lines

from .batching import Plan, RegenItem
from .shards import ConversationJournal, RegenDir, RegenStateError, shard_text
from .waves import Answer, BatchResult, to_sharegpt

log = logging.getLogger(__name__)
META, ANSWERS = "store.json", "answers.jsonl.gz"
FORMAT = 1


def _answers_of(record: dict) -> dict:
    """A finished record's part that is the target's: its answers in turn order and its degenerate-turn flags."""
    out = {"id": record["id"], "answers": [t["value"] for t in record["conversations"] if t["from"] == "gpt"]}
    if record.get("regen_flags"):
        out["flags"] = record["regen_flags"]
    return out


def _jsonl(path: Path) -> Iterator[dict]:
    for line in text_lines(path.read_text(encoding="utf-8")):
        if line.strip():
            yield json.loads(line)


def _journal_lines(path: Path) -> Iterator[dict]:
    """A journal's complete lines (a kill may have cut the last one: that conversation was not finished)."""
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            yield json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue


def save(regen_dir: Path, store_dir: Path) -> dict:
    """Copies the answers of every finished shard, saved batch and journaled conversation of `regen_dir` into
    `store_dir` (replacing what it held; each file atomically). Returns the counts."""
    out = RegenDir(Path(regen_dir))
    if not out.run_path.exists():
        raise RegenStateError(f"{out.root}: no regen run to save (no {out.run_path})")
    meta = {"format": FORMAT, "identity": json.loads(out.run_path.read_text()), "shards": {}, "batches": {}}
    lines = []
    for marker_path in sorted((out.state / "done").glob("shard-*.json")):
        shard = int(marker_path.stem.removeprefix("shard-"))
        if not out.shard_done(shard):
            continue
        marker = json.loads(marker_path.read_text())
        errors = list(_jsonl(out.error_path(shard))) if out.error_path(shard).exists() else []
        meta["shards"][str(shard)] = {"marker": marker, "errors": errors}
        lines += [{**_answers_of(r), "in": "shard", "unit": shard} for r in _jsonl(out.shard_path(shard))]
    for batch_path in sorted((out.state / "batches").glob("batch-*.json")):
        batch = int(batch_path.stem.removeprefix("batch-"))
        result = BatchResult.from_dict(json.loads(batch_path.read_text()))
        meta["batches"][str(batch)] = {"stats": result.stats, "failures": result.failures}
        lines += [{**_answers_of(r), "in": "batch", "unit": batch} for r in result.records]
    for journal_path in sorted((out.state / "journal").glob("batch-*.jsonl")):
        batch = int(journal_path.stem.removeprefix("batch-"))
        if str(batch) in meta["batches"]:
            continue  # a batch file written just before its journal's removal holds them all
        lines += [{"id": e["id"], "in": "journal", "unit": batch, "answers": e["answers"], "elapsed_s": e["elapsed_s"]}
                  for e in _journal_lines(journal_path) if e is not None]
    meta["conversations"] = len(lines)
    meta["answer_chars"] = sum(len(a if isinstance(a, str) else a["text"]) for e in lines for a in e["answers"])
    store_dir = Path(store_dir)
    with atomic_file(store_dir / ANSWERS, "wb") as f:
        # mtime 0: the same answers give the same bytes, so a commit changes only with the answers.
        with gzip.GzipFile(fileobj=f, mode="wb", mtime=0, compresslevel=9) as gz:
            gz.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in lines).encode("utf-8"))
    atomic_write_text(store_dir / META, json.dumps(meta, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    counts = {"conversations": len(lines), "shards": len(meta["shards"]), "batches": len(meta["batches"]),
              "answer_chars": meta["answer_chars"], "bytes": (store_dir / ANSWERS).stat().st_size}
    log.info("answer store %s: %s", store_dir, counts)
    return counts


def _load(store_dir: Path) -> tuple[dict, dict[tuple[str, int], list[dict]]]:
    meta = json.loads((store_dir / META).read_text())
    if meta.get("format") != FORMAT:
        raise RegenStateError(f"{store_dir / META}: store format {meta.get('format')}, this eaglet reads {FORMAT}")
    units: dict[tuple[str, int], list[dict]] = {}
    with gzip.open(store_dir / ANSWERS, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                e = json.loads(line)
                units.setdefault((e["in"], int(e["unit"])), []).append(e)
    return meta, units


def _records(entries: list[dict], items: dict[str, RegenItem], where: str) -> list[dict]:
    """The records of a finished unit, rebuilt from this run's conversations and the stored answers."""
    records = []
    for e in entries:
        if e["id"] not in items:
            raise RegenStateError(f"{where}: conversation {e['id']!r} is not in this run's input")
        answers = [Answer(text, 0, "stop") for text in e["answers"]]
        records.append(to_sharegpt(items[e["id"]], answers, e.get("flags") or {}))
    return records


def restore(out: RegenDir, identity: dict, plan: Plan, items: list[RegenItem], store_dir: Path,
            shards: Optional[Iterable[int]] = None) -> int:
    """Writes into `out` what the store holds and `out` lacks (finished shards, saved batches, journaled
    conversations) for the run `identity`, of `shards` only (a rank's; None: all). Returns the number of
    conversations restored."""
    store_dir = Path(store_dir)
    if not (store_dir / META).exists():
        log.info("regen.answer_store=%s: nothing stored yet", store_dir)
        return 0
    meta, units = _load(store_dir)
    theirs = meta["identity"]
    if theirs != json.loads(json.dumps(identity)):
        diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
        hint = (" (the plan digest covers every conversation's id, system prompt and user turns: a source changed, "
                "or the selection or batching did)" if "plan" in diff else "")
        raise RegenStateError(f"{store_dir}: its answers belong to a regen run with other {', '.join(diff)}{hint}: "
                              f"stored {json.dumps({k: theirs.get(k) for k in diff}, sort_keys=True)}, this run "
                              f"{json.dumps({k: identity.get(k) for k in diff}, sort_keys=True)}")
    by_id = {it.id: it for it in items}
    mine = set(range(plan.n_shards) if shards is None else shards)
    my_batches = {b for s in mine for b in plan.shard_batches(s)}
    restored = 0
    for key, stored in sorted(meta["shards"].items(), key=lambda kv: int(kv[0])):
        shard = int(key)
        if shard not in mine or out.shard_done(shard):
            continue
        text = shard_text(_records(units.get(("shard", shard), []), by_id, f"{store_dir} shard {shard}"))
        if hashlib.sha256(text.encode()).hexdigest() != stored["marker"]["sha256"]:
            raise RegenStateError(f"{store_dir}: shard {shard} rebuilt from the sources and the stored answers "
                                  f"differs from the one saved (sha256): the sources changed; remove {store_dir} "
                                  f"to regenerate")
        atomic_write_text(out.shard_path(shard), text)
        if stored["errors"]:
            atomic_write_text(out.error_path(shard), shard_text(stored["errors"]))
        atomic_write_text(out.done_path(shard), json.dumps(stored["marker"], indent=1, sort_keys=True) + "\n")
        out.drop_batches(plan.shard_batches(shard))
        restored += stored["marker"]["conversations"]
    done_batches = {b for s in range(plan.n_shards) if out.shard_done(s) for b in plan.shard_batches(s)}
    for key, stored in meta["batches"].items():
        batch = int(key)
        if batch not in my_batches or batch in done_batches or out.batch_path(batch).exists():
            continue
        records = _records(units.get(("batch", batch), []), by_id, f"{store_dir} batch {batch}")
        out.save_batch(batch, BatchResult(records, stored["failures"], stored["stats"]))
        restored += len(records)
    for (where, batch), entries in units.items():
        if where != "journal" or batch not in my_batches or batch in done_batches or out.batch_path(batch).exists():
            continue
        journal = ConversationJournal(out.journal_path(batch), [items[i].id for i in plan.batches[batch]])
        have, _ = journal.load()
        for e in entries:
            if e["id"] not in have:
                journal.record(e["id"], [Answer(**a) for a in e["answers"]], e["elapsed_s"])
                restored += 1
    log.info("regen.answer_store=%s: %d conversations restored", store_dir, restored)
    return restored


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["save"])
    ap.add_argument("regen_dir", type=Path)
    ap.add_argument("store_dir", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(json.dumps(save(args.regen_dir, args.store_dir)))


if __name__ == "__main__":
    main()
