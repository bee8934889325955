"""The tokenized input of a dump or an online training run, made once per experiment and shared by every rank.

Tokenizing 500k conversations in each of 16 ranks costs 16 times the CPU and, as Python lists, about 26 GB of
memory per rank. Here the first rank to arrive tokenizes (the others wait on a file lock), writes flat numpy
arrays, and every rank then memory-maps them: a row is a pair of views, the page cache holds one copy per node.

    <experiment>/tokens/<key>/   ids.json  offsets.npy int64 [rows+1]  input_ids.npy int32 [tokens]
                                 loss_mask.npy uint8 [tokens]  meta.json (counts, bad records, key document)

The key is a digest of everything the tokens depend on: the input (the regen manifest's digest, or the data
config), the tokenizer and chat template (the fingerprint's tokenizer digest) and its thinking mode
(`regen.thinking`, in the key unless `template`, so older folders stay valid), the data settings that shape a
row, `dump.limit`, and this format's version. Another input, template or setting makes another folder.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import ThinkingMode
from pipeline.files import atomic_dir, sha256_file
from pipeline.hidden_states.inputs import read_conversations, tokenize_all
from pipeline.hidden_states.plan import TokenizedSample
from pipeline.lock import first_writer_lock
from pipeline.manifest import MANIFEST, to_plain

log = logging.getLogger(__name__)

TOKENS_VERSION = 1
TOKENS_DIR = "tokens"


class TokenizedCorpus(Sequence):
    """Rows as `TokenizedSample`s whose input_ids / loss_mask are views of memory-mapped arrays."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.ids: list[str] = json.loads((self.directory / "ids.json").read_text())
        self.offsets = np.load(self.directory / "offsets.npy", mmap_mode="r", allow_pickle=False)
        self.input_ids = np.load(self.directory / "input_ids.npy", mmap_mode="r", allow_pickle=False)
        self.loss_mask = np.load(self.directory / "loss_mask.npy", mmap_mode="r", allow_pickle=False)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return TokenizedSample(self.ids[i], self.input_ids[a:b], self.loss_mask[a:b])


@dataclass
class TokenizedInput:
    samples: Sequence[TokenizedSample]
    counts: dict
    inputs: list  # stage dirs whose manifests were consumed (the regen output)
    bad_records: dict = field(default_factory=dict)  # BadRecordReport.to_dict() of the tokenizing run
    summary: str = "bad records: none"
    cached: bool = False  # read from an earlier run's (or another rank's) arrays

    @property
    def has_bad_records(self) -> bool:
        return bool(self.bad_records.get("total") or self.bad_records.get("fixes"))


def source_stamps(data_cfg) -> list:
    """(path, size, mtime_ns) of every file the data sources name, so an edited source makes new tokens (a regen
    input is pinned by its manifest's digest instead). A hub dataset id has no local files: its config stands."""
    stamps = []
    for source in data_cfg.sources:
        try:
            root = Path(source.location()).expanduser()
        except Exception:  # noqa: BLE001  (a missing package fails later, in the reader, with its own message)
            continue
        for f in sorted(root.rglob("*")) if root.is_dir() else [root] if root.is_file() else []:
            if f.is_file():
                st = f.stat()
                stamps.append([str(f), st.st_size, st.st_mtime_ns])
    return stamps


def tokens_key(cfg, fingerprint: dict, inputs: Sequence[Path]) -> str:
    doc = {"version": TOKENS_VERSION, "tokenizer": fingerprint.get("tokenizer_digest"),
           "input": str(cfg.dump.input),
           "source": [sha256_file(Path(d) / MANIFEST) for d in inputs] or
                     {"config": to_plain(cfg.data), "files": source_stamps(cfg.data)},
           "data": {k: to_plain(getattr(cfg.data, k)) for k in
                    ("max_length", "overlength", "system_prompt", "max_turn_chars", "on_bad_record")},
           "limit": cfg.dump.limit}
    if cfg.regen.thinking != ThinkingMode.template:  # absent for `template`: keys made before the mode existed hold
        doc["thinking"] = str(cfg.regen.thinking)
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


def tokenized_input(cfg, target, what: str = "dump") -> TokenizedInput:
    """This experiment's input rows, tokenized with the target's template: from the shared arrays when a rank
    (or an earlier run) made them, else tokenized here and written for the others. The prologue of every
    consumer of dump input (the dump stage, online training: `what` names it in the log and the error): bad
    records are reported, and an input without a single trainable row is refused."""
    report = BadRecordReport()
    # Always called: it checks the regen manifest against the target even when the tokens are cached.
    conversations, inputs = read_conversations(cfg, target.fingerprint, report)
    directory = cfg.stage_dir("dump").parent / TOKENS_DIR / tokens_key(cfg, target.fingerprint, inputs)
    cached = True
    with first_writer_lock(directory):
        if not (directory / "meta.json").is_file():
            cached = False
            samples, counts = tokenize_all(conversations, target.tokenizer, cfg.data, cfg.dump.limit,
                                           thinking=cfg.regen.thinking)
            write_tokens(directory, samples, {"counts": dict(counts), "bad_records": report.to_dict(),
                                              "summary": report.summary()})
    meta = json.loads((directory / "meta.json").read_text())
    corpus = TokenizedCorpus(directory)
    log.info("input: %d rows, %d tokens, %s %s", len(corpus), int(corpus.offsets[-1]),
             "read from" if cached else "tokenized into", directory)
    rows = TokenizedInput(corpus, meta["counts"], inputs, meta["bad_records"], meta["summary"], cached)
    if rows.has_bad_records:
        log.warning("%s input: %s", what, rows.summary)
    if not rows.samples:
        raise RuntimeError(f"{what}: no conversation with an assistant turn in the input ({rows.counts})")
    return rows


def write_tokens(directory: Path, samples: Sequence[TokenizedSample], meta: dict) -> None:
    """The arrays under a temporary name, then renamed: a folder with meta.json is always complete."""
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.empty(int(offsets[-1]), dtype=np.int32)
    mask = np.empty(int(offsets[-1]), dtype=np.uint8)
    for s, a, b in zip(samples, offsets[:-1], offsets[1:]):
        ids[a:b] = s.input_ids
        mask[a:b] = s.loss_mask
    with atomic_dir(directory) as tmp:  # over an incomplete folder (no meta.json) of a killed run
        (tmp / "ids.json").write_text(json.dumps([s.id for s in samples]))
        for name, array in (("offsets", offsets), ("input_ids", ids), ("loss_mask", mask)):
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
