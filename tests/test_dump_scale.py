"""A dump at terabyte scale (issue 33, part 3): the reader maps shards on demand and keeps at most
`max_open_shards` of them mapped, so a manifest of 100,000 shards (past Linux's vm.max_map_count of 65,530, one
map per shard) trains through the real train stage; and each shard is hashed once, so a requeued training run
does not re-read a verified dump, while a shard changed on disk afterwards (a byte flipped in place; a rewrite
renamed over it with its mtime restored) is still refused.

The 100k shards are a few real shards written by the real writer, hard-linked under 100k names (bench/scale_reader.py
`linked_dump`): a hard link costs one memory map per name like a distinct file."""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from bench.scale_reader import linked_dump
from pipeline.hidden_states.reader import INDEX_DIR, DumpReader, verify_shards
from pipeline.hidden_states.shards import VERIFIED_DIR, load_verified, record_verified, verdict
from pipeline.manifest import ManifestError, load_manifest
from pipeline.target import TargetConfig, load_target_parts
from pipeline.train.run import main as train_main
from tests.support.tiny_runs import EXPERIMENT, as_config, build_tiny_dump, overrides

pytestmark = pytest.mark.usefixtures("single_thread")


def mapped_files(folder: Path) -> set[str]:
    """Files of `folder` this process has memory-mapped now (one line of /proc/self/maps per map)."""
    prefix = str(folder.resolve()) + "/"
    out = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(None, 5)[5] if len(line.split(None, 5)) == 6 else ""
        if path.startswith(prefix):
            out.add(line)
    return out


def test_the_reader_keeps_a_bounded_number_of_shards_mapped(tmp_path):
    d = linked_dump(tmp_path / "dump", 300, rows_per_shard=2)
    reader = DumpReader(d, max_open_shards=8)
    assert len(reader) == 600 and len(mapped_files(d)) <= 8  # the index was built one shard at a time
    kept = reader[0]  # a returned sample keeps its shard's map alive; the cache still holds at most 8
    for i in range(len(reader)):
        reader[i]
        assert len(reader._shards) <= 8
    assert len(mapped_files(d)) <= 9
    del kept
    assert len(mapped_files(d)) <= 8

    # The index is cached beside the shards, keyed by the manifest's digest, and equals a rebuilt one.
    cached = list((d / INDEX_DIR).glob("*.npz"))
    assert len(cached) == 1
    manifest_bytes = (d / "manifest.json").read_bytes()
    again = DumpReader(d, max_open_shards=8)
    for a, b in zip((reader._shard_ix, reader._batch_ix, reader._row_ix, reader.lengths),
                    (again._shard_ix, again._batch_ix, again._row_ix, again.lengths)):
        assert (a == b).all() and a.dtype == b.dtype
    assert (d / "manifest.json").read_bytes() == manifest_bytes  # never touched

    # Ranks split the shards by manifest index, each recording its own verdicts.
    shutil.rmtree(d / VERIFIED_DIR)
    parts = [verify_shards(d, r, 3) for r in range(3)]
    assert sum(p.hashed for p in parts) == 300 and not any(p.problems for p in parts)
    assert sum(p.hashed for p in (verify_shards(d, r, 3) for r in range(3))) == 0


def test_100k_shards_train_a_step(tmp_path, tiny_model_dir, caplog):
    """Past vm.max_map_count: the old reader (every shard mapped for good) fails here with "unable to mmap ...
    Cannot allocate memory" at about 65k shards."""
    parts = load_target_parts(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None))
    dump_dir = tmp_path / EXPERIMENT / "dump"
    n = 100_000
    t0 = time.perf_counter()
    linked_dump(dump_dir, n, rows_per_shard=1, tokens=8, target=parts.fingerprint, vocab=300)
    # What the dump's writers record for shards they wrote (the writer recorded the real files; the names
    # made by os.link are recorded here, after the last link: a link changes the file's ctime).
    entries = load_manifest(dump_dir)["shards"]
    record_verified(dump_dir, [verdict(e["file"], e["sha256"], os.stat(dump_dir / e["file"])) for e in entries],
                    "dump")
    made = time.perf_counter() - t0

    cfg = as_config(overrides(tmp_path, tiny_model_dir, "eagle3", "h", epochs=1, max_steps=1, save_every=0,
                              eval_every=0, tau_prompts=0, plot=False, train_fraction=0.002, val_fraction=0.0005,
                              val_max_batches=1))
    with caplog.at_level(logging.INFO, logger="pipeline.train.run"):
        train_main(cfg)
    assert "dump verify (rank 0 of 1): 0 shards hashed, 100000 trusted" in caplog.text
    train_dir = tmp_path / EXPERIMENT / "train" / "h"
    manifest = load_manifest(train_dir)
    assert manifest["counts"]["steps"] == 1
    print(f"100k linked shards made in {made:.1f} s")


# -- hash once ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dump_root_once(tmp_path_factory, tiny_model_dir, shared_data) -> Path:
    return build_tiny_dump(tmp_path_factory.mktemp("scale"), tiny_model_dir, shared_data, shard_bytes=1 << 20)


def hashed_on_start(caplog) -> int:
    counts = re.findall(r"dump verify \(rank 0 of 1\): (\d+) shards hashed", caplog.text)
    assert len(counts) == 1, caplog.text
    caplog.clear()
    return int(counts[0])


def test_a_requeued_run_does_not_rehash_and_a_changed_shard_is_refused(dump_root_once, tmp_path, tiny_model_dir,
                                                                       caplog):
    root = tmp_path / "out"
    shutil.copytree(dump_root_once, root, copy_function=shutil.copy2)
    dump_dir = root / EXPERIMENT / "dump"
    n_shards = len(load_manifest(dump_dir)["shards"])
    assert n_shards >= 3
    # The dump's writers recorded their hashes, for the files they wrote (a copy is other inodes): an old
    # dump, without a record, is hashed once.
    assert set(load_verified(dump_dir)) == {e["file"] for e in load_manifest(dump_dir)["shards"]}
    shutil.rmtree(dump_dir / VERIFIED_DIR)
    manifest_bytes = (dump_dir / "manifest.json").read_bytes()

    def train(max_steps: int):
        # constant: the requeued run trains on to more steps under the same schedule (a cosine's would change)
        d = overrides(root, tiny_model_dir, "eagle3", "h", epochs=1, max_steps=max_steps, save_every=1,
                      eval_every=0, tau_prompts=0, plot=False, schedule="constant")
        with caplog.at_level(logging.INFO, logger="pipeline.train.run"):
            train_main(as_config(d))

    train(1)
    assert hashed_on_start(caplog) == n_shards
    train(2)  # the requeued run: resumes from step 1
    assert hashed_on_start(caplog) == 0
    assert (dump_dir / "manifest.json").read_bytes() == manifest_bytes  # the dump's identity never changes

    shard = dump_dir / load_manifest(dump_dir)["shards"][1]["file"]
    original = shard.read_bytes()
    refused = rf"shard {shard.name}: sha256 .* \(corrupt\); delete that shard file and rerun the dump stage"

    # 1. one byte flipped in place, same size
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=refused):
        train(3)
    with pytest.raises(ManifestError, match=refused):
        DumpReader(dump_dir)

    # 2. the good bytes back (hashed again, trusted again), then a rewrite renamed over it, mtime restored
    shard.write_bytes(original)
    assert verify_shards(dump_dir).hashed == 1 and verify_shards(dump_dir).hashed == 0
    st = shard.stat()
    tmp = shard.with_name(".rewrite.tmp")
    tmp.write_bytes(bytes(data))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, shard)
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(ManifestError, match=refused):
        train(3)

    # dump.verify's forced check re-reads every shard whatever the record says
    shard.write_bytes(original)
    forced = verify_shards(dump_dir, force=True)
    assert forced.hashed == n_shards and forced.problems == []
