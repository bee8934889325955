"""Draft vocabulary of an EAGLE-3 head: the N most frequent predicted tokens of the training dump.

Maps (the official EAGLE-3 / SGLang convention): draft ids enumerate the kept target ids in ascending
order; `d2t[i] = target_id - i` (target id = draft id + d2t[draft id]); `t2d` is a bool mask over the
target vocabulary."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

log = logging.getLogger(__name__)


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [N]
    t2d: torch.Tensor  # bool [V]
    coverage: float  # fraction of the counted (loss-masked) tokens that the draft vocabulary contains

    @property
    def size(self) -> int:
        return self.d2t.numel()

    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.size) + self.d2t


def count_predicted_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Token frequencies [V] (int64) over the loss-masked positions of (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in samples:
        ids = torch.as_tensor(input_ids).reshape(-1)[torch.as_tensor(loss_mask).reshape(-1).bool()]
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    return counts


def vocab_from_ids(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept target ids (any order, unique) -> (d2t int64 [N], t2d bool [V])."""
    ids = torch.sort(ids.long()).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def build_draft_vocab(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, draft_vocab_size: int
) -> DraftVocab:
    """The `draft_vocab_size` most frequent target tokens among the loss-masked positions of `samples`
    ((input_ids [T], loss_mask [T]) pairs), ties broken by the lower id; capped at the number of distinct
    tokens seen. The head's `config.draft_vocab_size` must then be `result.size`."""
    counts = count_predicted_tokens(samples, vocab_size)
    seen = int((counts > 0).sum())
    if seen == 0:
        raise ValueError("no loss-masked tokens: cannot build a draft vocabulary")
    n = draft_vocab_size
    if n > seen:
        log.info("draft vocabulary capped at %d: only %d distinct predicted tokens seen (asked for %d)", seen, seen, n)
        n = seen
    # Stable sort on -count keeps ascending ids among equal counts: deterministic ties.
    order = torch.sort(-counts, stable=True).indices[:n]
    d2t, t2d = vocab_from_ids(order, vocab_size)
    total = int(counts.sum())
    coverage = float(counts[order].sum()) / total if total else 0.0
    log.info("draft vocabulary: %d tokens cover %.2f%% of the predicted tokens", n, 100 * coverage)
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage)
