"""Dump input: conversations from the regen stage (`dump.input=regen`) or straight from the data sources
(`dump.input=data`), tokenized with the target's chat template and assistant loss mask."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import ThinkingMode, check_thinking, tokenize_conversation
from pipeline.data.readers import read_source, read_sources
from pipeline.hidden_states.config import DumpInput
from pipeline.hidden_states.plan import TokenizedSample
from pipeline.manifest import MANIFEST, RegenManifest, check_target
from pipeline.regen.shards import regen_sources

log = logging.getLogger(__name__)


def read_conversations(cfg, fingerprint: dict, report: BadRecordReport) -> tuple[Iterator[dict], list[Path]]:
    """(conversations, input stage dirs whose manifests were consumed). `cfg` is the root EagletConfig."""
    if DumpInput.parse(cfg.dump.input, "dump.input") == DumpInput.data:
        return read_sources(cfg.data, report), []
    regen_dir = cfg.stage_dir("regen")
    manifest = RegenManifest.load(regen_dir)
    check_target(fingerprint, manifest, regen_dir / MANIFEST, what="regen target")
    # The answers follow the generation prompt of the regen's thinking mode: tokenized under another one, the
    # rows would hold prompts the target never answered.
    check_thinking(cfg.regen.thinking, manifest, regen_dir / MANIFEST)
    if not manifest.complete:
        log.warning("%s is partial (regen.finalize_partial): %d of %d planned shards missing; this dump covers "
                    "the %d conversations regenerated so far", regen_dir, manifest.shards_missing,
                    manifest.plan["shards"], manifest.counts["conversations"])
    sources = regen_sources(regen_dir)  # the ShareGPT shards its manifest lists, in order

    def conversations() -> Iterator[dict]:
        seen: set = set()
        for src in sources:
            yield from read_source(src, report, cfg.data.on_bad_record, seen_ids=seen,
                                   max_turn_chars=cfg.data.max_turn_chars)
    return conversations(), [regen_dir]


def tokenize_all(conversations: Iterable[dict], tokenizer, data_cfg, limit=None, thinking=ThinkingMode.template
                 ) -> tuple[list[TokenizedSample], Counter]:
    """Every conversation tokenized, in input order, with the template's `thinking` mode (`regen.thinking`).
    Conversations without a single assistant token teach the draft nothing and are skipped (counted), like
    overlength ones under `overlength=drop`."""
    samples, counts = [], Counter()
    for conv in conversations:
        if limit is not None and counts["conversations"] >= limit:
            break
        counts["conversations"] += 1
        tok = tokenize_conversation(tokenizer, conv["messages"], data_cfg.max_length, data_cfg.overlength,
                                    data_cfg.system_prompt, thinking=thinking)
        if tok is None:
            counts["dropped_overlength"] += 1
            continue
        if tok.truncated:
            counts["truncated"] += 1
        if tok.n_assistant_tokens == 0:
            counts["skipped_no_assistant_tokens"] += 1
            continue
        samples.append(TokenizedSample(conv["id"], tok.input_ids, tok.loss_mask))
        counts["assistant_tokens"] += tok.n_assistant_tokens
    counts["samples"] = len(samples)
    if counts["skipped_no_assistant_tokens"]:
        log.warning("dump: %d conversations have no assistant turn (prompt only) and were skipped%s",
                    counts["skipped_no_assistant_tokens"],
                    "; dump.input=data on prompt-only data needs regen first" if not samples else "")
    return samples, counts
