"""Corruption never trains, NaN never becomes a head: every reader of a dump checks each shard's sha256 against
the manifest (opt-out train.verify_inputs=false), resumed checkpoints, trained heads and exports are checked
against the digests recorded when they were written, a non-finite hidden state, loss or gradient stops
training with the step, shard and row (or is skipped and counted), and a head with non-finite weights is
refused on load. Each on the tiny dump of tests/support/tiny_runs.py, through the real stage functions."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.export.exporter import load_export
from pipeline.export.run import main as export_main
from pipeline.files import atomic_write_text, sha256_file
from pipeline.heads.io import FINAL, HEAD_WEIGHTS, NonFiniteWeights, load_head
from pipeline.hidden_states.reader import DumpReader
from pipeline.manifest import MANIFEST, ManifestError, file_digests, load_manifest
from pipeline.target import load_target
from pipeline.train.loop import NonFiniteError
from pipeline.train.run import main as train_main
from tests.support.integrity import DUMP, train_cfg
from tests.support.tiny_runs import EXPERIMENT, build_tiny_dump, tiny_target

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def root(dump_root_once, tmp_path) -> Path:
    """A private copy of the tiny dump's outputs root (tests damage it)."""
    shutil.copytree(dump_root_once, tmp_path / "out")
    return tmp_path / "out"


@pytest.fixture(scope="module")
def dump_root_once(tmp_path_factory, tiny_model_dir, shared_data) -> Path:
    return build_tiny_dump(tmp_path_factory.mktemp("integrity"), tiny_model_dir, shared_data, **DUMP)


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def rerecord_shard(dump_dir: Path, file: str) -> None:
    """The manifest's digest of a shard made anew, as if the dump had written these bytes itself."""
    manifest = load_manifest(dump_dir)
    for entry in manifest["shards"]:
        if entry["file"] == file:
            entry["sha256"] = sha256_file(dump_dir / file)
    atomic_write_text(dump_dir / MANIFEST, json.dumps(manifest, indent=2))


# -- dump shards ------------------------------------------------------------------------------------------


def test_train_refuses_a_corrupt_shard_and_the_dump_repairs_it(root, tiny_model_dir, shared_data):
    dump_dir = root / EXPERIMENT / "dump"
    shard = sorted(dump_dir.glob("shard-*.arrow"))[1]
    original = shard.read_bytes()
    flip_byte(shard)
    with pytest.raises(ManifestError, match=rf"{shard.name}: sha256 .* \(corrupt\); delete that shard file and "
                                            r"rerun the dump stage"):
        train_main(train_cfg(root, tiny_model_dir))
    assert not (root / EXPERIMENT / "train" / "h" / "checkpoints").exists()  # nothing trained

    shard.write_bytes(original[: len(original) // 2])  # truncated: named by its size alone
    with pytest.raises(ManifestError, match=rf"{shard.name}: {len(original) // 2} bytes, recorded "
                                            rf"{len(original)} \(truncated\?\)"):
        DumpReader(dump_dir)
    shard.unlink()  # the repair the message gives
    with pytest.raises(ManifestError, match=rf"{shard.name}: missing"):
        DumpReader(dump_dir)
    build_tiny_dump(root, tiny_model_dir, shared_data, **DUMP)
    assert shard.read_bytes() == original and DumpReader(dump_dir).verify() == []


def test_the_opt_out_skips_the_digest_but_not_the_size(root):
    dump_dir = root / EXPERIMENT / "dump"
    shard = sorted(dump_dir.glob("shard-*.arrow"))[0]
    flip_byte(shard, at=0.9)
    assert len(DumpReader(dump_dir, verify=False)) > 0  # the user verified otherwise
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ManifestError, match="truncated"):
        DumpReader(dump_dir, verify=False)


# -- checkpoints, heads, exports --------------------------------------------------------------------------


def test_a_corrupt_checkpoint_is_not_resumed(root, tiny_model_dir):
    train_main(train_cfg(root, tiny_model_dir, max_steps=2))
    ckpt_dir = root / EXPERIMENT / "train" / "h" / "checkpoints" / "step-2"
    assert set(json.loads((ckpt_dir / "trainer_state.json").read_text())["files"]) >= {"optimizer.pt", HEAD_WEIGHTS}
    flip_byte(ckpt_dir / "optimizer.pt", at=0.7)
    (root / EXPERIMENT / "train" / "h" / MANIFEST).unlink()
    with pytest.raises(ManifestError, match=r"checkpoint .*step-2: optimizer\.pt: sha256 .*corrupt.*delete "
                                            r".*step-2 and rerun"):
        train_main(train_cfg(root, tiny_model_dir, max_steps=4))


def test_corrupt_or_non_finite_heads_and_exports_are_refused(root, tiny_model_dir):
    cfg = train_cfg(root, tiny_model_dir, max_steps=2)
    train_main(cfg)
    train_dir = root / EXPERIMENT / "train" / "h"
    target = load_target(tiny_target(tiny_model_dir))
    export_main(cfg)
    export_dir = next((root / EXPERIMENT / "export" / "h").glob("sglang"))
    assert set(load_manifest(export_dir)["files"]) == {"config.json", "model.safetensors"}
    load_export(export_dir, target)  # intact: loads

    flip_byte(export_dir / "model.safetensors", at=0.8)
    with pytest.raises(ManifestError, match=r"export .*: model\.safetensors: sha256 .*rerun the export stage"):
        load_export(export_dir, target)

    weights = train_dir / FINAL / HEAD_WEIGHTS
    good = weights.read_bytes()
    flip_byte(weights, at=0.8)
    with pytest.raises(ManifestError, match=r"trained head .*model\.safetensors: sha256 .*rerun the train stage"):
        load_head(train_dir, target)

    # A head that is intact but non-finite (as a NaN run of an older eaglet would leave): refused by name.
    from safetensors.torch import load_file, save_file

    weights.write_bytes(good)
    state = load_file(str(weights))
    name = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    manifest = load_manifest(train_dir)
    manifest["head_files"] = file_digests(train_dir / FINAL)
    atomic_write_text(train_dir / MANIFEST, json.dumps(manifest))
    with pytest.raises(NonFiniteWeights, match=rf"non-finite weights in {name} \(1 of "):
        load_head(train_dir, target)


# -- NaN and inf in training ------------------------------------------------------------------------------


def poison_row(dump_dir: Path, row: int) -> str:
    """Writes NaN into one row's final states in the shard file (digests made anew: the dump itself made the
    NaN, say a target overflowing in fp16). Returns the row's location as training names it."""
    reader = DumpReader(dump_dir)
    sample, where = reader[row], reader.locate(row)
    shard = reader._shard(int(reader._shard_ix[row]))
    offset = sample.final_hidden.data_ptr() - shard.bytes.data_ptr()
    file = where.split(" ")[0]
    nan = torch.full((sample.final_hidden.shape[1],), float("nan"), dtype=sample.final_hidden.dtype)
    with open(dump_dir / file, "r+b") as f:  # the row's first token
        f.seek(offset)
        f.write(nan.view(torch.uint8).numpy().tobytes())
    rerecord_shard(dump_dir, file)
    return where


def test_a_nan_state_stops_training_with_its_shard_and_row_or_is_skipped(root, tiny_model_dir):
    from pipeline.train.data import split_train_val

    dump_dir = root / EXPERIMENT / "dump"
    row = split_train_val(len(DumpReader(dump_dir)), 0.15, 0)[0][3]  # a training row
    where = poison_row(dump_dir, row)
    assert where.startswith("shard-") and " row " in where and "(id " in where
    with pytest.raises(NonFiniteError, match=r"step \d+: non-finite hidden states in " + where.replace("(", r"\(")
                       .replace(")", r"\)") + "[.;] .*train.on_nonfinite=skip"):
        train_main(train_cfg(root, tiny_model_dir))

    train_main(train_cfg(root, tiny_model_dir, name="skip", epochs=2, on_nonfinite="skip"))
    train_dir = root / EXPERIMENT / "train" / "skip"
    assert load_manifest(train_dir)["counts"]["skipped_nonfinite_rows"] == 2  # seen once per epoch
    head = load_head(train_dir, load_target(tiny_target(tiny_model_dir)))
    assert all(torch.isfinite(p).all() for p in head.parameters())


def test_a_non_finite_loss_stops_training_or_its_steps_are_skipped(root, tiny_model_dir):
    # lr 1e30: the first update throws the weights so far that the next forward overflows.
    with pytest.raises(NonFiniteError, match=r"step 2: a non-finite loss on the micro-batches of shard-.*"
                                             r"train.on_nonfinite=skip"):
        train_main(train_cfg(root, tiny_model_dir, lr=1e30, warmup_steps=0, max_steps=3))
    train_main(train_cfg(root, tiny_model_dir, name="skip", lr=1e30, warmup_steps=0, max_steps=3,
                         on_nonfinite="skip"))
    counts = load_manifest(root / EXPERIMENT / "train" / "skip")["counts"]
    assert counts["skipped_nonfinite_steps"] == 2 and counts["steps"] == 3


def test_in_deepspeed_order_a_nan_update_stops_the_run_before_a_checkpoint_holds_it(root, tiny_model_dir):
    """DeepSpeed steps inside backward, before the loop's verdict, and ZeRO-0 reports no gradient norm
    (tests/support/step_in_backward.py drives the real loop in that order). Step 3's gradient turns NaN behind a
    finite loss and its update is applied; the verdict checks the weights DeepSpeed applied and stops at step 3,
    so no checkpoint holds that head (checkpoints every step: the last is step 2's, finite)."""
    from safetensors.torch import load_file

    from pipeline.train import checkpoint as ckpt
    from pipeline.train.run import train
    from tests.support.step_in_backward import StepInBackward

    cfg = train_cfg(root, tiny_model_dir, name="ds", max_steps=4, save_every=1)
    par = StepInBackward(cfg.train, nan_gradient_at=3)
    try:
        with pytest.raises(NonFiniteError, match=r"step 3: non-finite weights after DeepSpeed's step\. .*"
                                                 r"train\.on_nonfinite=skip .*\(without DeepSpeed\)"):
            train(cfg, par)
    finally:
        par.end()
    last = ckpt.latest_checkpoint(root / EXPERIMENT / "train" / "ds")
    assert last.name == "step-2"
    assert all(torch.isfinite(v).all() for v in load_file(str(last / HEAD_WEIGHTS)).values() if v.is_floating_point())


def test_the_dump_refuses_a_changed_regen_shard(tmp_path, tiny_model_dir):
    from pipeline.hidden_states.run import main as dump_main
    from pipeline.regen.run import main as regen_main
    from tests.support.regen import _cfg as regen_cfg
    from tests.support.regen import _records

    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    cfg = regen_cfg(tmp_path, tiny_model_dir, source)
    regen_main(cfg)
    shard = cfg.stage_dir("regen") / "shards" / "shard-00001.jsonl"
    original = shard.read_text()
    shard.write_text(shard.read_text().replace('"value": "', '"value": "X', 1))  # one edited answer
    with pytest.raises(ManifestError, match=r"regen .*: shard shards/shard-00001\.jsonl: .*\(corrupt\); delete it "
                                            r"and .*state/done/shard-00001\.json, then rerun the regen stage"):
        dump_main(dataclasses.replace(cfg, stage="dump"))
    shard.unlink()  # the repair the message gives
    (cfg.stage_dir("regen") / "state" / "done" / "shard-00001.json").unlink()
    regen_main(cfg)
    assert shard.read_text() == original
    dump_main(dataclasses.replace(cfg, stage="dump"))


def test_skipping_non_finite_steps_is_refused_under_deepspeed():
    from pipeline.train.config import TrainConfig

    with pytest.raises(ValueError, match=r"on_nonfinite=skip cannot run under DeepSpeed \(train.deepspeed_config\)"):
        TrainConfig(on_nonfinite="skip", deepspeed_config="conf/deepspeed/zero2.json")


def test_a_target_with_truncated_weights_is_one_line(tmp_path, tiny_model_dir):
    from pipeline.target import TargetError

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted download
    with pytest.raises(TargetError, match=rf"{broken}: cannot be loaded: "):
        load_target(tiny_target(broken))
