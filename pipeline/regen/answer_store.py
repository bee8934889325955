"""Regenerated answers that outlive the machine (`regen.answer_store=<folder>`): a small, committable copy of a
regen run's progress that holds the target's answers and never a prompt.

    <store>/store.json          the run it was last saved from (state/run.json: plan digest, generation, target),
                                the done-markers of its finished shards, its saved batches' stats and failures
    <store>/answers.jsonl.gz    one line per stored conversation: {id, digest, in: shard|batch|journal|kept, unit,
                                answers, tokens}

Each stored conversation carries its digest (`answer_digest`): a hash of what determines its answers, i.e. its
item digest (RegenItem.digest: the id its source gives it, the system prompt, the user turns) and the run's
answer settings (`answer_settings`: engine and served model, max_new_tokens, sampling and seed, thinking mode,
the target's config, tokenizer with chat template, and weights). Digests only: the prompts stay in the sources.

A restore brings back what the output folder lacks:
- into the same run (same identity: plan, settings), each finished shard byte for byte (rebuilt from the sources
  and the answers, its sha256 checked against its done-marker), saved batches and journaled conversations;
- into a run of another plan (a source's `limit` raised, conversations added or changed, another batching), per
  conversation: each conversation of the new plan whose digest a stored one has gets those answers, written to
  its batch's journal as finished (`Answer.restored`), so the run generates only the others. A stored
  conversation whose prompt changed is generated again; the restore counts those in one line. The shards and
  the regen manifest then count restored and generated conversations apart (`conversations_restored`).
Other answer settings (another target, engine, max_new_tokens, ...) match no conversation: the restore refuses
in one line naming them, since the run's save would otherwise replace the store's answers.

A save never drops a stored answer: the store's conversations that the saved folder does not hold (not in its
plan, or their prompt changed since) are kept (`in: kept`), under the same answer settings only.

A store of format 1 (eaglet before per-conversation restore) has no digests and no per-conversation tokens of
finished shards. It still restores into the same run, and `upgrade` gives it digests: it reads the sources
under the store's run's config, checks that they give the stored plan digest, and digests every conversation.

    python -m pipeline.answers save outputs/<experiment>/regen answers/<experiment>   # any time
    python -m pipeline.answers upgrade answers/<experiment> experiment=<experiment> [overrides]
    python -m pipeline.answers check answers/<experiment> experiment=<experiment> [overrides]
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from pipeline.files import atomic_file, atomic_write_text, text_lines

from .batching import Plan, RegenItem, make_plan, read_items
from .shards import RegenDir, RegenStateError, shard_text
from .waves import Answer, BatchResult, item_of_record, to_sharegpt

log = logging.getLogger(__name__)
META, ANSWERS = "store.json", "answers.jsonl.gz"
FORMAT = 2
READS = (1, 2)
# Settings of a run that shape its plan or its records, not a conversation's answers. (`system_prompt` is part of
# each conversation's own system prompt, which its item digest covers.)
PLAN_ONLY = ("batch_size", "batches_per_shard", "on_degenerate", "system_prompt")


def answer_settings(identity: dict) -> dict:
    """What, besides a conversation's own prompt, determines its answers: a run identity's generation settings
    (engine, served model, max_new_tokens, sampling, seed, thinking mode, precision, ...) and its target's
    fingerprint (config; tokenizer and chat template; weights)."""
    generation = {k: v for k, v in (identity.get("generation") or {}).items() if k not in PLAN_ONLY}
    return json.loads(json.dumps({"generation": generation, "target": identity.get("target")}))


def answer_digest(settings: dict, item_digest: str) -> str:
    """A conversation's answers' identity: sha256 (first 32 hex digits) of the answer settings and its item digest
    (RegenItem.digest). Equal digests: the same prompt answered under the same settings."""
    doc = json.dumps({"settings": settings, "item": item_digest}, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def _settings_diff(theirs: dict, mine: dict) -> str:
    keys = sorted({(part, k) for part in ("generation", "target") for d in (theirs, mine)
                   for k in (d.get(part) or {})})
    diff = [(f"{part}.{k}", (theirs.get(part) or {}).get(k), (mine.get(part) or {}).get(k)) for part, k in keys]
    return "; ".join(f"{name}: stored {json.dumps(a)}, this run {json.dumps(b)}" for name, a, b in diff if a != b)


# -- entries ------------------------------------------------------------------------------------------------------

def _texts(entry: dict) -> list[str]:
    return [a if isinstance(a, str) else a["text"] for a in entry["answers"]]


def _turn_tokens(entry: dict) -> Optional[list[int]]:
    if entry["answers"] and not isinstance(entry["answers"][0], str):
        return [a["n_tokens"] for a in entry["answers"]]
    return entry.get("tokens")


def _answers(entry: dict, restored: bool) -> list[Answer]:
    """A stored conversation's answers as the run holds them: a record's cut turns (flag `truncated`) ended at
    max_new_tokens, the others at the end of their turn."""
    if entry["answers"] and not isinstance(entry["answers"][0], str):  # a journal's: whole answers
        return [Answer(**{**a, "restored": restored or a.get("restored", False)}) for a in entry["answers"]]
    cut = set((entry.get("flags") or {}).get("truncated", []))
    tokens = entry.get("tokens") or [0] * len(entry["answers"])
    return [Answer(text, n, "length" if turn in cut else "stop", restored)
            for turn, (text, n) in enumerate(zip(entry["answers"], tokens))]


def _record_entry(record: dict, settings: dict, tokens: Optional[list[int]], where: str, unit: int) -> dict:
    """A finished record's part that is the target's (answers in turn order, degenerate-turn flags, tokens per
    turn) and its digest, computed from the prompt the record itself holds."""
    out = {"id": record["id"], "digest": answer_digest(settings, item_of_record(record).digest()),
           "answers": [t["value"] for t in record["conversations"] if t["from"] == "gpt"], "in": where, "unit": unit}
    if record.get("regen_flags"):
        out["flags"] = record["regen_flags"]
    if tokens is not None:
        out["tokens"] = tokens
    return out


def _estimate_tokens(entries: list[dict], total: int, max_new_tokens: int) -> int:
    """Per-turn tokens for the entries of one finished unit (a shard, a batch) that lack them (a format-1 store, a
    folder of an older eaglet: the records hold only text), from the unit's exact total: a turn cut at
    max_new_tokens has exactly that many, the rest is shared among the other turns by their answers' length
    (largest remainders), so the unit's sum stays exact. Marks them `tokens_estimated`; returns how many."""
    todo = [e for e in entries if _turn_tokens(e) is None]
    if not todo:
        return 0
    rest = total - sum(sum(_turn_tokens(e)) for e in entries if _turn_tokens(e) is not None)
    for e in todo:
        e["tokens"] = [max_new_tokens if t in set((e.get("flags") or {}).get("truncated", [])) else None
                       for t in range(len(e["answers"]))]
        e["tokens_estimated"] = True
    rest -= sum(n for e in todo for n in e["tokens"] if n is not None)
    open_turns = [(e, t, len(e["answers"][t]) + 1) for e in todo for t, n in enumerate(e["tokens"]) if n is None]
    weight = sum(w for _, _, w in open_turns)
    shares = [(e, t, max(rest, 0) * w / weight) for e, t, w in open_turns] if weight else []
    for e, t, share in shares:
        e["tokens"][t] = int(share)
    left = max(rest, 0) - sum(int(s) for _, _, s in shares)
    for e, t, _ in sorted(shares, key=lambda x: int(x[2]) - x[2])[:left]:
        e["tokens"][t] += 1
    return len(todo)


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


def _load(store_dir: Path) -> tuple[dict, list[dict]]:
    meta = json.loads((store_dir / META).read_text())
    if meta.get("format") not in READS:
        raise RegenStateError(f"{store_dir / META}: store format {meta.get('format')}, this eaglet reads "
                              f"{', '.join(map(str, READS))}")
    with gzip.open(store_dir / ANSWERS, "rt", encoding="utf-8") as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return meta, entries


def stored_backend(store_dir: Path) -> Optional[str]:
    """The regen engine (`generation.backend`) that answered the store's conversations; None where nothing is
    stored yet."""
    if not (Path(store_dir) / META).exists():
        return None
    meta = json.loads((Path(store_dir) / META).read_text())
    return ((meta.get("identity") or {}).get("generation") or {}).get("backend")


def _write(store_dir: Path, meta: dict, lines: list[dict]) -> dict:
    meta = {**meta, "format": FORMAT, "conversations": len(lines),
            "answer_chars": sum(len(t) for e in lines for t in _texts(e))}
    meta["kept"] = sum(e["in"] == "kept" for e in lines)
    store_dir = Path(store_dir)
    with atomic_file(store_dir / ANSWERS, "wb") as f:
        # mtime 0 and no file name (the temporary's holds a pid): the same answers give the same bytes, so a
        # commit changes only with the answers.
        with gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0, compresslevel=9) as gz:
            gz.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in lines).encode("utf-8"))
    atomic_write_text(store_dir / META, json.dumps(meta, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return {"conversations": len(lines), "kept": meta["kept"], "shards": len(meta["shards"]),
            "batches": len(meta["batches"]), "answer_chars": meta["answer_chars"],
            "bytes": (store_dir / ANSWERS).stat().st_size}


def _unit_total(stats: dict) -> int:
    return stats.get("tokens", 0) + stats.get("restored_tokens", 0)


# -- save ---------------------------------------------------------------------------------------------------------

def save(regen_dir: Path, store_dir: Path) -> dict:
    """Copies the answers of every finished shard, saved batch and journaled conversation of `regen_dir` into
    `store_dir`, keeping the store's other conversations (each file replaced atomically). Returns the counts."""
    out = RegenDir(Path(regen_dir))
    store_dir = Path(store_dir)
    if not out.run_path.exists():
        raise RegenStateError(f"{out.root}: no regen run to save (no {out.run_path})")
    identity = json.loads(out.run_path.read_text())
    settings = answer_settings(identity)
    max_new = (identity.get("generation") or {}).get("max_new_tokens", 0)
    meta = {"identity": identity, "shards": {}, "batches": {}}
    lines: list[dict] = []
    for marker_path in sorted((out.state / "done").glob("shard-*.json")):
        shard = int(marker_path.stem.removeprefix("shard-"))
        if not out.shard_done(shard):
            continue
        marker = json.loads(marker_path.read_text())
        tokens = marker.pop("answer_tokens", None) or {}  # the entries hold them
        errors = list(_jsonl(out.error_path(shard))) if out.error_path(shard).exists() else []
        meta["shards"][str(shard)] = {"marker": marker, "errors": errors}
        unit = [_record_entry(r, settings, tokens.get(r["id"]), "shard", shard) for r in _jsonl(out.shard_path(shard))]
        _estimate_tokens(unit, _unit_total(marker["stats"]), max_new)
        lines += unit
    for batch_path in sorted((out.state / "batches").glob("batch-*.json")):
        batch = int(batch_path.stem.removeprefix("batch-"))
        result = BatchResult.from_dict(json.loads(batch_path.read_text()))
        meta["batches"][str(batch)] = {"stats": result.stats, "failures": result.failures}
        unit = [_record_entry(r, settings, result.tokens.get(r["id"]), "batch", batch) for r in result.records]
        _estimate_tokens(unit, _unit_total(result.stats), max_new)
        lines += unit
    for journal_path in sorted((out.state / "journal").glob("batch-*.jsonl")):
        batch = int(journal_path.stem.removeprefix("batch-"))
        if str(batch) in meta["batches"]:
            continue  # a batch file written just before its journal's removal holds them all
        for e in _journal_lines(journal_path):
            if e is not None:
                lines.append({"id": e["id"], "in": "journal", "unit": batch, "answers": e["answers"],
                              "elapsed_s": e["elapsed_s"],
                              # lines of an older eaglet have no digest (the run's plan gives it: upgrade)
                              **({"digest": answer_digest(settings, e["digest"])} if e.get("digest") else {})})
    if (store_dir / META).exists():
        lines += _kept(store_dir, identity, settings, lines)
    counts = _write(store_dir, meta, lines)
    log.info("answer store %s: %s", store_dir, counts)
    return counts


def _kept(store_dir: Path, identity: dict, settings: dict, lines: list[dict]) -> list[dict]:
    """The stored conversations that the folder being saved does not hold, kept; an estimate of tokens stays
    marked as one; a folder's line without a digest gets the same run's stored one. Refuses a store of other
    answer settings (its answers would be replaced)."""
    theirs, stored = _load(store_dir)
    if not stored:
        return []
    same_run = theirs["identity"] == identity
    if same_run:  # a journal line of an older eaglet: the same run's stored conversation has its digest
        run_digests = {e["id"]: e["digest"] for e in stored if e["in"] != "kept" and e.get("digest")}
        for e in lines:
            if not e.get("digest") and e["id"] in run_digests:
                e["digest"] = run_digests[e["id"]]
    if answer_settings(theirs["identity"]) != settings:
        raise RegenStateError(f"{store_dir}: it holds {len(stored)} answers generated under other settings "
                              f"({_settings_diff(answer_settings(theirs['identity']), settings)}); saving this "
                              f"run there would replace them: save into another folder")
    undigested = [e for e in stored if not e.get("digest")]
    if undigested and not same_run:
        raise RegenStateError(f"{store_dir}: {len(undigested)} stored conversations have no digest (saved by an "
                              f"older eaglet) and this run's plan is another: upgrade the store first "
                              f"(python -m pipeline.answers upgrade {store_dir} <the run's overrides>)")
    here = {e["digest"]: e for e in lines if e.get("digest")}
    here_ids = {e["id"] for e in lines}
    kept = []
    for e in stored:
        same = here.get(e["digest"]) if e.get("digest") else None
        if same is not None:
            if e.get("tokens_estimated") and _turn_tokens(same) == _turn_tokens(e) and _texts(same) == _texts(e):
                same["tokens_estimated"] = True  # restored from this entry: still the estimate
            continue
        if not e.get("digest") and e["id"] in here_ids:
            continue  # the same run: the folder holds this conversation
        kept.append({**{k: v for k, v in e.items() if k not in ("in", "unit")}, "in": "kept"})
    return kept


# -- restore ------------------------------------------------------------------------------------------------------

def _records(entries: list[dict], items: dict[str, RegenItem], where: str) -> list[dict]:
    """The records of a finished unit, rebuilt from this run's conversations and the stored answers."""
    records = []
    for e in entries:
        if e["id"] not in items:
            raise RegenStateError(f"{where}: conversation {e['id']!r} is not in this run's input")
        records.append(to_sharegpt(items[e["id"]], _answers(e, False), e.get("flags") or {}))
    return records


def restore(out: RegenDir, identity: dict, plan: Plan, items: list[RegenItem], store_dir: Path,
            shards: Optional[Iterable[int]] = None) -> int:
    """Writes into `out` what the store holds and `out` lacks for the run `identity`, of `shards` only (a rank's;
    None: all): into the same run its finished shards, saved batches and journaled conversations as they were;
    then, into any plan, every conversation whose digest a stored one has, as a finished journal line. Returns
    the number of conversations restored."""
    store_dir = Path(store_dir)
    if not (store_dir / META).exists():
        log.info("regen.answer_store=%s: nothing stored yet", store_dir)
        return 0
    meta, entries = _load(store_dir)
    identity = json.loads(json.dumps(identity))
    settings = answer_settings(identity)
    if answer_settings(meta["identity"]) != settings:
        raise RegenStateError(
            f"{store_dir}: its {len(entries)} conversations were answered under other settings, so none restores "
            f"into this run ({_settings_diff(answer_settings(meta['identity']), settings)}); point "
            f"regen.answer_store at another folder (or remove this one) to generate them afresh")
    mine = set(range(plan.n_shards) if shards is None else shards)
    my_batches = {b for s in mine for b in plan.shard_batches(s)}
    same_run = meta["identity"] == identity
    restored = _restore_units(out, plan, items, store_dir, meta, entries, mine, my_batches) if same_run else 0
    done_batches = {b for s in range(plan.n_shards) if out.shard_done(s) for b in plan.shard_batches(s)}
    per_conversation = _restore_conversations(out, identity, plan, items, store_dir, meta, entries,
                                              my_batches - done_batches)
    if same_run:
        log.info("regen.answer_store=%s: %d conversations of the same run restored as they were", store_dir, restored)
    return restored + per_conversation


def _restore_units(out: RegenDir, plan: Plan, items: list[RegenItem], store_dir: Path, meta: dict,
                   entries: list[dict], mine: set[int], my_batches: set[int]) -> int:
    """The same run: finished shards byte for byte (sha256 checked), saved batches, journaled conversations."""
    units: dict[tuple[str, int], list[dict]] = {}
    for e in entries:
        if e["in"] != "kept":
            units.setdefault((e["in"], int(e["unit"])), []).append(e)
    by_id = {it.id: it for it in items}
    restored = 0
    for key, stored in sorted(meta["shards"].items(), key=lambda kv: int(kv[0])):
        shard = int(key)
        if shard not in mine or out.shard_done(shard):
            continue
        unit = units.get(("shard", shard), [])
        text = shard_text(_records(unit, by_id, f"{store_dir} shard {shard}"))
        if hashlib.sha256(text.encode()).hexdigest() != stored["marker"]["sha256"]:
            raise RegenStateError(f"{store_dir}: shard {shard} rebuilt from the sources and the stored answers "
                                  f"differs from the one saved (sha256): the sources changed; remove {store_dir} "
                                  f"to regenerate")
        atomic_write_text(out.shard_path(shard), text)
        if stored["errors"]:
            atomic_write_text(out.error_path(shard), shard_text(stored["errors"]))
        marker = dict(stored["marker"])
        if all(e.get("tokens") is not None for e in unit):
            marker["answer_tokens"] = {e["id"]: e["tokens"] for e in unit}
        atomic_write_text(out.done_path(shard), json.dumps(marker, indent=1, sort_keys=True) + "\n")
        out.drop_batches(plan.shard_batches(shard))
        restored += stored["marker"]["conversations"]
    done_batches = {b for s in range(plan.n_shards) if out.shard_done(s) for b in plan.shard_batches(s)}
    for key, stored in meta["batches"].items():
        batch = int(key)
        if batch not in my_batches or batch in done_batches or out.batch_path(batch).exists():
            continue
        unit = units.get(("batch", batch), [])
        records = _records(unit, by_id, f"{store_dir} batch {batch}")
        tokens = {e["id"]: e["tokens"] for e in unit if e.get("tokens") is not None}
        out.save_batch(batch, BatchResult(records, stored["failures"], stored["stats"], tokens=tokens))
        restored += len(records)
    for (where, batch), unit in units.items():
        if where != "journal" or batch not in my_batches or batch in done_batches or out.batch_path(batch).exists():
            continue
        journal = out.journal(batch, [items[i] for i in plan.batches[batch]])
        have, _ = journal.load()
        for e in unit:
            if e["id"] not in have:
                journal.record(e["id"], _answers(e, False), e["elapsed_s"])
                restored += 1
    return restored


def _restore_conversations(out: RegenDir, identity: dict, plan: Plan, items: list[RegenItem], store_dir: Path,
                           meta: dict, entries: list[dict], open_batches: set[int]) -> int:
    """Every conversation of `open_batches` (unfinished, this rank's) whose digest a stored one has and that its
    batch lacks, journaled as finished and restored. Logs one line: restored, changed, not in this plan."""
    settings = answer_settings(identity)
    wanted = {it.id: answer_digest(settings, it.digest()) for it in items}
    # A stored conversation without a digest (a format-1 store) is this conversation only in the very plan it
    # was saved from (the plan digest covers every conversation's id, system prompt and user turns).
    same_plan = (meta["identity"].get("plan"), meta["identity"].get("conversations")) == \
        (identity.get("plan"), identity.get("conversations"))
    stored: dict[str, dict] = {}
    undigested = 0
    for e in entries:
        digest = e.get("digest") or (wanted.get(e["id"]) if same_plan else None)
        if digest is None:
            undigested += 1
        else:
            stored.setdefault(digest, e)
    if undigested:
        raise RegenStateError(
            f"{store_dir}: {undigested} of its {len(entries)} conversations have no digest (a store of format "
            f"{meta.get('format')}, saved by an older eaglet) and this run's plan is another, so they cannot be "
            f"matched: upgrade it first under the config that saved it (python -m pipeline.answers "
            f"upgrade {store_dir} experiment=<name> [its overrides], e.g. at the commit that saved it)")
    restored, estimated = 0, 0
    for b in sorted(open_batches):
        if out.batch_path(b).exists():
            continue
        batch_items = [items[i] for i in plan.batches[b]]
        if not any(wanted[it.id] in stored for it in batch_items):
            continue
        journal = out.journal(b, batch_items)
        have, _ = journal.load()
        for it in batch_items:
            e = stored.get(wanted[it.id])
            if e is None or it.id in have:
                continue
            journal.record(it.id, _answers(e, True), 0.0)
            restored += 1
            estimated += bool(e.get("tokens_estimated"))
    if meta["identity"] == identity and not restored:
        return 0
    stored_ids = {e["id"] for e in entries}
    matching = sum(wanted[it.id] in stored for it in items)
    changed = sorted(i for i in stored_ids if i in wanted and wanted[i] not in stored)
    absent = len(stored_ids - set(wanted))
    (log.warning if changed else log.info)(
        "regen.answer_store=%s: restored per conversation: %d (%d of this run's %d conversations have stored "
        "answers%s%s); prompt changed, generated again: %d%s; stored but not in this run (kept in the store): %d",
        store_dir, restored, matching, len(items),
        "; the rest is in the output folder already, or another rank's" if restored < matching else "",
        f"; the answer tokens of {estimated} are estimates of a format-1 store" if estimated else "",
        len(changed), f" ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''})" if changed else "", absent)
    return restored


# -- upgrade and check (a config, the sources) ---------------------------------------------------------------------

def prompt_measure(cfg, generation: dict) -> Callable[[RegenItem], int]:
    """The prompt measure a run with these generation settings planned with (its backend's `prompt_length`)."""
    from pipeline.regen import backends

    if backends.BACKENDS[generation["backend"]].measure == "chars":
        return RegenItem.prompt_chars
    from pipeline.data.chat import ThinkingMode, render_prompt
    from pipeline.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.target)
    thinking = ThinkingMode.parse(generation.get("thinking", ThinkingMode.template), "regen.thinking")
    return lambda item: len(render_prompt(tokenizer, item.first_prompt(), thinking=thinking))


def upgrade(store_dir: Path, cfg) -> dict:
    """Gives every stored conversation without one its digest, and every finished record its tokens per turn
    (estimated: `_estimate_tokens`), for a store saved by an older eaglet. `cfg` (the root config) must be the
    one the store's run had: its sources must give the stored plan digest, checked first. Returns the counts."""
    from pipeline.data.bad_records import BadRecordReport

    store_dir = Path(store_dir)
    meta, entries = _load(store_dir)
    identity = meta["identity"]
    generation = identity.get("generation") or {}
    lacking = [e for e in entries if not e.get("digest")]
    if lacking:
        items = read_items(cfg, BadRecordReport())
        plan = make_plan(items, generation["batch_size"], generation["batches_per_shard"],
                         prompt_measure(cfg, generation))
        if (plan.digest, len(items)) != (identity["plan"], identity["conversations"]):
            raise RegenStateError(
                f"{store_dir}: this config's sources give plan {plan.digest} ({len(items)} conversations), the "
                f"store's run had plan {identity['plan']} ({identity['conversations']} conversations): upgrade under "
                f"the config that saved it (its data sources and limits, data.system_prompt, regen.limit; e.g. at "
                f"the commit that saved the store)")
        settings = answer_settings(identity)
        digests = {it.id: answer_digest(settings, it.digest()) for it in items}
        for e in lacking:
            e["digest"] = digests[e["id"]]
    units: dict[tuple[str, int], list[dict]] = {}
    for e in entries:
        units.setdefault((e["in"], int(e.get("unit", -1))), []).append(e)
    max_new = generation.get("max_new_tokens", 0)
    estimated = sum(_estimate_tokens(units.get(("shard", int(s)), []), _unit_total(v["marker"]["stats"]), max_new)
                    for s, v in meta["shards"].items())
    estimated += sum(_estimate_tokens(units.get(("batch", int(b)), []), _unit_total(v["stats"]), max_new)
                     for b, v in meta["batches"].items())
    counts = {**_write(store_dir, {k: v for k, v in meta.items() if k in ("identity", "shards", "batches")},
                       entries), "digested": len(lacking), "tokens_estimated": estimated}
    log.info("answer store %s upgraded to format %d: %d conversations digested (the sources give the stored plan "
             "%s); the tokens of %d finished records were not kept by the old format: estimated per turn from "
             "their shard's exact total (a turn cut at max_new_tokens has exactly that many), so each shard's sum "
             "is exact", store_dir, FORMAT, len(lacking), identity.get("plan"), estimated)
    return counts


def check(store_dir: Path, cfg) -> dict:
    """What a regen of `cfg` would restore from the store, without a backend: the conversations of its sources
    whose digests under the store's answer settings a stored one has, those whose prompt changed, and the
    config's generation settings that differ from the store's (the target and the engine's own are checked when
    the run starts)."""
    from pipeline.data.bad_records import BadRecordReport

    store_dir = Path(store_dir)
    meta, entries = _load(store_dir)
    settings = answer_settings(meta["identity"])
    items = read_items(cfg, BadRecordReport())
    wanted = {it.id: answer_digest(settings, it.digest()) for it in items}
    digests = {e.get("digest") for e in entries} - {None}
    stored_ids = {e["id"] for e in entries}
    restorable = set(wanted.values()) & digests
    rcfg, gen = cfg.regen, settings["generation"]
    mine = {"max_new_tokens": rcfg.max_new_tokens, "temperature": rcfg.temperature, "top_p": rcfg.top_p,
            "seed": rcfg.seed, "thinking": json.loads(json.dumps(rcfg.thinking)),
            **({"backend": str(rcfg.backend)} if str(rcfg.backend) != "auto" else {})}
    differ = {k: [gen.get(k, "template" if k == "thinking" else None), v] for k, v in mine.items()
              if gen.get(k, "template" if k == "thinking" else None) != v}
    return {"stored": len(entries), "undigested": len(entries) - sum(bool(e.get("digest")) for e in entries),
            "plan_conversations": len(items), "restore": sum(d in restorable for d in wanted.values()),
            "changed": sorted(i for i in stored_ids if i in wanted and wanted[i] not in digests),
            "not_in_plan": len(stored_ids - set(wanted)), "settings_differ": differ,
            "restore_answer_tokens": sum(sum(_turn_tokens(e) or []) for e in entries if e.get("digest") in restorable)}
