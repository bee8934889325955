"""The dump reader at many shards: open time (index build) for 1k, 10k and 100k shards, and the cost of
verification on a first start (every shard hashed) and on a restart (every verdict trusted).

The shards are one small real shard (the real writer) hard-linked under n names with a manifest listing them:
a hard link costs one memory map per name like a distinct file, so this reproduces vm.max_map_count (65530)
without writing n files. Called from bench/bench_scale.py; alone:

    python -m bench.scale_reader [--counts 1000 10000 100000]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from pipeline.hidden_states.capture import CONVENTION, FINAL_FEATURE
from pipeline.hidden_states.plan import TokenizedSample
from pipeline.hidden_states.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    ShardWriter,
    StateLayout,
    dtype_name,
    record_batch,
    shard_name,
)
from pipeline.manifest import write_manifest

REPO = Path(__file__).resolve().parents[1]

LINKS_PER_FILE = 50_000  # ext4 allows 65,000 links to one file: a new real shard every 50k names


def linked_dump(dump_dir: Path, n_shards: int, rows_per_shard: int = 1, tokens: int = 8,
                target: Optional[dict] = None, layer_ids: Sequence[int] = (2, 4, 5), hidden_size: int = 64,
                num_target_layers: int = 8, dtype: torch.dtype = torch.float32, vocab: int = 200,
                seed: int = 0) -> Path:
    """A dump folder of `n_shards` names for real shards (one per LINKS_PER_FILE names) of `rows_per_shard`
    rows (random states, token ids below `vocab`, every token but the first loss-masked), written by
    ShardWriter, and its manifest. Rows of different names repeat the same ids. `target`: the fingerprint
    recorded (a real one for a train run)."""
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    layout = StateLayout(hidden_size, tuple(layer_ids), dtype)
    schema = layout.schema("linked")
    entries, base, entry = [], dump_dir / shard_name(0), {}
    for k in range(n_shards):
        path = dump_dir / shard_name(k)
        if k % LINKS_PER_FILE:  # a name for the last real shard
            os.link(base, path)
            entries.append({**entry, "file": path.name})
            continue
        samples = [TokenizedSample(f"row-{i}", torch.randint(0, vocab, (tokens,), generator=g).tolist(),
                                   [0] + [1] * (tokens - 1)) for i in range(rows_per_shard)]
        n_tok = tokens * rows_per_shard
        aux = torch.randn(n_tok, layout.aux_width, generator=g).to(dtype)
        final = torch.randn(n_tok, hidden_size, generator=g).to(dtype)
        writer = ShardWriter(path, schema)
        writer.write(record_batch(schema, samples, aux, final))
        base, entry = path, writer.close()
        entries.append(entry)
    rows, toks, nbytes = (sum(e[f] for e in entries) for f in ("rows", "tokens", "bytes"))
    write_manifest(dump_dir, "dump", {}, {"rows": rows, "tokens": toks, "shards": n_shards}, {},
                   format={"name": FORMAT_NAME, "version": FORMAT_VERSION}, target=target or {},
                   precision="float32", tokenizer_digest=(target or {}).get("tokenizer_digest"),
                   layers={"ids": list(layer_ids), "convention": CONVENTION, "final": FINAL_FEATURE,
                           "num_target_layers": num_target_layers},
                   hidden_size=hidden_size, dtype=dtype_name(dtype), plan={"key": "linked"}, shards=entries,
                   totals={"rows": rows, "tokens": toks, "bytes": nbytes})
    return dump_dir


def reader_open_times(tmpdir, counts: Sequence[int] = (1000, 10000, 100000)) -> dict:
    """{n: {"make_s", "open_s", "open_cached_s", "verify_first_s", "verify_again_s", "hashed_first",
    "hashed_again", "rows", "maps_open"}} for a linked dump of n shards under `tmpdir` (removed after each
    count): open_s is the first DumpReader(verify=False) (builds the row index by opening every shard, and
    caches it), open_cached_s a second one (reads the cached index); verify_* are verify_shards on a first start
    (every shard hashed) and a second (every verdict trusted); maps_open the shards the reader keeps mapped."""
    import shutil

    from pipeline.hidden_states.reader import DumpReader, verify_shards

    out = {}
    for n in counts:
        d = Path(tmpdir) / f"linked-{n}"
        t0 = time.perf_counter()
        linked_dump(d, n)
        t1 = time.perf_counter()
        reader = DumpReader(d, verify=False)
        t2 = time.perf_counter()
        maps_open = len(reader._shards)
        del reader
        t2a = time.perf_counter()
        reader = DumpReader(d, verify=False)
        t2b = time.perf_counter()
        first = verify_shards(d)
        t3 = time.perf_counter()
        again = verify_shards(d)
        t4 = time.perf_counter()
        out[n] = {"make_s": t1 - t0, "open_s": t2 - t1, "open_cached_s": t2b - t2a, "verify_first_s": t3 - t2b,
                  "verify_again_s": t4 - t3, "hashed_first": first.hashed, "hashed_again": again.hashed,
                  "rows": len(reader), "maps_open": maps_open}
        del reader
        shutil.rmtree(d)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[1000, 10000, 100000])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eaglet-scale-reader-") as tmp:
        print(json.dumps(reader_open_times(tmp, args.counts), indent=1))
