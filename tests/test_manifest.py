import json

import pytest

from pipeline.manifest import SCHEMA_VERSION, ManifestError, check_target, load_manifest, write_manifest
from pipeline.target import TargetConfig


def test_write_and_load_roundtrip_with_input_digest(tmp_path):
    a = tmp_path / "regen"
    write_manifest(a, "regen", TargetConfig(), counts={"conversations": 3}, timings={"total_s": 1.5})
    b = tmp_path / "dump"
    write_manifest(b, "dump", {"x": 1}, counts={}, timings={}, inputs=[a], target={"name": "t"})
    doc = load_manifest(b, expect_stage="dump")
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["inputs"][0]["path"] == str(a) and len(doc["inputs"][0]["manifest_sha256"]) == 64
    assert load_manifest(a)["config"]["name"] == "smollm2_135m"
    assert doc["code_version"]
    assert not list(b.glob(".*.tmp"))  # atomic write leaves no temporary behind


def test_missing_wrong_stage_and_schema(tmp_path):
    with pytest.raises(ManifestError, match="no manifest; run the regen stage first"):
        load_manifest(tmp_path, expect_stage="regen")
    write_manifest(tmp_path, "dump", {}, {}, {})
    with pytest.raises(ManifestError, match="written by stage 'dump', expected 'regen'"):
        load_manifest(tmp_path, expect_stage="regen")
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc["schema_version"] = 999
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="schema_version 999"):
        load_manifest(tmp_path)


def test_target_mismatch_names_both_sides(tmp_path):
    fp = {"name": "a", "source": "/a", "config_digest": "1", "tokenizer_digest": "2", "weights_digest": "3"}
    other = dict(fp, name="b", source="/b", tokenizer_digest="X")
    check_target(fp, {"target": fp}, tmp_path / "manifest.json")
    with pytest.raises(ManifestError) as e:
        check_target(fp, {"target": other}, tmp_path / "manifest.json")
    msg = str(e.value)
    assert "tokenizer digest mismatch" in msg and "current target a (/a)" in msg and "target b, /b" in msg


def test_served_input_without_weights_digest_checks_config_and_tokenizer(tmp_path):
    fp = {"name": "a", "source": "/a", "config_digest": "1", "tokenizer_digest": "2", "weights_digest": "3"}
    served = dict(fp, source="http://127.0.0.1:8000/v1", weights_digest=None)
    check_target(fp, {"target": served}, tmp_path / "manifest.json")
    with pytest.raises(ManifestError, match="tokenizer digest mismatch"):
        check_target(fp, {"target": dict(served, tokenizer_digest="X")}, tmp_path / "manifest.json")
