"""On-disk format of a dump: Arrow IPC *file* shards, one record batch per forward batch.

Columns per row (one row = one sample, pads already stripped):
    id            string
    input_ids     list<int32>                     [T]
    loss_mask     list<uint8>                     [T] 0/1
    aux_hidden    large_binary  raw [T, n_layers*H] in the dump dtype (layer-id order, concatenated)
    final_hidden  large_binary  raw [T, H]        in the dump dtype

Hidden states are stored as raw bytes because Arrow has no bfloat16: bf16 is kept bit-exact, and readers
view the bytes as torch tensors without copying. The schema metadata repeats the layout and the plan key,
and holds nothing time- or host-dependent, so the same plan always produces byte-identical files.
Writes are atomic: a shard is written under a temporary name, fsynced, then renamed.

Hash once: the writer's sha256 of a shard, and every later verification, is recorded with the file's stat in
`verified/<who>-rank<R>.jsonl` (one append-only file per writing or verifying rank, so concurrent ranks never
write the same file; merged on read; never manifest.json, whose bytes are the dump's identity downstream).
A record line is trusted only while its sha256 and size equal the manifest's entry and the file's size,
mtime, ctime and inode are still the recorded ones, so a shard rewritten (in place or by rename, even with
its mtime restored) is hashed again on its next read.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch

from pipeline.files import sha256_file
from pipeline.precision import DTYPES, dtype_name, parse_dtype

log = logging.getLogger(__name__)

FORMAT_NAME = "eaglet-hidden-states"
FORMAT_VERSION = 1
META_KEY = b"eaglet"
VERIFIED_DIR = "verified"  # hash-once records (see the module docstring)

def resolve_dump_dtype(name: str, target_dtype: torch.dtype) -> torch.dtype:
    """dump.dtype: `auto` stores in the target's compute dtype (bf16 shards are half the bytes)."""
    return DTYPES[dtype_name(target_dtype)] if name == "auto" else parse_dtype(name, "dump.dtype")


@dataclass(frozen=True)
class StateLayout:
    hidden_size: int
    layer_ids: tuple
    dtype: torch.dtype

    @property
    def aux_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def state_bytes_per_token(self) -> int:
        return (self.aux_width + self.hidden_size) * self.itemsize

    @property
    def raw_bytes_per_token(self) -> int:
        """States + int32 id + uint8 mask: the floor any format must pay."""
        return self.state_bytes_per_token + 4 + 1

    def row_bytes(self, n_tokens: int) -> int:
        return n_tokens * self.raw_bytes_per_token

    def metadata(self, plan_key: str) -> dict:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "layer_ids": list(self.layer_ids),
                "hidden_size": self.hidden_size, "dtype": dtype_name(self.dtype), "plan_key": plan_key}

    def schema(self, plan_key: str) -> pa.Schema:
        meta = json.dumps(self.metadata(plan_key), sort_keys=True).encode()
        return pa.schema([
            pa.field("id", pa.string(), nullable=False),
            pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
            pa.field("aux_hidden", pa.large_binary(), nullable=False),
            pa.field("final_hidden", pa.large_binary(), nullable=False),
        ], metadata={META_KEY: meta})


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def shard_index(name: str) -> int:
    return int(name.removeprefix("shard-").removesuffix(".arrow"))


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _list_array(rows: Sequence[Sequence[int]], np_dtype, pa_type) -> pa.Array:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((v for r in rows for v in r), dtype=np_dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa_type))


def _binary_rows(packed: torch.Tensor, lengths: np.ndarray) -> pa.Array:
    """[sum(T), W] tensor of concatenated rows -> one large_binary value per row, zero-copy over `packed`."""
    packed = packed.contiguous()
    row_stride = packed.shape[1] * packed.element_size()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths.astype(np.int64) * row_stride, out=offsets[1:])
    data = pa.py_buffer(packed.view(torch.uint8).numpy())  # bytes view; numpy has no bfloat16
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(lengths), [None, pa.py_buffer(offsets), data])


def record_batch(schema: pa.Schema, samples, aux: torch.Tensor, final: torch.Tensor) -> pa.RecordBatch:
    """`samples`: TokenizedSample rows; `aux` [sum(T), n_layers*H] and `final` [sum(T), H]: their states,
    concatenated in row order, already in the dump dtype on CPU."""
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    assert aux.shape[0] == final.shape[0] == lengths.sum(), (aux.shape, final.shape, lengths.sum())
    return pa.record_batch([
        pa.array([s.id for s in samples], pa.string()),
        _list_array([s.input_ids for s in samples], np.int32, pa.int32()),
        _list_array([s.loss_mask for s in samples], np.uint8, pa.uint8()),
        _binary_rows(aux, lengths),
        _binary_rows(final, lengths),
    ], schema=schema)


class ShardWriter:
    """Streams record batches into `.<name>.tmp`; `close()` fsyncs and renames it to its final name, so a
    shard file under its final name is always complete. Returns the shard's manifest entry."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self._sink = pa.OSFile(str(self.tmp), "wb")
        self._writer = pa.ipc.new_file(self._sink, schema)
        self.rows = 0
        self.tokens = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)
        self.rows += batch.num_rows
        self.tokens += len(batch.column(1).values)

    def close(self) -> dict:
        self._writer.close()
        self._sink.close()
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename must never expose a file whose bytes are not on disk yet
        finally:
            os.close(fd)
        sha = sha256_file(self.tmp)
        before = os.stat(self.tmp)
        os.replace(self.tmp, self.path)
        st = os.stat(self.path)
        if st.st_ino == before.st_ino and st.st_mtime_ns == before.st_mtime_ns and st.st_size == before.st_size:
            record_verified(self.path.parent, [verdict(self.path.name, sha, st)], "dump")
        return {"file": self.path.name, "rows": self.rows, "tokens": self.tokens,
                "bytes": st.st_size, "sha256": sha}

    def abort(self) -> None:
        try:
            self._writer.close()
            self._sink.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def shard_metadata(path: Path) -> tuple[dict, int]:
    """(schema metadata, rows) of a complete shard, read from its footer only."""
    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_file(src)
        meta = json.loads(reader.schema.metadata[META_KEY])
        rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    return meta, rows


def shard_entry(path: Path) -> dict:
    """Manifest entry of an existing complete shard (used when a run was killed between writing the shard
    and recording it)."""
    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_file(src)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        rows = sum(b.num_rows for b in batches)
        tokens = sum(len(b.column(1).values) for b in batches)
    return {"file": path.name, "rows": rows, "tokens": tokens, "bytes": path.stat().st_size,
            "sha256": sha256_file(path)}


# ---------------------------------------------------------------------------------------------------------
# hash-once records: verified/<who>-rank<R>.jsonl


def stat_key(st: os.stat_result) -> tuple:
    """What must be unchanged for a recorded sha256 to still hold: size, mtime, ctime (no user can set it:
    an in-place edit with the mtime restored still moves it) and inode (a rewrite-and-rename)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def verdict(file: str, sha256: str, st: os.stat_result) -> dict:
    return {"file": file, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "sha256": sha256}


def _record_key(rec: dict) -> tuple:
    return (rec["bytes"], rec["mtime_ns"], rec["ctime_ns"], rec["inode"])


def record_path(dump_dir: Path, who: str, rank: Optional[int] = None) -> Path:
    if rank is None:
        from pipeline.dist import rank_info

        rank = rank_info().rank
    return Path(dump_dir) / VERIFIED_DIR / f"{who}-rank{rank:05d}.jsonl"


def record_verified(dump_dir: Path, verdicts: Iterable[dict], who: str, rank: Optional[int] = None) -> bool:
    """Appends verdicts (sha256 matched when hashed) to this rank's record; one write per call, so lines of
    two processes never interleave. False (logged) when the dump folder is read-only or full: the shards are
    then simply hashed again next time."""
    text = "".join(json.dumps(v, sort_keys=True) + "\n" for v in verdicts)
    if not text:
        return True
    path = record_path(dump_dir, who, rank)
    try:
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if path.parent not in _UNRECORDABLE:  # once per folder: a read-only dump is hashed at every start
            _UNRECORDABLE.add(path.parent)
            log.warning("dump: cannot record verified shards in %s (%s); they are hashed again on the next read",
                        path.parent, e)
        return False


_UNRECORDABLE: set = set()


def load_verified(dump_dir: Path) -> dict[str, set]:
    """{file: {(sha256, bytes, mtime_ns, ctime_ns, inode), ...}} merged from every rank's record; a torn or
    foreign line (a kill inside a write) is skipped, which only means that shard is hashed again."""
    out: dict[str, set] = {}
    folder = Path(dump_dir) / VERIFIED_DIR
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.jsonl")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
                out.setdefault(str(rec["file"]), set()).add((str(rec["sha256"]), *map(int, _record_key(rec))))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def compact_record(dump_dir: Path, who: str, rank: Optional[int] = None) -> None:
    """Rewrites this rank's record keeping the last verdict per file (the record otherwise grows by one line
    per shard with every forced verification). Best effort: a line lost to a concurrent append is a rehash."""
    from pipeline.files import atomic_write_text
    from pipeline.manifest import STALE_TMP_S

    path = record_path(dump_dir, who, rank)
    try:
        last: dict[str, str] = {}
        lines = path.read_text(errors="replace").splitlines()
        for line in lines:
            try:
                last[str(json.loads(line)["file"])] = line
            except (ValueError, KeyError, TypeError):
                continue
        if len(last) < len(lines):
            atomic_write_text(path, "".join(v + "\n" for v in last.values()))
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a compaction killed mid-write
            if time.time() - stale.stat().st_mtime > STALE_TMP_S:
                stale.unlink(missing_ok=True)
    except OSError:
        pass
