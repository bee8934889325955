"""What to regenerate, and in which batches.

A `RegenItem` is one input conversation reduced to what regen needs: the system prompt and the user turns,
in order. Original assistant turns are discarded (the target answers every user turn itself), and MT-bench
follow-up turns (`meta["followup_turns"]`) are appended as further user turns.

The `Plan` cuts the *whole* input into batches once, deterministically (sorted by turn count, then by the
token length of the first prompt, ties by input position), and groups consecutive batches into shards.
Resumption and rank assignment only ever pick whole batches out of this plan, so every run with the same
input and settings generates exactly the same batches, whatever the number of ranks or restarts.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Optional

from pipeline.data.readers import prompt_turns


@dataclass(frozen=True)
class RegenItem:
    id: str
    system: Optional[str]  # None: the chat template's own default (if it has one)
    user_turns: tuple[str, ...]
    meta: dict = field(default_factory=dict, hash=False, compare=True)

    def prefix(self) -> list[dict]:
        """Messages before the first user turn."""
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def first_prompt(self) -> list[dict]:
        return self.prefix() + [{"role": "user", "content": self.user_turns[0]}]

    def prompt_chars(self) -> int:
        """Length of the first prompt in characters: how server backends (which tokenize themselves) rank
        prompts to group batches."""
        return sum(len(m["content"]) for m in self.first_prompt())

    def digest(self) -> str:
        doc = {"id": self.id, "system": self.system, "user_turns": list(self.user_turns)}
        return hashlib.sha256(json.dumps(doc, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def to_item(conv: dict, system_prompt: Optional[str] = None) -> RegenItem:
    """A data-layer Conversation -> RegenItem. Every user message is a turn to answer, whether or not an
    assistant message follows it; `system_prompt` applies when the conversation has no system message."""
    system, turns = prompt_turns(conv)
    system = system_prompt if system is None else system
    meta = {k: v for k, v in (conv.get("meta") or {}).items() if k != "followup_turns"}
    if not turns:
        raise ValueError(f"conversation {conv['id']!r} has no user turn")
    return RegenItem(id=str(conv["id"]), system=system, user_turns=tuple(turns), meta=meta)


def to_items(convs: Iterable[dict], system_prompt: Optional[str] = None, limit: Optional[int] = None
             ) -> list[RegenItem]:
    items = []
    for conv in convs:
        if limit is not None and len(items) >= limit:
            break
        items.append(to_item(conv, system_prompt))
    return items


def read_items(cfg, report) -> list[RegenItem]:
    """The conversations regen answers under the root config `cfg` (its data sources, `data.system_prompt` and
    `regen.limit`); bad and skipped records go to `report` (a BadRecordReport)."""
    from pipeline.data.readers import read_sources

    return to_items(read_sources(cfg.data, report), cfg.data.system_prompt, cfg.regen.limit)


@dataclass(frozen=True)
class Plan:
    batches: tuple[tuple[int, ...], ...]  # item indices of each batch, in generation order
    batches_per_shard: int
    digest: str  # identifies items (content included) and batch boundaries

    @property
    def n_batches(self) -> int:
        return len(self.batches)

    @property
    def n_items(self) -> int:
        return sum(len(b) for b in self.batches)

    @property
    def n_shards(self) -> int:
        return -(-self.n_batches // self.batches_per_shard)

    def shard_batches(self, shard: int) -> range:
        start = shard * self.batches_per_shard
        return range(start, min(start + self.batches_per_shard, self.n_batches))

    def shard_size(self, shard: int) -> int:
        return sum(len(self.batches[b]) for b in self.shard_batches(shard))


def make_plan(items: list[RegenItem], batch_size: int, batches_per_shard: int,
              prompt_length: Callable[[RegenItem], int]) -> Plan:
    """Batches of `batch_size` items grouped by turn count (waves stay full) and first-prompt length
    (little left padding). `prompt_length` is the backend's measure (tokens for hf)."""
    if batch_size < 1 or batches_per_shard < 1:
        raise ValueError(f"batch_size ({batch_size}) and batches_per_shard ({batches_per_shard}) must be >= 1")
    lengths = [prompt_length(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: (len(items[i].user_turns), lengths[i], i))
    batches = tuple(tuple(order[i:i + batch_size]) for i in range(0, len(order), batch_size))
    h = hashlib.sha256(f"bps={batches_per_shard}".encode())
    for batch in batches:
        h.update(b"|batch|")
        for i in batch:
            h.update(items[i].digest().encode())
    return Plan(batches=batches, batches_per_shard=batches_per_shard, digest=h.hexdigest()[:16])


def derive_seed(*parts) -> int:
    """A stable 31-bit seed from any parts (fits every server's seed field)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") % (2 ** 31)
