"""Hostile inputs: files cut short, bytes that are not UTF-8, binary garbage, broken gzip, a 50 MB turn, broken
turn structure, a target path that is no model, a head of another target, an override of the wrong type. Each
is one line naming the file, the line or record (or byte offset) and the reason, counted in the stage
manifest, and the good records around it are kept."""
from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.config import DataConfig
from pipeline.data.readers import read_sources
from pipeline.manifest import ManifestError, load_manifest
from pipeline.run import is_user_error
from pipeline.target import TargetConfig, TargetError, load_target
from tests.support.config import compose_cfg
from tests.support.paths import REPO
from tests.support.readers import _read, _sg, _write_jsonl

pytestmark = pytest.mark.usefixtures("single_thread")


def _records(n: int, prefix: str = "q") -> list[dict]:
    return [_sg(("human", f"{prefix}{i}"), ("gpt", f"answer {i}")) for i in range(n)]


def _lines(report, reason: str, directory: Path) -> list[str]:
    """The one-line messages of `reason`, with the files' directory left out."""
    return [str(b).replace(f"{directory}/", "") for b in report.examples[reason]]


def _ids(convs) -> list[str]:
    return [c["id"] for c in convs]


def _garbage(n: int, seed: int = 0) -> bytes:
    """Random bytes that hold a NUL early and do not start like JSON (seeded: the same bytes every run)."""
    data = random.Random(seed).randbytes(n)
    assert 0 <= data.find(b"\0") < 1000 and data[:1] not in (b"[", b"{")
    return data


# --- a) files cut short -------------------------------------------------------------------------------------


def test_json_list_cut_keeps_the_records_before_and_names_the_byte(tmp_path):
    full = json.dumps(_records(4), indent=1).encode()
    inside = full.index(b'"q2"') + 3  # in the middle of record #2 (line 26)
    after_comma = full.index(b"\n },", full.index(b'"q1"')) + 4  # just past the comma closing record #1 (line 25)
    cases = {  # name: (bytes, records kept, where the bad record is, how the file ends)
        "inside.json": (full[:inside], 2, "#2 (line 26)", "inside this record"),
        "comma.json": (full[:after_comma], 2, "#2 (line 25)", "inside this record"),
        "unclosed.json": (full.rstrip()[:-1], 4, "#4 (line 50)", "before the list's closing ']'"),
    }
    for name, (data, kept, where, end) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        convs, report = _read(path)
        assert _ids(convs) == [f"{path.stem}-{i}" for i in range(kept)], name
        assert _lines(report, "invalid_json", tmp_path) == [
            f"{name}:{where}: invalid_json (file cut short: it ends at byte {len(data)}, {end})"]
        assert report.total == 1


def test_json_syntax_error_names_line_column_and_byte(tmp_path):
    full = json.dumps(_records(4), indent=1).encode()
    broken = full.replace(b'"q2"', b'q2"')
    path = tmp_path / "syntax.json"
    path.write_bytes(broken)
    convs, report = _read(path)
    assert _ids(convs) == ["syntax-0", "syntax-1"]
    byte = broken.index(b'q2"')
    assert _lines(report, "invalid_json", tmp_path) == [
        f"syntax.json:#2 (line 26): invalid_json (Expecting value at line 30 column 14 (byte {byte}); rest of file "
        "unread)"]
    (tmp_path / "one.json").write_text('{"instruction": "cut here')  # one object, not a list
    _, report = _read(tmp_path / "one.json")
    assert _lines(report, "invalid_json", tmp_path) == [
        "one.json:1: invalid_json (file cut short: it ends at byte 25, inside this record)"]


def test_jsonl_last_line_cut_is_that_line_only(tmp_path):
    path = tmp_path / "cut.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in _records(4))
    path.write_text(text[:-30])
    convs, report = _read(path)
    assert _ids(convs) == ["cut-0", "cut-1", "cut-2"]
    assert _lines(report, "invalid_json", tmp_path) == ["cut.jsonl:4: invalid_json (Expecting value at column 63)"]


# --- b) bytes that are not UTF-8 -----------------------------------------------------------------------------


def test_undecodable_byte_costs_its_record_only(tmp_path):
    full = json.dumps(_records(4), indent=1).encode()
    for name, data in {"list.json": full.replace(b"answer 1", b"answer \xff1"),
                       "bom.json": b"\xef\xbb\xbf" + full.replace(b"answer 1", b"an\xc3swer 1")}.items():
        path = tmp_path / name
        path.write_bytes(data)
        convs, report = _read(path)
        assert _ids(convs) == [f"{path.stem}-{i}" for i in (0, 2, 3)], name
        byte = data.index(b"\xff" if name == "list.json" else b"\xc3s")
        assert _lines(report, "not_utf8", tmp_path) == [f"{name}:#1 (line 14): not_utf8 (byte {byte})"]
    # Outside a string it breaks the syntax: the records before it are kept.
    data = full.replace(b'"q2"', b'\x80"q2"')
    (tmp_path / "struct.json").write_bytes(data)
    convs, report = _read(tmp_path / "struct.json")
    assert _ids(convs) == ["struct-0", "struct-1"]
    byte = data.index(b"\x80")
    assert _lines(report, "not_utf8", tmp_path) == [
        f"struct.json:#2 (line 26): not_utf8 (byte {byte}; rest of file unread)"]
    path = tmp_path / "lines.jsonl"
    lines = [json.dumps(r).encode().replace(b"q1", b"q\xfe1") + b"\n" for r in _records(3)]
    path.write_bytes(b"".join(lines))
    convs, report = _read(path)
    assert _ids(convs) == ["lines-0", "lines-2"]
    byte = lines[1].index(b"\xfe")
    assert _lines(report, "not_utf8", tmp_path) == [f"lines.jsonl:2: not_utf8 (byte {byte} of the line)"]


# --- c) binary garbage and broken gzip -----------------------------------------------------------------------


def test_binary_files_are_one_line_each_and_the_good_file_beside_them_is_read(tmp_path):
    _write_jsonl(tmp_path / "good.jsonl", _records(2))
    garbage = _garbage(64 * 1024)
    nul = garbage.index(b"\0")
    line = garbage.count(b"\n", 0, nul) + 1
    for name in ("random.json", "random.jsonl"):
        (tmp_path / name).write_bytes(garbage)
    (tmp_path / "random.jsonl.gz").write_bytes(garbage)  # not gzip at all
    (tmp_path / "text.json.gz").write_text(json.dumps(_records(1)))  # JSON, but not gzipped
    convs, report = _read(tmp_path)
    assert _ids(convs) == ["good-0", "good-1"]
    assert report.counts == {"binary_file": 2, "bad_gzip": 2}
    binary = f"binary_file (a NUL byte at byte {nul}: binary data, not JSON text; file skipped)"
    assert _lines(report, "binary_file", tmp_path) == [f"random.json:{line}: {binary}",
                                                             f"random.jsonl:{line}: {binary}"]
    assert _lines(report, "bad_gzip", tmp_path) == [
        f"random.jsonl.gz:1: bad_gzip (not gzip data (Not a gzipped file ({garbage[:2]!r})); file skipped)",
        "text.json.gz:1: bad_gzip (not gzip data (Not a gzipped file (b'[{')); file skipped)"]


def test_gzip_cut_short_keeps_what_came_before(tmp_path):
    rng = random.Random(1)  # varied text, so the compressed stream grows with the records
    records = [_sg(("human", f"q{i} " + " ".join(str(rng.random()) for _ in range(8))), ("gpt", "a"))
               for i in range(200)]
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    jsonl = gzip.compress(b"".join(lines))
    (tmp_path / "cut.jsonl.gz").write_bytes(jsonl[:len(jsonl) // 2])
    convs, report = _read(tmp_path / "cut.jsonl.gz")
    n = len(convs)
    assert 50 < n < 150 and _ids(convs) == [f"cut-{i}" for i in range(n)]
    assert _lines(report, "bad_gzip", tmp_path) == [
        f"cut.jsonl.gz:{n + 1}: bad_gzip (the gzip stream breaks after {sum(map(len, lines[:n]))} uncompressed bytes "
        "(EOFError: Compressed file ended before the end-of-stream marker was reached); rest of file unread)"]
    whole = gzip.compress(json.dumps(records, indent=1).encode())
    (tmp_path / "cut.json.gz").write_bytes(whole[:len(whole) // 2])
    convs, report = _read(tmp_path / "cut.json.gz")
    n = len(convs)
    assert 50 < n < 150 and report.counts == {"bad_gzip": 1}
    # Record #n starts on line 2 + 12 n: "[" on line 1, then 12 lines a record at indent=1.
    assert str(report.examples["bad_gzip"][0].location).endswith(f"cut.json.gz:#{n} (line {2 + 12 * n})")
    (tmp_path / "trailer.json.gz").write_bytes(whole[:-4])  # only the size trailer lost: every record is there
    convs, report = _read(tmp_path / "trailer.json.gz")
    assert len(convs) == 200 and report.counts == {"bad_gzip": 1}


# --- d) a 50 MB turn ----------------------------------------------------------------------------------------


def test_a_50mb_turn_is_rejected_before_the_tokenizer(tmp_path):
    huge = "x" * 50_000_000
    path = _write_jsonl(tmp_path / "huge.jsonl", [_sg(("human", "before")), _sg(("human", "paste:"), ("gpt", huge)),
                                                  _sg(("human", "after"))])
    t0 = time.perf_counter()
    convs, report = _read(path)
    assert time.perf_counter() - t0 < 10
    assert _ids(convs) == ["huge-0", "huge-2"]
    assert _lines(report, "turn_too_long", tmp_path) == [
        "huge.jsonl:2: turn_too_long (turn 1 (assistant): 50,000,000 characters, data.max_turn_chars=1,000,000)"]
    assert DataConfig().max_turn_chars == 1_000_000


def test_max_turn_chars_is_a_typed_setting(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [
        _sg(("human", "short"), ("gpt", "x" * 11)),
        {"question_id": 7, "turns": ["fine", "y" * 12]},  # an MT-bench follow-up counts too
        _sg(("human", "ok"), ("gpt", "ok")),
    ])
    report = BadRecordReport()
    assert _ids(read_sources(DataConfig(sources=[str(path)], max_turn_chars=10), report)) == ["t-2"]
    assert _lines(report, "turn_too_long", tmp_path) == [
        "t.jsonl:1: turn_too_long (turn 1 (assistant): 11 characters, data.max_turn_chars=10)",
        "t.jsonl:2: turn_too_long (turns[1]: 12 characters, data.max_turn_chars=10)"]
    assert _ids(read_sources(DataConfig(sources=[str(path)], max_turn_chars=None), report)) == ["t-0", "7", "t-2"]
    with pytest.raises(ValueError, match="data.max_turn_chars=0: a number of characters >= 1, or null"):
        DataConfig(max_turn_chars=0)
    assert compose_cfg(["data.max_turn_chars=5000"]).data.max_turn_chars == 5000
    assert compose_cfg(["data.max_turn_chars=null"]).data.max_turn_chars is None


# --- e) broken turn structure ---------------------------------------------------------------------------------


def test_each_broken_turn_structure_is_one_line(tmp_path):
    path = _write_jsonl(tmp_path / "roles.jsonl", [
        _sg(("gpt", "tail of an earlier piece"), ("human", "Q"), ("gpt", "A")),  # fixed: the tail is dropped
        _sg(("human", "Q"), ("gpt", "")),
        _sg(("human", " \t\n "), ("gpt", "A")),
        {"messages": [{"role": "user", "content": "Q"}, {"role": "tool", "content": "r"}]},
        _sg(("human", "Q"), ("human", "Q again")),
        _sg(("human", "Q"), ("gpt", "A"), ("gpt", "A again")),
        _sg(("human", "Q"), ("system", "late system prompt")),
        _sg(("gpt", "an answer without its question")),
        _sg(("human", "fine"), ("gpt", "ok")),
    ])
    convs, report = _read(path)
    assert _ids(convs) == ["roles-0", "roles-8"]
    assert convs[0]["messages"][0] == {"role": "user", "content": "Q"}
    got = sorted(line for reason in report.examples for line in _lines(report, reason, tmp_path))
    assert got == [
        "roles.jsonl:2: empty_content (turn 1 (assistant))",
        "roles.jsonl:3: empty_content (turn 0 (user))",
        "roles.jsonl:4: unknown_role (messages[1].role='tool')",
        "roles.jsonl:5: not_alternating (turns 0 and 1 are both user)",
        "roles.jsonl:6: not_alternating (turns 1 and 2 are both assistant)",
        "roles.jsonl:7: system_not_first (turn 1)",
        "roles.jsonl:8: no_user_turn",
    ]
    d = report.to_dict()
    assert d["total"] == 7 and d["fixes"] == {"leading_assistant_dropped": 1}
    assert d["counts"] == {"empty_content": 2, "unknown_role": 1, "not_alternating": 2, "system_not_first": 1,
                           "no_user_turn": 1}


# --- the dump stage through the CLI: every hostile file counted in its manifest --------------------------------


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")


def _hostile_dir(root: Path) -> Path:
    """Seven files, nine good conversations, seven bad records, one fix."""
    data = root / "data"
    data.mkdir()
    _write_jsonl(data / "good.jsonl", _records(3, "good "))
    full = json.dumps(_records(4, "cut "), indent=1).encode()
    (data / "cut.json").write_bytes(full[:full.index(b'"cut 2"') + 3])
    (data / "utf8.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in _records(3, "utf8 "))
                                      .replace(b"utf8 1", b"utf8 \xff1"))
    (data / "random.jsonl").write_bytes(_garbage(4096))
    (data / "random.jsonl.gz").write_bytes(_garbage(4096, seed=2))
    _write_jsonl(data / "long.jsonl", [_sg(("human", "long"), ("gpt", "z" * 2000)), *_records(1, "long ")])
    _write_jsonl(data / "roles.jsonl", [_sg(("gpt", "tail"), ("human", "roles 0"), ("gpt", "A")),
                                        _sg(("human", "Q"), ("bot", "A")), _sg(("human", "   "), ("gpt", "A"))])
    return data


def test_the_dump_stage_counts_every_hostile_file_and_keeps_the_good_records(tiny_model_dir, tmp_path):
    data = _hostile_dir(tmp_path)
    cmd = [sys.executable, "-m", "pipeline.run", "stage=dump", "dump.input=data", "target=hf",
           f"target.path={tiny_model_dir}", "target.name=tiny", "name=h", f"output_root={tmp_path}",
           f"data.sources=[{{path: '{data}'}}]", "data.max_turn_chars=1000"]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = load_manifest(tmp_path / "h" / "dump", "dump")
    assert manifest["counts"]["conversations"] == manifest["counts"]["samples"] == 9
    bad = manifest["bad_records"]
    assert bad["counts"] == {"bad_gzip": 1, "binary_file": 1, "empty_content": 1, "invalid_json": 1, "not_utf8": 1,
                             "turn_too_long": 1, "unknown_role": 1}
    assert bad["fixes"] == {"leading_assistant_dropped": 1}
    assert sorted(Path(f).name for f in bad["by_file"]) == ["cut.json", "long.jsonl", "random.jsonl",
                                                             "random.jsonl.gz", "roles.jsonl", "utf8.jsonl"]
    garbage = _garbage(4096)
    binary_line = garbage.count(b"\n", 0, garbage.index(b"\0")) + 1
    where = {reason: examples[0]["where"].replace(f"{data}/", "") for reason, examples in bad["examples"].items()}
    assert where == {"bad_gzip": "random.jsonl.gz:1", "empty_content": "roles.jsonl:3",
                     "binary_file": f"random.jsonl:{binary_line}",
                     "invalid_json": "cut.json:#2 (line 26)", "not_utf8": "utf8.jsonl:2",
                     "turn_too_long": "long.jsonl:1", "unknown_role": "roles.jsonl:2"}
    log = out.stdout + out.stderr
    assert "bad records: 7" in log and "Traceback" not in log
    table = {line.split()[0]: line for line in log.splitlines() if line.split()[:1] and line.split()[0] in where}
    for reason, example in where.items():  # the logged summary: one line per reason, with its first example
        assert table[reason].split()[1] == "1" and f"{data}/{example}" in table[reason], reason


# --- f) a target path that is no model ------------------------------------------------------------------------


def test_a_target_path_that_is_no_model_is_one_line(tmp_path):
    empty, only_gguf, no_weights = tmp_path / "empty", tmp_path / "only_gguf", tmp_path / "no_weights"
    for d in (empty, only_gguf, no_weights):
        d.mkdir()
    (only_gguf / "model.gguf").write_bytes(b"GGUF")
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "notes.gguf").write_text("not a model\n")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    cases = [
        (empty, f"target.path={empty}: not an HF model directory (an empty directory)"),
        (only_gguf, f"target.path={only_gguf}: not an HF model directory (no config.json in it); for its GGUF, set "
                    f"target.path={only_gguf / 'model.gguf'}"),
        (tmp_path / "notes.gguf", f"{tmp_path / 'notes.gguf'}: not a GGUF file (it starts with b'not '; a GGUF "
                                  "starts with b'GGUF')"),
        (tmp_path / "weights.bin", f"target.path={tmp_path / 'weights.bin'}: a file, but neither a .gguf file nor an "
                                   "HF model directory"),
        (no_weights, f"{no_weights}: cannot be loaded: OSError: Error no file named model.safetensors"),
        (tmp_path / "missing.gguf", f"target.path={tmp_path / 'missing.gguf'}: GGUF file not found"),
        (tmp_path / "missing", f"target.path={tmp_path / 'missing'}: no such path"),
    ]
    for path, message in cases:
        with pytest.raises((TargetError, FileNotFoundError)) as e:
            load_target(TargetConfig(path=str(path), gguf_package=None, cache_dir=str(tmp_path / "cache")))
        assert str(e.value).startswith(message) and "\n" not in str(e.value), path
        assert is_user_error(e.value)  # the CLI prints it as one line: eaglet: <stage>: <Type>: <message>


def test_the_cli_names_a_target_that_is_no_model_in_one_line(cli, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>\n")  # what a failed download leaves
    out = cli(["stage=eval", "target=hf", f"target.path={fake}", "target.name=x", "name=h", f"output_root={tmp_path}"],
              env=_env())
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"eaglet: eval: TargetError: {fake}: not a GGUF file (it starts with b'<htm'; a GGUF starts with b'GGUF')")


# --- g) a head of another target, an override of the wrong type -----------------------------------------------


def test_a_head_trained_for_another_target_is_refused_naming_both(tiny_model, tiny_model_dir, tiny_tokenizer,
                                                                   tmp_path):
    from pipeline.eval.subjects import build_drafter
    from pipeline.export.run import main as export_main
    from tests.support.exports import fake_train_stage, make_head, stage_config
    from tests.support.tiny import build_tiny_llama

    cfg = stage_config(tmp_path, tiny_model_dir)
    train_dir = fake_train_stage(cfg, make_head(tiny_model))
    other = tmp_path / "other_target"
    build_tiny_llama(len(tiny_tokenizer), seed=1).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    other_cfg = stage_config(tmp_path, other)
    with pytest.raises(ManifestError) as e:
        export_main(other_cfg)
    lines = str(e.value).splitlines()
    assert lines[0] == "target weights digest mismatch:"
    assert lines[1].startswith(f"  current target tiny ({other}): ")
    assert lines[2].startswith(f"  {train_dir / 'manifest.json'} (target tiny, {tiny_model_dir}): ")
    assert is_user_error(e.value) and not other_cfg.stage_dir("export").exists()
    with pytest.raises(ManifestError, match="target weights digest mismatch"):
        build_drafter(other_cfg, load_target(other_cfg.target))


def test_an_override_of_the_wrong_type_names_the_key():
    for override, kind in (("train.epochs=abc", "Integer"), ("data.max_turn_chars=lots", "Integer"),
                           ("train.lr=fast", "Float")):
        with pytest.raises(Exception) as e:
            compose_cfg([override])
        key, value = override.split("=")
        text = f"{e.value}\n{e.value.__cause__}"
        assert f"Value '{value}' of type 'str' could not be converted to {kind}" in text, override
        assert f"full_key: {key}" in text, override


def test_a_value_the_schema_refuses_is_one_line_from_the_cli(cli):
    done = cli(["stage=train", "data.max_turn_chars=0"])
    assert done.returncode == 1
    assert done.stderr.strip() == ("eaglet: config: ValueError: data.max_turn_chars=0: a number of characters >= 1, "
                                   "or null for no limit"), done.stderr
