"""pipeline/files.py: the one atomic writer (file and folder) and the one chunked hasher."""
import hashlib
import os

import pytest

from pipeline.files import atomic_dir, atomic_file, atomic_write_text, sha256_file, stale_tmp_siblings


def test_sha256_file_reads_in_chunks_and_matches_hashlib(tmp_path):
    path = tmp_path / "blob"
    data = os.urandom(3 * 1000 + 7)
    path.write_bytes(data)
    assert sha256_file(path, chunk=1000) == sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "doc.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_file(path) as f:
            f.write("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and sorted(p.name for p in path.parent.iterdir()) == ["doc.json"]
    with atomic_file(path, "wb") as f:
        f.write(b"new")
    assert path.read_bytes() == b"new" and stale_tmp_siblings(path) == []


def test_a_folder_appears_whole_or_not_at_all(tmp_path):
    final = tmp_path / "export"
    (tmp_path / f".export.{os.getpid() + 1}.tmp").mkdir()  # a killed writer's temporary
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
        assert not final.exists()
    assert [p.name for p in final.iterdir()] == ["a"] and stale_tmp_siblings(final) == []
    with pytest.raises(ValueError):
        with atomic_dir(final) as tmp:
            (tmp / "b").write_text("2")
            raise ValueError("check failed")
    assert [p.name for p in final.iterdir()] == ["a"] and stale_tmp_siblings(final) == []
    with atomic_dir(final) as tmp:
        (tmp / "c").write_text("3")
    assert [p.name for p in final.iterdir()] == ["c"]
