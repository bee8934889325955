import json

import pytest

from pipeline.manifest import SCHEMA_VERSION, ManifestError, check_fingerprint, load_manifest, write_manifest
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
    check_fingerprint(fp, fp, tmp_path / "manifest.json")
    with pytest.raises(ManifestError) as e:
        check_fingerprint(fp, other, tmp_path / "manifest.json")
    msg = str(e.value)
    assert "tokenizer digest mismatch" in msg and "current target a (/a)" in msg and "target b, /b" in msg


def test_served_input_without_weights_digest_checks_config_and_tokenizer(tmp_path):
    fp = {"name": "a", "source": "/a", "config_digest": "1", "tokenizer_digest": "2", "weights_digest": "3"}
    served = dict(fp, source="http://127.0.0.1:8000/v1", weights_digest=None)
    check_fingerprint(fp, served, tmp_path / "manifest.json")
    with pytest.raises(ManifestError, match="tokenizer digest mismatch"):
        check_fingerprint(fp, dict(served, tokenizer_digest="X"), tmp_path / "manifest.json")


def test_typed_manifests_read_old_documents_keep_unknown_fields_and_refuse_undeclared_writes(tmp_path):
    """A stage's manifest is a dataclass (pipeline/manifest.py): a manifest written before a field existed reads
    as its default, a newer writer's field is kept in `extra`, and a write of a field the stage's class does not
    declare fails at once instead of reaching a reader that cannot know it."""
    from pipeline.manifest import RegenManifest, TrainManifest

    write_manifest(tmp_path / "regen", "regen", {}, {"conversations": 2}, {}, shards=[{"path": "shard-0.jsonl"}])
    regen = RegenManifest.load(tmp_path / "regen")
    assert regen.complete and regen.shards_missing == 0 and regen.thinking is None  # absent: older versions
    assert regen.shards == [{"path": "shard-0.jsonl"}] and regen.counts == {"conversations": 2}
    old = load_manifest(tmp_path / "regen")
    old["newer_field"] = 1
    assert RegenManifest.from_dict(old).extra == {"newer_field": 1}
    write_manifest(tmp_path / "train", "train", {}, {}, {}, head_config={"kind": "eagle3"})
    assert TrainManifest.load(tmp_path / "train").head_files is None  # loads unchecked, as before digests
    with pytest.raises(ManifestError, match="expected 'train'"):
        TrainManifest.load(tmp_path / "regen")
    with pytest.raises(TypeError, match=r"\['head_fils'\] are not fields of TrainManifest"):
        write_manifest(tmp_path / "train", "train", {}, {}, {}, head_fils={})
