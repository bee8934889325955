"""A disk that fills up in the middle of a write: regen, dump, a training checkpoint and an export each write
into a small tmpfs mounted on their output folder. The stage stops with a one-line message, leaves no
manifest and no temporary file (nothing the next stage would read, nothing that keeps the disk full), and a
rerun after the space is freed completes with the same result as a run that never met a full disk.

Needs root for `mount -t tmpfs` (CI runs as root); skipped with the reason otherwise."""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from pipeline.export.run import main as export_main
from pipeline.files import sha256_file
from pipeline.manifest import MANIFEST, disk_full
from pipeline.regen.run import main as regen_main
from pipeline.train.run import main as train_main
from tests.support.integrity import DUMP, train_cfg
from tests.support.regen import _cfg as regen_cfg
from tests.support.regen import _records
from tests.support.tiny_runs import EXPERIMENT, build_tiny_dump, overrides, run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


class SmallDisk:
    """A tmpfs of `size` bytes mounted on `path` (which must not exist yet); `grow` frees space by remounting
    it bigger with its files kept."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk tests need root")

    def grow(self, size: int = 256 << 20) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disks():
    disks = []
    yield lambda path, size: disks.append(SmallDisk(path, size)) or disks[-1]
    for disk in disks:
        disk.unmount()


def used_bytes(path: Path) -> int:
    """Bytes a tmpfs holding `path`'s files takes (whole pages per file)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.rglob("*") if p.is_file())


def files(path: Path, pattern: str = "*") -> dict[str, str]:
    """sha256 of each file below `path` but the manifest and the lock (timings and pids differ by run)."""
    return {str(p.relative_to(path)): sha256_file(p) for p in sorted(path.rglob(pattern))
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".eaglet-lock")}


def assert_stopped_cleanly(run, out_dir: Path) -> None:
    with pytest.raises(BaseException) as e:
        run()
    assert disk_full(e.value), repr(e.value)
    assert not (out_dir / MANIFEST).exists()
    assert [p.name for p in out_dir.rglob("*.tmp")] == []


def test_regen_on_a_full_disk_stops_then_resumes_to_the_same_answers(tmp_path, tiny_model_dir, small_disks):
    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    ref = regen_cfg(tmp_path / "ref", tiny_model_dir, source, max_new_tokens=24)
    regen_main(ref)
    cfg = regen_cfg(tmp_path / "full", tiny_model_dir, source, max_new_tokens=24)
    disk = small_disks(cfg.stage_dir("regen"), used_bytes(ref.stage_dir("regen")) // 2)
    assert_stopped_cleanly(lambda: regen_main(cfg), cfg.stage_dir("regen"))
    disk.grow()
    regen_main(cfg)
    assert files(cfg.stage_dir("regen") / "shards") == files(ref.stage_dir("regen") / "shards")


def test_dump_checkpoint_and_export_on_a_full_disk(tmp_path, tiny_model_dir, shared_data, small_disks):
    ref_root = build_tiny_dump(tmp_path / "ref", tiny_model_dir, shared_data, **DUMP)
    ref_dump = ref_root / EXPERIMENT / "dump"

    # dump: a shard write meets the full disk
    root = tmp_path / "full"
    disk = small_disks(root / EXPERIMENT / "dump", used_bytes(ref_dump) // 2)
    assert_stopped_cleanly(lambda: build_tiny_dump(root, tiny_model_dir, shared_data, **DUMP), disk.path)
    assert len(list(disk.path.glob("shard-*.arrow"))) >= 1  # the complete shards before it stay, for the rerun
    disk.grow()
    build_tiny_dump(root, tiny_model_dir, shared_data, **DUMP)
    assert files(disk.path, "shard-*.arrow") == files(ref_dump, "shard-*.arrow")  # progress/ records hold timings

    # a training checkpoint: the second one of the run does not fit
    ref = train_cfg(ref_root, tiny_model_dir, max_steps=4, save_every=2)
    train_main(ref)
    ref_train = ref_root / EXPERIMENT / "train" / "h"
    cfg = dataclasses.replace(ref, output_root=str(root))
    ckpt_bytes = used_bytes(ref_train / "checkpoints" / "step-2")
    disk = small_disks(root / EXPERIMENT / "train" / "h", int(ckpt_bytes * 1.5))
    assert_stopped_cleanly(lambda: train_main(cfg), disk.path)
    assert not (disk.path / "final").exists()
    disk.grow()
    train_main(cfg)
    assert files(disk.path / "final") == files(ref_train / "final")

    # an export: the weights do not fit
    export_main(ref)
    ref_export = ref_root / EXPERIMENT / "export" / "h"
    disk = small_disks(root / EXPERIMENT / "export" / "h", 8192)
    assert_stopped_cleanly(lambda: export_main(cfg), disk.path)
    assert list(disk.path.iterdir()) == [] or all(p.name.startswith(".eaglet-lock") for p in disk.path.iterdir())
    disk.grow()
    done = run_cli({**overrides(root, tiny_model_dir, "eagle3", "h"), "stage": "export"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert files(disk.path) == files(ref_export)


def test_the_cli_says_so_in_one_line(tmp_path, tiny_model_dir, shared_data, small_disks):
    root = tmp_path
    small_disks(root / EXPERIMENT / "dump", 64 << 10)
    d = {**overrides(root, tiny_model_dir, "eagle3", "h"), "stage": "dump", "dump.input": "data",
         "dump.shard_bytes": DUMP["shard_bytes"], "data.max_length": 96,
         "data.sources": f"[{{path: {shared_data}/alpaca_en_demo/alpaca_en_demo.json, limit: 48}}]"}
    done = run_cli(d)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [x[x.index("eaglet: "):] for x in done.stderr.splitlines() if "eaglet: " in x]  # after a progress bar
    assert len(lines) == 1, done.stderr[-2000:]
    line = lines[0]
    assert line.startswith(f"eaglet: dump: DiskFull: no space left on the device under {root / EXPERIMENT / 'dump'} (")
    assert "No space left on device" in line and "rerun the same command" in line, line
