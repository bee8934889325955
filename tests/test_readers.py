"""Conversation readers: every format, every bad-record reason with its location, and the real files."""
from __future__ import annotations

import gzip
import json

import pytest

from pipeline.data import readers
from pipeline.data.bad_records import BAD_REASONS, BadRecordError, BadRecordReport
from pipeline.data.config import DataConfig, SourceConfig
from pipeline.data.readers import read_source, read_sources
from tests.support.readers import _read, _sg, _write_jsonl


def _msgs(*pairs) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


# --- formats -----------------------------------------------------------------------------------------------


def test_sharegpt_jsonl_with_role_aliases(tmp_path):
    path = _write_jsonl(tmp_path / "sg.jsonl", [
        _sg(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello"), ("user", "Again?"), ("chatgpt", "Yes"), id="a"),
        _sg(("Human", "Q1"), ("bing", "A1"), ("user", "Q2"), ("bard", "A2"), ("human", "Q3"), ("assistant", "A3")),
    ])
    convs, report = _read(path)
    assert report.total == 0
    assert convs[0] == {
        "id": "a",
        "messages": _msgs(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Again?"),
                          ("assistant", "Yes")),
        "meta": {},
    }
    assert convs[1]["id"] == "sg-1"  # no id in the record: <file stem>-<index>
    assert [m["role"] for m in convs[1]["messages"]] == ["user", "assistant"] * 3


def test_sharegpt_json_list_and_single_object(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([_sg(("human", "Q"), ("gpt", "A"), id=7), _sg(("human", "P"))],
                                                   indent=2))
    (tmp_path / "one.json").write_text(json.dumps(_sg(("human", "only"), id="solo")))
    convs, _ = _read(tmp_path / "list.json")
    assert [c["id"] for c in convs] == ["7", "list-1"]
    assert convs[1]["messages"] == _msgs(("user", "P"))  # prompt only is valid
    convs, _ = _read(tmp_path / "one.json")
    assert [(c["id"], c["messages"]) for c in convs] == [("solo", _msgs(("user", "only")))]


def test_openai_messages(tmp_path):
    path = _write_jsonl(tmp_path / "oa.jsonl", [
        {"id": "m1", "messages": [{"role": "developer", "content": "sys"}, {"role": "user", "content": "u"},
                                  {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image_url"},
                                                   {"type": "text", "text": "here"}]}]},
    ])
    convs, report = _read(path, format="openai")
    assert report.total == 0
    assert convs[0]["messages"] == _msgs(("system", "sys"), ("user", "u"), ("assistant", "a"))
    assert convs[1]["messages"] == _msgs(("user", "look here"))


def test_alpaca_variants(tmp_path):
    path = tmp_path / "alp.json"
    path.write_text(json.dumps([
        {"instruction": "Translate.", "input": "chat", "output": "cat"},
        {"instruction": "Say hi.", "input": "  ", "output": "hi"},
        {"instruction": "And now?", "input": "", "output": "done", "history": [["first q", "first a"], ["q2", "a2"]],
         "system": "You are terse."},
        {"instruction": "No answer yet."},
        {"id": "seed_task_0", "instruction": "Sum.", "instances": [{"input": "1 2", "output": "3"}]},
    ]))
    convs, report = _read(path, format="alpaca")
    assert report.total == 0
    assert [c["messages"] for c in convs] == [
        _msgs(("user", "Translate.\n\nchat"), ("assistant", "cat")),
        _msgs(("user", "Say hi."), ("assistant", "hi")),
        _msgs(("system", "You are terse."), ("user", "first q"), ("assistant", "first a"), ("user", "q2"),
              ("assistant", "a2"), ("user", "And now?"), ("assistant", "done")),
        _msgs(("user", "No answer yet.")),
        _msgs(("user", "Sum.\n\n1 2"), ("assistant", "3")),
    ]
    assert [c["id"] for c in convs] == ["alp-0", "alp-1", "alp-2", "alp-3", "seed_task_0"]


def test_mtbench_followup_turns_go_to_meta(tmp_path):
    path = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a post.", "Now shorter."]},
        {"question_id": 82, "category": "", "turns": ["One turn."], "reference": ["x"]},
    ])
    convs, report = _read(path)
    assert report.total == 0
    assert convs == [
        {"id": "81", "messages": _msgs(("user", "Write a post.")),
         "meta": {"category": "writing", "followup_turns": ["Now shorter."]}},
        {"id": "82", "messages": _msgs(("user", "One turn.")), "meta": {}},
    ]


def test_hf_source_with_column_mapping(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [
        {"uid": "r0", "question": "2+2?", "answer": "4"},
        {"uid": "r1", "question": "3+3?", "answer": "6"},
        {"uid": "r2", "question": "", "answer": "0"},
    ])
    report = BadRecordReport()
    src = SourceConfig(path=str(path), format="hf", split="train",
                       columns={"id": "uid", "instruction": "question", "output": "answer"})
    convs = list(read_source(src, report))
    assert [(c["id"], c["messages"]) for c in convs] == [
        ("r0", _msgs(("user", "2+2?"), ("assistant", "4"))),
        ("r1", _msgs(("user", "3+3?"), ("assistant", "6"))),
    ]
    [bad] = report.examples["empty_content"]
    assert str(bad.location) == f"{path}[train]:#2"


def test_auto_resolves_each_record(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [
        _sg(("human", "s"), ("gpt", "t")),
        {"messages": [{"role": "user", "content": "o"}]},
        {"instruction": "i", "output": "j"},
        {"question_id": 1, "turns": ["q"]},
        {"text": "no known field"},
    ])
    convs, report = _read(path)
    assert [c["messages"][0]["content"] for c in convs] == ["s", "o", "i", "q"]
    assert report.counts == {"missing_field": 1}
    assert str(report.examples["missing_field"][0]) == (
        f"{path}:5: missing_field (none of conversations/messages/turns/instruction)")


def test_chatdemo_sample(shared_data):
    path = shared_data / "sharegpt_chatdemo_sample50" / "sharegpt_sample.json"
    raw = json.loads(path.read_text())
    convs, report = _read(path)
    assert report.total == 0 and len(convs) == 50
    assert [c["id"] for c in convs] == [r["conversation_id"] for r in raw]
    assert all(c["messages"] == _msgs(("user", r["prompt"]), ("assistant", r["response"])) for c, r in zip(convs, raw))


def test_gzip_jsonl_and_json(tmp_path):
    rows = [_sg(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    with gzip.open(tmp_path / "z.jsonl.gz", "wt") as f:
        f.write("\n".join(map(json.dumps, rows)) + "\n{broken\n")
    with gzip.open(tmp_path / "y.json.gz", "wt") as f:
        json.dump(rows, f)
    convs, report = _read(tmp_path / "z.jsonl.gz")
    assert [c["id"] for c in convs] == ["z-0", "z-1", "z-2"]
    assert str(report.examples["invalid_json"][0].location) == f"{tmp_path / 'z.jsonl.gz'}:4"
    convs, _ = _read(tmp_path / "y.json.gz")
    assert [c["messages"][1]["content"] for c in convs] == ["a0", "a1", "a2"]


def test_directory_reads_data_files_sorted(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl", [_sg(("human", "b"))])
    (tmp_path / "a.json").write_text(json.dumps([_sg(("human", "a"))]))
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "sub").mkdir()
    _write_jsonl(tmp_path / "sub" / "c.jsonl", [_sg(("human", "c"))])
    convs, _ = _read(tmp_path)
    assert [c["id"] for c in convs] == ["a-0", "b-0"]


def test_json_named_file_holding_json_lines(tmp_path):
    path = _write_jsonl(tmp_path / "lines.json", [_sg(("human", "x")), _sg(("human", "y"))])
    convs, _ = _read(path)
    assert [c["messages"][0]["content"] for c in convs] == ["x", "y"]


def test_leading_assistant_turns_dropped_and_counted(tmp_path):
    path = _write_jsonl(tmp_path / "split.jsonl", [
        _sg(("gpt", "tail of an earlier piece"), ("gpt", "more"), ("human", "Q"), ("gpt", "A"), id="x_3"),
        _sg(("system", "S"), ("gpt", "dangling"), ("human", "Q")),
        _sg(("gpt", "only the tail")),  # nothing left: a bad record, not a fix
    ])
    convs, report = _read(path)
    assert convs[0]["messages"] == _msgs(("user", "Q"), ("assistant", "A"))
    assert convs[1]["messages"] == _msgs(("system", "S"), ("user", "Q"))
    assert report.fixes == {"leading_assistant_dropped": 2}
    assert report.counts == {"no_user_turn": 1}


# --- bad records ---------------------------------------------------------------------------------------------

# (reason, JSONL line, expected detail); each written after one good record, so reason i is on line i + 2.
BAD_LINES = [
    ("invalid_json", '{"conversations": [', "Expecting value at column 20"),
    ("invalid_json", "[1, 2]", "record is a list, not an object"),
    ("missing_field", json.dumps({"conversations": [{"from": "human"}]}), "conversations[0].value"),
    ("missing_field", json.dumps({"messages": [{"content": "x"}]}), "messages[0].role"),
    ("unknown_role", json.dumps(_sg(("human", "q"), ("tool", "r"))), "conversations[1].from='tool'"),
    ("empty_content", json.dumps(_sg(("human", "q"), ("gpt", " \n"))), "turn 1 (assistant)"),
    ("not_alternating", json.dumps(_sg(("human", "q"), ("human", "q again"))), "turns 0 and 1 are both user"),
    ("system_not_first", json.dumps(_sg(("human", "q"), ("system", "s"))), "turn 1"),
    ("no_user_turn", json.dumps(_sg(("system", "s"))), ""),
    ("duplicate_id", json.dumps(_sg(("human", "q"), id="dup")), "dup"),
]


def test_each_bad_reason_reported_with_file_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(_sg(("human", "fine"), id="dup"))
    lines = [good] + [line for _, line, _ in BAD_LINES]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "\xff\xfe"}\n')
    convs, report = _read(path)
    assert [c["id"] for c in convs] == ["dup"]
    expected = [(f"{path}:{i + 2}", reason, detail) for i, (reason, _, detail) in enumerate(BAD_LINES)]
    expected.append((f"{path}:{len(lines) + 1}", "not_utf8", "byte 8 of the line"))
    got = [(str(b.location), b.reason, b.detail) for reason in report.examples for b in report.examples[reason]]
    assert sorted(got) == sorted(expected)
    # Whole-file reasons and turn_too_long (a turn of over 1,000,000 characters): tests/test_hostile.py.
    assert set(report.counts) == set(BAD_REASONS) - {"bad_gzip", "binary_file", "turn_too_long"}
    assert report.total == len(expected)


def test_json_list_locations_give_index_and_line(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([_sg(("human", "ok")), _sg(("human", "q"), ("gpt", ""))], indent=1) + "\n")
    _, report = _read(path)
    [bad] = report.examples["empty_content"]
    assert str(bad.location) == f"{path}:#1 (line 10)"
    assert path.read_text().splitlines()[8:10] == [" },", " {"]  # line 10 opens record #1

    path.write_text('[{"instruction": "a"},\n {"instruction": "b"} {"instruction": "c"}]')
    convs, report = _read(path)
    assert len(convs) == 2 and report.counts == {"invalid_json": 1}
    assert str(report.examples["invalid_json"][0].location) == f"{path}:#2 (line 2)"


def test_whole_file_failures_are_one_bad_record(tmp_path):
    (tmp_path / "latin1.json").write_bytes('[{"instruction": "café"}]'.encode("latin-1"))
    (tmp_path / "broken.json").write_text('{\n "instruction": "x",\n}')
    _, report = _read(tmp_path / "latin1.json")
    [bad] = report.examples["not_utf8"]
    assert str(bad) == f"{tmp_path / 'latin1.json'}:#0 (line 1): not_utf8 (byte 21)"  # 21: the é
    _, report = _read(tmp_path / "broken.json")
    assert str(report.examples["invalid_json"][0].location) == f"{tmp_path / 'broken.json'}:3"


def test_fail_mode_raises_at_first_bad_record(tmp_path):
    path = _write_jsonl(tmp_path / "f.jsonl", [_sg(("human", "ok")), _sg(("human", "a"), ("human", "b")), "{oops"])
    report = BadRecordReport()
    seen = []
    with pytest.raises(BadRecordError, match=r"f\.jsonl:2: not_alternating") as err:
        for conv in read_source(SourceConfig(path=str(path)), report, on_bad_record="fail"):
            seen.append(conv)
    assert (err.value.file, err.value.line, err.value.reason) == (str(path), 2, "not_alternating")
    assert len(seen) == 1 and report.total == 1
    with pytest.raises(ValueError, match="on_bad_record"):
        list(read_source(SourceConfig(path=str(path)), report, on_bad_record="ignore"))


def test_limit_counts_yielded_records(tmp_path):
    path = _write_jsonl(tmp_path / "l.jsonl", [_sg(("human", "")), *(_sg(("human", str(i))) for i in range(5))])
    convs, report = _read(path, limit=3)
    assert [c["messages"][0]["content"] for c in convs] == ["0", "1", "2"]
    assert report.total == 1


def test_report_summary_and_dict(tmp_path):
    path = _write_jsonl(tmp_path / "r.jsonl", [_sg(("gpt", "x"), ("human", "q")), "{", "{", _sg(("human", " "))])
    report = BadRecordReport(max_examples=1)
    list(read_source(SourceConfig(path=str(path)), report))
    d = report.to_dict()
    assert d["total"] == 3 and d["counts"] == {"empty_content": 1, "invalid_json": 2}
    assert d["fixes"] == {"leading_assistant_dropped": 1}
    assert d["by_file"] == {str(path): {"empty_content": 1, "invalid_json": 2}}
    assert d["examples"]["invalid_json"] == [{"where": f"{path}:2", "detail": "Expecting property name enclosed in "
                                              "double quotes at column 2"}]
    json.dumps(d)  # manifest-ready
    table = report.summary().splitlines()
    assert table[0] == "bad records: 3"
    assert table[2].split()[:3] == ["invalid_json", "2", f"{path}:2:"]  # most frequent reason first
    assert "leading_assistant_dropped" in table[-1]


def test_read_sources_ids_unique_across_sources(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"question_id": 0, "turns": ["a0"]}, {"question_id": 1, "turns": ["a1"]}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"question_id": 1, "turns": ["b1"]}, {"question_id": 2, "turns": ["b2"]}])
    report = BadRecordReport()
    cfg = DataConfig(sources=[{"path": str(a)}, SourceConfig(path=str(b), format="mtbench")])
    assert [c["id"] for c in read_sources(cfg, report)] == ["0", "1", "2"]
    assert [str(x) for x in report.examples["duplicate_id"]] == [f"{b}:1: duplicate_id (1)"]


def test_repeated_and_held_out_prompts_are_left_out_counted_and_located(tmp_path):
    """data.dedupe_prompts drops a conversation whose first user turn (case and white space folded) was seen
    before, across sources; data.held_out drops any conversation with a user turn of the held-out set.
    Both are counted as skipped with their file:line, never fail under on_bad_record=fail, and a source's
    `limit` counts the conversations kept."""
    a = _write_jsonl(tmp_path / "a.jsonl", [
        _sg(("human", "Tell me about cats."), ("gpt", "x"), id="a1"),
        _sg(("human", "  tell me ABOUT   cats. "), ("gpt", "y"), id="a2"),  # a repeat of a1's prompt
        _sg(("human", "Plan a trip."), ("gpt", "z"), ("human", "Write a haiku about rain."), id="a3"),  # held out
        _sg(("human", "Explain tides."), id="a4"),
        _sg(("human", "Name three rivers."), id="a5"),
    ])
    b = _write_jsonl(tmp_path / "b.jsonl", [_sg(("human", "tell me about cats."), id="b1"),
                                            _sg(("human", "Hi"), id="b2")])
    held = _write_jsonl(tmp_path / "question.jsonl",
                        [{"question_id": 1, "turns": ["Intro", "write a haiku about RAIN."]}])
    cfg = DataConfig(sources=[{"path": str(a), "limit": 3}, str(b)], dedupe_prompts=True, held_out=[str(held)],
                     on_bad_record="fail")
    report = BadRecordReport()
    assert [c["id"] for c in read_sources(cfg, report)] == ["a1", "a4", "a5", "b2"]
    assert report.skipped == {"duplicate_prompt": 2, "held_out_prompt": 1} and report.total == 0
    where = {reason: [str(x.location) for x in records] for reason, records in report.skip_examples.items()}
    assert where["duplicate_prompt"] == [f"{a}:2", f"{b}:1"] and where["held_out_prompt"] == [f"{a}:3"]
    assert report.to_dict()["skipped"] == {"duplicate_prompt": 2, "held_out_prompt": 1}
    assert "left out on purpose" in report.summary()
    plain = BadRecordReport()  # by default nothing is left out: existing experiments read what they read
    assert len(list(read_sources(DataConfig(sources=[str(a), str(b)]), plain))) == 7 and not plain.skipped


def test_a_source_can_live_in_an_installed_package():
    convs = list(read_source(SourceConfig(package="pipeline", path="data/demo/prompts.jsonl"), BadRecordReport()))
    assert len(convs) == len(list(read_source(SourceConfig(path=str(readers.DEMO_PROMPTS)), BadRecordReport())))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-data"):
        list(read_source(SourceConfig(package="no_such_data", path="x.json"), BadRecordReport()))


def test_read_sources_defaults_to_demo_prompts(tmp_path, monkeypatch):
    demo = _write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "Hello"}]}])
    monkeypatch.setattr(readers, "DEMO_PROMPTS", demo)
    convs = list(read_sources(DataConfig(), BadRecordReport()))
    assert convs == [{"id": "prompts-0", "messages": _msgs(("user", "Hello")), "meta": {}}]


def test_packaged_demo_prompts_read_cleanly():
    if not readers.DEMO_PROMPTS.exists():
        pytest.skip("demo prompts not written yet")
    report = BadRecordReport()
    convs = list(read_sources(DataConfig(), report))
    n_lines = sum(1 for line in readers.DEMO_PROMPTS.read_text().splitlines() if line.strip())
    assert report.total == 0 and len(convs) == n_lines
    assert all(c["messages"][0]["role"] in ("system", "user") for c in convs)


# --- every file in shared/data ------------------------------------------------------------------------------

GSM8K = {"instruction": "question", "output": "answer"}
# (file, SourceConfig overrides, records per SOURCES.md, yielded, bad by reason, fixes)
SHARED_FILES = [
    ("mt_bench/question.jsonl", {}, 80, 80, {}, 0),
    ("gsm8k/test.jsonl", {"columns": GSM8K}, 1319, 1319, {}, 0),
    ("gsm8k/train.jsonl", {"columns": GSM8K}, 7473, 7473, {}, 0),
    ("humaneval/HumanEval.jsonl.gz", {"columns": {"instruction": "prompt", "id": "task_id"}}, 164, 164, {}, 0),
    # 338 records start with gpt: 327 kept after the drop, 9 were gpt-only, 2 also hold an empty turn.
    ("sharegpt_sg92k_sample1000/sharegpt_1000.json", {}, 1000, 987, {"empty_content": 4, "no_user_turn": 9}, 327),
    ("sharegpt_mlenergy_prompts/ShareGPT_V3_filtered_500.json", {}, 500, 500, {}, 0),
    # 16 records hold only a system turn, 4 only a gpt turn, 1 an empty human turn.
    ("sharegpt_mlenergy_prompts/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json", {}, 2978, 2957,
     {"no_user_turn": 20, "empty_content": 1}, 0),
    ("sharegpt_chatdemo_sample50/sharegpt_sample.json", {}, 50, 50, {}, 0),
    ("sharegpt_fastchat_dummy/dummy_conversation.json", {}, 500, 500, {}, 0),
    ("alpaca_seed_tasks/seed_tasks.jsonl", {}, 175, 175, {}, 0),
    ("alpaca_en_demo/alpaca_en_demo.json", {}, 999, 999, {}, 0),
    ("lima/lima.json", {}, 1029, 1029, {}, 0),
    ("alpaca_eval/model_outputs.json", {}, 805, 805, {}, 0),
    *((f"eagle_bench/{b}/question.jsonl", {}, 80, 80, {}, 0) for b in ("alpaca", "gsm8k", "humaneval", "qa", "sum")),
]


def test_every_shared_data_file(shared_data):
    listed = {str(p.relative_to(shared_data)) for p in shared_data.rglob("*") if p.name.endswith(readers.DATA_SUFFIXES)}
    assert listed == {f for f, *_ in SHARED_FILES}
    rows = []
    for name, overrides, n_records, n_yielded, bad, n_fixed in SHARED_FILES:
        convs, report = _read(shared_data / name, **overrides)
        rows.append((name, len(convs), report.total, dict(report.counts), report.fixes["leading_assistant_dropped"]))
        assert rows[-1][1:] == (n_yielded, sum(bad.values()), bad, n_fixed), name
        assert len(convs) + report.total == n_records, name
        assert len({c["id"] for c in convs}) == len(convs)
        assert all(c["messages"][-1]["content"].strip() for c in convs)
    print("\nfile | yielded | bad | bad by reason | leading_assistant_dropped")  # pytest -s shows the table
    for row in rows:
        print(" | ".join(map(str, row)))


def test_shared_sharegpt_bad_records_by_hand(shared_data):
    """The reasons match what the records hold (checked by reading them)."""
    path = shared_data / "sharegpt_sg92k_sample1000" / "sharegpt_1000.json"
    raw = json.loads(path.read_text())
    _, report = _read(path)
    for bad in report.examples["empty_content"]:
        turns = raw[bad.location.index]["conversations"]
        turn = int(bad.detail.split()[1])
        assert turns[turn]["value"].strip() == ""
    for bad in report.examples["no_user_turn"]:
        assert {t["from"] for t in raw[bad.location.index]["conversations"]} == {"gpt"}
    lima = _read(shared_data / "lima" / "lima.json")[0]
    assert sum(len(c["messages"]) > 2 for c in lima) == 29  # SOURCES.md: 29 records have a history
    mt_bench = _read(shared_data / "mt_bench" / "question.jsonl")[0]
    assert all(len(c["meta"]["followup_turns"]) == 1 for c in mt_bench)  # 2 turns each
    assert len({c["meta"]["category"] for c in mt_bench}) == 8
    humaneval = _read(shared_data / "humaneval" / "HumanEval.jsonl.gz",
                      columns={"instruction": "prompt", "id": "task_id"})[0]
    assert humaneval[163]["id"] == "HumanEval/163" and humaneval[0]["messages"][0]["content"].startswith("from typing")
