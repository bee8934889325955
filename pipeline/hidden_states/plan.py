"""The dump plan: which samples go into which forward batch and which batches into which shard.

Everything here is a pure function of the whole tokenized input and the config -- never of the rank count
or of what a previous (killed) run already wrote. That is what makes shard files byte-identical across
resumptions and world sizes: shard `k` always holds the same rows, computed in the same batches.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

PLAN_VERSION = 1


@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class DumpPlan:
    batches: list[list[int]]  # sample indices per forward batch, longest first
    shards: list[list[int]]  # batch indices per shard (consecutive)
    key: str  # digest of everything that determines the shard bytes
    shard_rows: list[int] = field(default_factory=list)
    shard_tokens: list[int] = field(default_factory=list)


def row_order(lengths: Sequence[int]) -> list[int]:
    """The dump's row order: samples by length, longest first, ties by input position. Batches are cut from
    it consecutively, so it is also the order of the rows in the shards, whatever the batch sizes; online
    training (train/online.py) orders its rows the same way, so both sources split train/validation alike."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def plan_batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Length-grouped batches cut greedily from `row_order`, so that padded size (rows x longest row) stays
    within `batch_tokens`. Sorting first keeps padding small; a sample longer than `batch_tokens` gets a batch
    of its own."""
    if batch_tokens < 1 or max_batch_size < 1:
        raise ValueError("dump.batch_tokens and dump.max_batch_size must be positive")
    batches: list[list[int]] = []
    for i in row_order(lengths):
        cur = batches[-1] if batches else None
        # Rows are in descending length, so the batch's padded width is its first row's length.
        if cur is not None and len(cur) < max_batch_size and (len(cur) + 1) * lengths[cur[0]] <= batch_tokens:
            cur.append(i)
        else:
            batches.append([i])
    return batches


def plan_shards(batch_bytes: Sequence[int], shard_bytes: int) -> list[list[int]]:
    """Consecutive batches per shard while the shard's payload stays within `shard_bytes` (a batch larger
    than that gets a shard of its own: a batch is never split)."""
    shards: list[list[int]] = []
    size = 0
    for b, nbytes in enumerate(batch_bytes):
        if shards and size + nbytes <= shard_bytes:
            shards[-1].append(b)
            size += nbytes
        else:
            shards.append([b])
            size = nbytes
    return shards


def samples_digest(samples: Sequence[TokenizedSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.id.encode())
        h.update(b"\0")
        h.update(np.asarray(s.input_ids, dtype=np.int64).tobytes())
        h.update(np.asarray(s.loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def make_plan(samples: Sequence[TokenizedSample], batch_tokens: int, max_batch_size: int, shard_bytes: int,
              row_bytes, key_parts: dict) -> DumpPlan:
    """`row_bytes(n_tokens)` is a row's payload size on disk; `key_parts` holds what else determines the
    bytes (target digests, layers, dtype, format version)."""
    lengths = [len(s) for s in samples]
    batches = plan_batches(lengths, batch_tokens, max_batch_size)
    shards = plan_shards([sum(row_bytes(lengths[i]) for i in b) for b in batches], shard_bytes)
    key_doc = {"plan_version": PLAN_VERSION, "batch_tokens": batch_tokens, "max_batch_size": max_batch_size,
               "shard_bytes": shard_bytes, "samples": samples_digest(samples), **key_parts}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    rows = [sum(len(batches[b]) for b in s) for s in shards]
    tokens = [sum(lengths[i] for b in s for i in batches[b]) for s in shards]
    return DumpPlan(batches, shards, key, rows, tokens)
