"""Reading a dump (used by training): zero-copy torch views over memory-mapped Arrow shards.

    reader = DumpReader("outputs/demo/dump", expect_target=target.fingerprint, expect_layer_ids=[2, 15, 27])
    sample = reader[i]        # DumpSample(id, input_ids [T], loss_mask [T], aux_hidden [T, 3H], final_hidden [T, H])
    reader.lengths            # np.int64 [len(reader)] tokens per row, e.g. for length-grouped batching

Each shard is mapped copy-on-write (`torch.from_file(shared=False)`, i.e. MAP_PRIVATE): `aux_hidden` /
`final_hidden` are views of the file's pages, so reading costs page cache, not anonymous memory, and an
in-place edit of a returned tensor touches a private copy of that page, never the file. Arrow only parses
the layout (footer, offsets); the bytes go straight from the mapping into torch. `input_ids` / `loss_mask`
are stored as int32 / uint8 and widened to int64 on access (a copy of T elements).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import torch

from pipeline.hidden_states.capture import CONVENTION
from pipeline.hidden_states.shards import DTYPES, FORMAT_NAME, FORMAT_VERSION, META_KEY
from pipeline.manifest import MANIFEST, ManifestError, check_equal, check_target, file_problem, load_manifest


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
                 verify: bool = True):
        """`verify`: check every shard's sha256 against the manifest before any row is read (a flipped byte
        on a shared filesystem must never train); bench/bench_integrity.py measures its cost against a
        training epoch. False only for callers that verified the dump otherwise."""
        self.dir = Path(dump_dir)
        self.manifest = load_manifest(self.dir, expect_stage="dump")
        self._check_manifest(expect_target, expect_layer_ids, expect_tokenizer_digest)
        self.layer_ids: list[int] = list(self.manifest["layers"]["ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.dtype: torch.dtype = DTYPES[self.manifest["dtype"]]
        self._shards: dict[int, _Shard] = {}
        self._batches: OrderedDict = OrderedDict()
        self._index(verify)

    # -- checks -------------------------------------------------------------------------------------------

    def _check_manifest(self, expect_target, expect_layer_ids, expect_tokenizer_digest) -> None:
        m, path = self.manifest, self.dir / MANIFEST
        fmt = m.get("format", {})
        if fmt.get("name") != FORMAT_NAME or fmt.get("version") != FORMAT_VERSION:
            raise ManifestError(f"{path}: dump format {fmt} but this eaglet reads "
                                f"{FORMAT_NAME} v{FORMAT_VERSION}; rerun the dump stage")
        if m["layers"].get("convention") != CONVENTION:
            raise ManifestError(f"{path}: layer convention {m['layers'].get('convention')!r}, expected {CONVENTION!r}")
        if expect_target is not None:
            check_target(expect_target, m, path, what="dump target")
        if expect_layer_ids is not None:
            check_equal("dump layer ids", [int(i) for i in expect_layer_ids], m["layers"]["ids"],
                        "expected", f"{path} ({CONVENTION})")
        if expect_tokenizer_digest is not None:
            check_equal("dump tokenizer/chat-template digest", expect_tokenizer_digest, m.get("tokenizer_digest"),
                        "expected", str(path))

    def _index(self, verify: bool) -> None:
        """Row -> (shard, batch, row in batch) and lengths, from the token offsets only (no state pages)."""
        shard_ix, batch_ix, row_ix, lengths = [], [], [], []
        for s, entry in enumerate(self.manifest["shards"]):
            problem = shard_problem(self.dir, entry, digest=verify)
            if problem:
                raise ManifestError(f"dump {self.dir}: shard {problem}; {REPAIR}")
            path = self.dir / entry["file"]
            shard = self._shard(s)
            for key, want in (("layer_ids", self.layer_ids), ("hidden_size", self.hidden_size),
                              ("dtype", self.manifest["dtype"])):
                check_equal(f"dump shard {key}", shard.meta[key], want, str(path), str(self.dir / MANIFEST))
            rows = 0
            for b in range(shard.reader.num_record_batches):
                offsets = _batch_view(shard, b, self.dtype, self.hidden_size, self.aux_width).ids_offsets.numpy()
                n = len(offsets) - 1
                shard_ix.append(np.full(n, s, np.int32))
                batch_ix.append(np.full(n, b, np.int32))
                row_ix.append(np.arange(n, dtype=np.int32))
                lengths.append(np.diff(offsets).astype(np.int64))
                rows += n
            if rows != entry["rows"]:
                raise ManifestError(f"{self.dir}: shard {entry['file']} has {rows} rows, "
                                    f"the manifest says {entry['rows']}")
        cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)  # noqa: E731
        self._shard_ix, self._batch_ix, self._row_ix = (cat(x, np.int32) for x in (shard_ix, batch_ix, row_ix))
        self.lengths: np.ndarray = cat(lengths, np.int64)

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
        if s not in self._shards:
            self._shards[s] = _Shard(self.dir / self.manifest["shards"][s]["file"])
        return self._shards[s]

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

    def locate(self, i: int) -> str:
        """Row i as a person finds it: shard file, row within the shard, sample id."""
        s, b, r = int(self._shard_ix[i]), int(self._batch_ix[i]), int(self._row_ix[i])
        in_shard = int(((self._shard_ix == s) & (self._batch_ix < b)).sum()) + r
        return f"{self.manifest['shards'][s]['file']} row {in_shard} (id {self[i].id})"

    def __iter__(self) -> Iterator[DumpSample]:
        for i in range(len(self)):
            yield self[i]

    def verify(self) -> list[str]:
        return verify_dump(self.dir)

    # DataLoader workers: ship the index, reopen the mappings lazily in the worker.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_shards"], state["_batches"] = {}, OrderedDict()
        return state


# How to repair a bad shard: the dump stage rewrites exactly the shards whose files are gone (dump.py).
REPAIR = "delete that shard file and rerun the dump stage: it rewrites the missing shards only"


def shard_problem(dump_dir: Path, entry: dict, digest: bool = True) -> Optional[str]:
    """What is wrong with one shard of the manifest (missing, size, and with `digest` its sha256), naming it;
    None when it is intact."""
    problem = file_problem(Path(dump_dir) / entry["file"], entry["bytes"], entry["sha256"] if digest else None)
    return problem and f"{entry['file']}: {problem}"


def verify_dump(dump_dir: Union[str, Path], rank: int = 0, world_size: int = 1) -> list[str]:
    """Rechecks every shard against the manifest: presence, size, sha256. Returns one line per bad shard,
    naming it; empty when the dump is intact. With several ranks each checks its round-robin share and they
    combine the verdict, so the dump is read for it once, not once per rank."""
    dump_dir = Path(dump_dir)
    entries = load_manifest(dump_dir, expect_stage="dump")["shards"]
    return [p for entry in entries[rank::world_size] if (p := shard_problem(dump_dir, entry))]
