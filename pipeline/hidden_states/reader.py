"""Reading a dump (used by training): zero-copy torch views over memory-mapped Arrow shards.

    reader = DumpReader("outputs/demo/dump", expect_target=target.fingerprint, expect_layer_ids=[2, 15, 27])
    sample = reader[i]        # DumpSample(id, input_ids [T], loss_mask [T], aux_hidden [T, 3H], final_hidden [T, H])
    reader.lengths            # np.int64 [len(reader)] tokens per row, e.g. for length-grouped batching

Each shard is mapped copy-on-write (`torch.from_file(shared=False)`, i.e. MAP_PRIVATE): `aux_hidden` /
`final_hidden` are views of the file's pages, so reading costs page cache, not anonymous memory, and an
in-place edit of a returned tensor touches a private copy of that page, never the file. Arrow only parses
the layout (footer, offsets); the bytes go straight from the mapping into torch. `input_ids` / `loss_mask`
are stored as int32 / uint8 and widened to int64 on access (a copy of T elements).

Shards are mapped on demand and at most `max_open_shards` stay mapped (least recently used first out), so a
dump of 100k+ shards stays far below Linux's vm.max_map_count (65530 by default: one map per shard). A
returned sample's tensors keep their shard's mapping alive until they are dropped; the cache itself never
holds more. The row index is built once per reader by opening each shard's footer and token offsets in turn.

Verification hashes each shard once: a verdict recorded (shards.py, `verified/`) for the same sha256 and an
unchanged size/mtime/ctime/inode is trusted, anything else is hashed (`verify_shards`).
"""
from __future__ import annotations

import json
import logging
import os
import stat as stat_mod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import torch

from pipeline.files import atomic_file, sha256_file
from pipeline.hidden_states.capture import CONVENTION
from pipeline.hidden_states.shards import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_KEY,
    compact_record,
    load_verified,
    record_verified,
    stat_key,
    verdict,
)
from pipeline.manifest import MANIFEST, DumpManifest, ManifestError, check_equal, check_target, file_problem

log = logging.getLogger(__name__)

# Shards mapped at once per reader (and per DataLoader worker): one map each, far below vm.max_map_count.
DEFAULT_MAX_OPEN_SHARDS = 256


@dataclass
class DumpSample:
    id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T], 1 = assistant-generated token
    aux_hidden: torch.Tensor  # [T, n_layers*H], layer-id order (low, mid, high)
    final_hidden: torch.Tensor  # [T, H], output of the target's final norm


class _Shard:
    """One memory-mapped shard: the whole file as a uint8 tensor, and Arrow's reader over the same pages."""

    def __init__(self, path: Path):
        # shared=False maps the file MAP_PRIVATE (copy-on-write) and closes its descriptor: no fd per shard.
        self.bytes = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
        self._base = pa.py_buffer(self.bytes.numpy())  # the same pages, for Arrow to parse
        self.reader = pa.ipc.open_file(pa.BufferReader(self._base))
        self.meta = json.loads(self.reader.schema.metadata[META_KEY])

    def view(self, buf: pa.Buffer, dtype: torch.dtype) -> torch.Tensor:
        """An Arrow buffer of this file as a torch tensor over the same bytes."""
        start = buf.address - self._base.address
        return self.bytes[start:start + buf.size].view(dtype)


@dataclass
class _BatchView:
    ids: pa.Array
    ids_offsets: torch.Tensor  # int32 [rows+1]
    input_ids: torch.Tensor  # int32 [tokens]
    loss_mask: torch.Tensor  # uint8 [tokens]
    aux: torch.Tensor  # dtype [tokens, n_layers*H]
    final: torch.Tensor  # dtype [tokens, H]


def _batch_view(shard: _Shard, b: int, dtype: torch.dtype, hidden: int, aux_width: int) -> _BatchView:
    rb = shard.reader.get_batch(b)
    cols = {name: rb.column(name) for name in rb.schema.names}
    assert all(c.offset == 0 for c in cols.values()), "sliced arrays are never written"
    ids_off = shard.view(cols["input_ids"].buffers()[1], torch.int32)[: rb.num_rows + 1]
    n_tok = int(ids_off[-1])
    mask_off = shard.view(cols["loss_mask"].buffers()[1], torch.int32)[: rb.num_rows + 1]
    if not torch.equal(ids_off, mask_off):
        raise ManifestError("dump shard: input_ids and loss_mask rows differ in length")
    # Rows of one batch are contiguous in the binary columns, so the whole batch is one [tokens, W] matrix
    # and a row is a slice of it; per-row byte offsets follow from the token offsets.
    aux = shard.view(cols["aux_hidden"].buffers()[2], dtype)[: n_tok * aux_width].view(n_tok, aux_width)
    final = shard.view(cols["final_hidden"].buffers()[2], dtype)[: n_tok * hidden].view(n_tok, hidden)
    return _BatchView(
        ids=cols["id"], ids_offsets=ids_off,
        input_ids=shard.view(cols["input_ids"].buffers()[3], torch.int32)[:n_tok],
        loss_mask=shard.view(cols["loss_mask"].buffers()[3], torch.uint8)[:n_tok],
        aux=aux, final=final)


class DumpReader:
    """Rows of a dump, in dump order. Refuses a dump made with another target (architecture, tokenizer and
    chat template, weights), layer list or tokenizer than the caller expects, naming both sides."""

    _CACHE_BATCHES = 64  # parsed record-batch layouts kept (bounded: memory must not grow with the dump)

    def __init__(self, dump_dir: Union[str, Path], expect_target: Optional[dict] = None,
                 expect_layer_ids: Optional[Sequence[int]] = None, expect_tokenizer_digest: Optional[str] = None,
                 verify: bool = True, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS):
        """`verify`: check every shard's sha256 against the manifest before any row is read (a flipped byte
        on a shared filesystem must never train), hashing only shards not verified unchanged before
        (`verify_shards`); bench/bench_integrity.py measures a full hash against a training epoch. False only
        for callers that verified the dump otherwise. `max_open_shards`: shards kept memory-mapped (LRU)."""
        self.dir = Path(dump_dir)
        self.manifest = DumpManifest.load(self.dir)
        self._check_manifest(expect_target, expect_layer_ids, expect_tokenizer_digest)
        self.layer_ids: list[int] = list(self.manifest.layers["ids"])
        self.hidden_size: int = int(self.manifest.hidden_size)
        self.dtype: torch.dtype = DTYPES[self.manifest.dtype]
        self.max_open_shards = max(1, int(max_open_shards))
        self._shards: OrderedDict = OrderedDict()  # s -> _Shard, least recently used first
        self._batches: OrderedDict = OrderedDict()
        if verify:
            report = verify_shards(self.dir, manifest=self.manifest)
            if report.problems:
                raise ManifestError(f"dump {self.dir}: shard {report.problems[0]}; {REPAIR}")
        self._index()

    # -- checks -------------------------------------------------------------------------------------------

    def _check_manifest(self, expect_target, expect_layer_ids, expect_tokenizer_digest) -> None:
        m, path = self.manifest, self.dir / MANIFEST
        fmt = m.format
        if fmt.get("name") != FORMAT_NAME or fmt.get("version") != FORMAT_VERSION:
            raise ManifestError(f"{path}: dump format {fmt} but this eaglet reads "
                                f"{FORMAT_NAME} v{FORMAT_VERSION}; rerun the dump stage")
        if m.layers.get("convention") != CONVENTION:
            raise ManifestError(f"{path}: layer convention {m.layers.get('convention')!r}, expected {CONVENTION!r}")
        if expect_target is not None:
            check_target(expect_target, m, path, what="dump target")
        if expect_layer_ids is not None:
            check_equal("dump layer ids", [int(i) for i in expect_layer_ids], m.layers["ids"],
                        "expected", f"{path} ({CONVENTION})")
        if expect_tokenizer_digest is not None:
            check_equal("dump tokenizer/chat-template digest", expect_tokenizer_digest, m.tokenizer_digest,
                        "expected", str(path))

    def _index(self) -> None:
        """Row -> (shard, batch, row in batch) and lengths, from the token offsets only (no state pages). Every
        shard's presence and size are checked; the index itself is read from index/<manifest sha256>.npz when an
        earlier reader of this manifest left it there (opening 100k shards takes minutes, reading it
        milliseconds), else built by opening each shard through the bounded cache, and saved."""
        entries = self.manifest.shards
        for entry in entries:
            try:
                ok = os.stat(os.path.join(self.dir, entry["file"])).st_size == entry["bytes"]
            except OSError:
                ok = False
            if not ok and (problem := shard_problem(self.dir, entry, digest=False)):
                raise ManifestError(f"dump {self.dir}: shard {problem}; {REPAIR}")
        cache = self._index_cache_path()
        arrays = _load_index(cache, [e["rows"] for e in entries]) if cache else None
        if arrays is None:
            arrays = self._build_index()
            if cache:
                _save_index(cache, arrays)
        self._shard_ix, self._batch_ix, self._row_ix, self.lengths = arrays

    def _build_index(self) -> tuple:
        """Each shard mapped in turn, its footer and token offsets parsed, and unmapped again (one map at a time;
        the loop is kept lean: ~0.1-0.3 ms a shard)."""
        batch_shard, batch_no, batch_rows, lengths = [], [], [], []
        meta_ok = None  # the schema metadata bytes already checked (one plan key: the same in every shard)
        for s, entry in enumerate(self.manifest.shards):
            path = os.path.join(self.dir, entry["file"])
            try:
                mapped = torch.from_file(path, shared=False, size=entry["bytes"], dtype=torch.uint8)
                reader = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapped.numpy())))
                meta = reader.schema.metadata[META_KEY]
            except (pa.ArrowException, RuntimeError, KeyError, TypeError) as e:
                raise ManifestError(f"dump {self.dir}: shard {entry['file']}: not a readable shard ({e}); "
                                    f"{REPAIR}") from e
            if meta != meta_ok:
                self._check_shard_meta(json.loads(meta), path)
                meta_ok = meta
            rows = 0
            for b in range(reader.num_record_batches):
                rb = reader.get_batch(b)
                offsets = rb.column(1).offsets.to_numpy()  # input_ids (schema order)
                if not np.array_equal(offsets, rb.column(2).offsets.to_numpy()):  # loss_mask
                    raise ManifestError(f"dump shard {entry['file']}: input_ids and loss_mask rows differ in length")
                batch_shard.append(s)
                batch_no.append(b)
                batch_rows.append(len(offsets) - 1)
                lengths.append(np.diff(offsets))
                rows += len(offsets) - 1
            del rb, offsets, reader, mapped  # unmapped here, before the next shard is mapped
            if rows != entry["rows"]:
                raise ManifestError(f"{self.dir}: shard {entry['file']} has {rows} rows, "
                                    f"the manifest says {entry['rows']}")
        counts = np.asarray(batch_rows, np.int64)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        return (np.repeat(np.asarray(batch_shard, np.int32), counts), np.repeat(np.asarray(batch_no, np.int32), counts),
                (np.arange(int(counts.sum()), dtype=np.int64) - starts).astype(np.int32),
                np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64))

    def _check_shard_meta(self, meta: dict, path) -> None:
        for key, want in (("layer_ids", self.layer_ids), ("hidden_size", self.hidden_size),
                          ("dtype", self.manifest.dtype)):
            check_equal(f"dump shard {key}", meta[key], want, str(path), str(self.dir / MANIFEST))

    def _index_cache_path(self) -> Optional[Path]:
        try:
            return self.dir / INDEX_DIR / f"{sha256_file(self.dir / MANIFEST)}.npz"
        except OSError:
            return None

    # -- access -------------------------------------------------------------------------------------------

    @property
    def aux_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.lengths)

    def _shard(self, s: int) -> _Shard:
        shard = self._shards.get(s)
        if shard is not None:
            self._shards.move_to_end(s)
            return shard
        path = self.dir / self.manifest.shards[s]["file"]
        shard = _Shard(path)
        self._check_shard_meta(shard.meta, path)
        self._shards[s] = shard
        while len(self._shards) > self.max_open_shards:
            old, _ = self._shards.popitem(last=False)
            # Its parsed batches hold views of the mapping: dropped with it, or the map would stay.
            for key in [k for k in self._batches if k[0] == old]:
                del self._batches[key]
        return shard

    def _batch(self, s: int, b: int) -> _BatchView:
        key = (s, b)
        view = self._batches.get(key)
        if view is None:
            view = _batch_view(self._shard(s), b, self.dtype, self.hidden_size, self.aux_width)
            self._batches[key] = view
            if len(self._batches) > self._CACHE_BATCHES:
                self._batches.popitem(last=False)
        else:
            self._batches.move_to_end(key)
        return view

    def __getitem__(self, i: int) -> DumpSample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of a {len(self)}-row dump")
        i = int(i) % len(self)
        view = self._batch(int(self._shard_ix[i]), int(self._batch_ix[i]))
        r = int(self._row_ix[i])
        start, end = int(view.ids_offsets[r]), int(view.ids_offsets[r + 1])
        return DumpSample(
            id=view.ids[r].as_py(),
            input_ids=view.input_ids[start:end].long(),
            loss_mask=view.loss_mask[start:end].long(),
            aux_hidden=view.aux[start:end],
            final_hidden=view.final[start:end],
        )

    def tokens(self, indices: Sequence[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids int32 [n], loss_mask uint8 [n]) of the rows `indices` (each once), concatenated per record
        batch in storage order: what a count over many rows (the draft vocabulary) reads, without building each
        row (a row at a time costs ~0.1 ms of Python; 1M rows, minutes on every rank)."""
        idx = np.asarray(indices, dtype=np.int64) % max(len(self), 1)
        if len(np.unique(idx)) != len(idx):
            raise ValueError("DumpReader.tokens: indices name a row twice")
        s_ix, b_ix, r_ix = self._shard_ix[idx], self._batch_ix[idx], self._row_ix[idx]
        order = np.lexsort((r_ix, b_ix, s_ix))
        s_ix, b_ix, r_ix = s_ix[order], b_ix[order], r_ix[order]
        cuts = np.flatnonzero((np.diff(s_ix) != 0) | (np.diff(b_ix) != 0)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(idx)]):
            if lo == hi:
                continue
            view = self._batch(int(s_ix[lo]), int(b_ix[lo]))
            offsets = view.ids_offsets.long()  # [rows+1]
            rows = torch.from_numpy(r_ix[lo:hi].astype(np.int64))
            if len(rows) == len(offsets) - 1:  # the whole batch
                yield view.input_ids, view.loss_mask
                continue
            keep = torch.zeros(len(offsets) - 1, dtype=torch.bool)
            keep[rows] = True
            per_token = torch.repeat_interleave(keep, offsets.diff())  # [tokens of the batch]
            yield view.input_ids[per_token], view.loss_mask[per_token]

    def locate(self, i: int) -> str:
        """Row i as a person finds it: shard file, row within the shard, sample id."""
        s, b, r = int(self._shard_ix[i]), int(self._batch_ix[i]), int(self._row_ix[i])
        in_shard = int(((self._shard_ix == s) & (self._batch_ix < b)).sum()) + r
        return f"{self.manifest.shards[s]['file']} row {in_shard} (id {self[i].id})"

    def __iter__(self) -> Iterator[DumpSample]:
        for i in range(len(self)):
            yield self[i]

    def verify(self, force: bool = False) -> list[str]:
        """Bad shards, one line each (empty: intact); `force` hashes even shards verified unchanged before."""
        return verify_dump(self.dir, force=force)

    # DataLoader workers: ship the index, reopen the mappings lazily in the worker.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_shards"], state["_batches"] = OrderedDict(), OrderedDict()
        return state


# -- the row index's cache: index/<sha256 of manifest.json>.npz, pickle-free, never the manifest itself --------

INDEX_DIR = "index"
_INDEX_VERSION = 1
_INDEX_KEYS = ("shard_ix", "batch_ix", "row_ix", "lengths")


def _load_index(path: Path, shard_rows: Sequence[int]) -> Optional[tuple]:
    """The cached index when it is whole and agrees with the manifest's per-shard rows, else None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"]) != _INDEX_VERSION:
                return None
            arrays = tuple(z[k] for k in _INDEX_KEYS)
    except (OSError, ValueError, KeyError, EOFError):  # absent, torn, foreign
        return None
    shard_ix, batch_ix, row_ix, lengths = arrays
    n = len(lengths)
    if not (len(shard_ix) == len(batch_ix) == len(row_ix) == n and shard_ix.dtype == batch_ix.dtype == row_ix.dtype
            == np.int32 and lengths.dtype == np.int64):
        return None
    if n and (shard_ix.min() < 0 or shard_ix.max() >= len(shard_rows)):
        return None
    if not np.array_equal(np.bincount(shard_ix, minlength=len(shard_rows)), np.asarray(shard_rows, np.int64)):
        return None
    return arrays


def _save_index(path: Path, arrays: tuple) -> None:
    """Written atomically beside the shards; a read-only or full dump folder only means no cache. Indexes of
    earlier manifests of this folder are removed."""
    try:
        with atomic_file(path, "wb") as f:
            np.savez(f, version=np.int64(_INDEX_VERSION), **dict(zip(_INDEX_KEYS, arrays)))
        # Older manifests' indexes, and temporaries of savers killed mid-write (a concurrent saver whose
        # temporary goes only fails its rename: the index is the same).
        for old in [*path.parent.glob("*.npz"), *path.parent.glob(".*.tmp")]:
            if old.name != path.name:
                old.unlink(missing_ok=True)
    except OSError as e:
        log.debug("dump: row index not cached in %s (%s)", path.parent, e)


# How to repair a bad shard: the dump stage rewrites exactly the shards whose files are gone (dump.py).
REPAIR = "delete that shard file and rerun the dump stage: it rewrites the missing shards only"


def shard_problem(dump_dir: Path, entry: dict, digest: bool = True) -> Optional[str]:
    """What is wrong with one shard of the manifest (missing, size, and with `digest` its sha256), naming it;
    None when it is intact."""
    problem = file_problem(Path(dump_dir) / entry["file"], entry["bytes"], entry["sha256"] if digest else None)
    return problem and f"{entry['file']}: {problem}"


@dataclass
class VerifyReport:
    problems: list  # one line per bad shard, naming it; empty when this rank's share is intact
    hashed: int = 0  # shards read and hashed now
    trusted: int = 0  # shards whose recorded verdict still holds (same sha256, size, mtime, ctime, inode)

    def __str__(self) -> str:
        return (f"{self.hashed} shards hashed, {self.trusted} trusted (verified before, unchanged since)"
                + (f", {len(self.problems)} bad" if self.problems else ""))


_RECORD_EVERY = 256  # verdicts appended per write while hashing (a kill loses at most these)


def verify_shards(dump_dir: Union[str, Path], rank: int = 0, world_size: int = 1, force: bool = False,
                  manifest: Optional[DumpManifest] = None) -> VerifyReport:
    """Checks this rank's round-robin share of the manifest's shards (by manifest index, so the split never
    depends on what another rank recorded meanwhile): presence and size always; the sha256 of every shard
    without a verdict that still holds (`force`: of every shard), recording each match in this rank's file
    of `verified/`. With several ranks they combine the verdict, so the dump is read once, not per rank."""
    dump_dir = Path(dump_dir)
    entries = (manifest or DumpManifest.load(Path(dump_dir))).shards[rank::world_size]
    known = {} if force else load_verified(dump_dir)
    report, pending = VerifyReport([]), []
    for entry in entries:
        name, path = entry["file"], dump_dir / entry["file"]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is None or not stat_mod.S_ISREG(st.st_mode) or st.st_size != entry["bytes"]:
            report.problems.append(f"{name}: {file_problem(path, entry['bytes'], None) or 'changed while checked'}")
            continue
        if (entry["sha256"], *stat_key(st)) in known.get(name, ()):
            report.trusted += 1
            continue
        sha = sha256_file(path)
        report.hashed += 1
        if sha != entry["sha256"]:
            report.problems.append(f"{name}: sha256 {sha[:16]}... but recorded {entry['sha256'][:16]}... (corrupt)")
            continue
        if stat_key(os.stat(path)) == stat_key(st):  # not rewritten while it was read
            pending.append(verdict(name, sha, st))
        if len(pending) >= _RECORD_EVERY:
            record_verified(dump_dir, pending, "verify")
            pending = []
    record_verified(dump_dir, pending, "verify")
    if report.hashed:
        compact_record(dump_dir, "verify")
    return report


def verify_dump(dump_dir: Union[str, Path], rank: int = 0, world_size: int = 1, force: bool = False) -> list[str]:
    """Rechecks this rank's share of the shards against the manifest: presence, size, sha256 (hash once:
    see `verify_shards`). Returns one line per bad shard, naming it; empty when the dump is intact."""
    return verify_shards(dump_dir, rank, world_size, force=force).problems
