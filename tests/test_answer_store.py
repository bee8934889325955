"""The answer store (pipeline/regen/answer_store.py, `regen.answer_store`): a regen run's answers carried to a
fresh machine without a prompt. A run stopped midway saves what it finished; a fresh output folder with the
store generates only the rest and ends with the shards of an uninterrupted run, byte for byte; a source whose
text changed is refused; journaled conversations of an unfinished batch come back as they were."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.regen import answer_store
from pipeline.regen import run as regen_run
from pipeline.regen.batching import RegenItem, make_plan
from pipeline.regen.config import RegenConfig
from pipeline.regen.shards import RegenDir, RegenStateError
from pipeline.regen.waves import Answer
from pipeline.target import TargetConfig

PROMPTS = ["Name three fruits.", "What is 12 times 7?", "Write a short poem about the sea.", "Why?",
           "Describe a cat in one sentence.", "Give a tip for sleeping well."]


def _source(path: Path, prompts=PROMPTS) -> Path:
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": q}]} for i, q in enumerate(prompts)]
    rows.append({"id": "mt", "turns": ["Name a colour.", "Why that one?"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(root: Path, model_dir, source: Path, store: Path) -> EagletConfig:
    return EagletConfig(name="s", output_root=str(root), target=TargetConfig(name="tiny", path=str(model_dir),
                                                                              gguf_package=None),
                        data=DataConfig(sources=[str(source)]),
                        regen=RegenConfig(batch_size=2, batches_per_shard=2, max_new_tokens=8, progress=False,
                                          answer_store=str(store)))


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
    for prompt in PROMPTS + ["Name a colour.", "Why that one?"]:  # the store holds no prompt
        assert prompt not in stored and prompt not in (store / "store.json").read_text()

    asked.clear()
    fresh = _cfg(tmp_path / "machine2", tiny_model_dir, source, store)  # outputs/ gone: only the store is left
    summary = regen_run.main(fresh)
    first_run = {i for batch in asked for i in batch}
    assert len(asked) == 1 and len(first_run) == 1  # only the unfinished batch's conversation is generated
    assert summary["written"] == 7 and _shards(fresh) == _shards(reference)
    assert json.loads((store / "store.json").read_text())["conversations"] == 7  # saved again at the end

    changed = _source(tmp_path / "changed.jsonl", PROMPTS[:3] + ["Why not?"] + PROMPTS[4:])
    with pytest.raises(RegenStateError, match=r"other plan .*a source changed"):
        regen_run.main(_cfg(tmp_path / "machine3", tiny_model_dir, changed, store))


def test_journaled_conversations_of_an_unfinished_batch_come_back(tmp_path):
    items = [RegenItem(f"c{i}", None, (f"q{i}",)) for i in range(4)]
    plan = make_plan(items, 4, 1, RegenItem.prompt_chars)
    identity = {"plan": plan.digest, "conversations": 4}
    src = RegenDir(tmp_path / "a")
    src.claim(identity)
    answers = {"c1": [Answer("one", 3, "stop")], "c3": [Answer("three", 8, "length")]}
    journal = src.journal(0, [it.id for it in items])
    for cid, a in answers.items():
        journal.record(cid, a, 1.5)
    with open(src.journal_path(0), "a") as f:
        f.write('{"id": "c2", "elapsed')  # a kill cut the last line: c2 was not finished
    answer_store.save(src.root, tmp_path / "store")

    dst = RegenDir(tmp_path / "b")
    dst.claim(identity)
    assert answer_store.restore(dst, identity, plan, items, tmp_path / "store") == 2
    assert dst.journal(0, [it.id for it in items]).load()[0] == answers
    assert answer_store.restore(dst, identity, plan, items, tmp_path / "store") == 0  # nothing it lacks
    with pytest.raises(RegenStateError, match="other conversations"):
        answer_store.restore(RegenDir(tmp_path / "c"), {**identity, "conversations": 5}, plan, items,
                             tmp_path / "store")


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
