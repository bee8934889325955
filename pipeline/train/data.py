"""Batches for the trainer from a hidden-state dump.

The data order is a pure function of (seed, epoch): the train/validation split, each epoch's shuffle, the
length-bucketed packing and the batch order all come from numpy generators seeded with those numbers and
nothing else. A step is a fixed block of `grad_accum x world_size` micro-batches of that order, so the
position in the data is just the step number -- what mid-epoch resume and the 1-vs-N-process equivalence
rest on."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np
import torch

# Independent numpy streams per purpose: changing how one is drawn never shifts another.
_SPLIT_STREAM, _EPOCH_STREAM, _SUBSET_STREAM = 1, 2, 3


def split_train_val(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Held-out validation rows: a seeded random `val_fraction` of the dump (at least one row when the
    fraction is positive and the dump has two or more rows). Both lists come back sorted."""
    rng = np.random.default_rng([seed, _SPLIT_STREAM])
    perm = rng.permutation(n)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    return sorted(perm[n_val:].tolist()), sorted(perm[:n_val].tolist())


def subsample(indices: Sequence[int], fraction: float, seed: int) -> list[int]:
    """A seeded random `fraction` of the training rows, for data-scaling runs. The permutation depends only
    on the number of rows, so a smaller fraction is a subset of a larger one and runs at several fractions
    differ only by the rows added."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"train.train_fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0:
        return list(indices)
    rng = np.random.default_rng([seed, _SUBSET_STREAM])
    keep = rng.permutation(len(indices))[:max(1, int(round(len(indices) * fraction)))]
    return sorted(int(indices[j]) for j in keep)


def pack(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing of rows in the given order into micro-batches with rows x longest <= max_tokens.
    Feed rows sorted by length so each batch pads little; a row longer than the budget goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in indices:
        n = lengths[i]
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(int(i))
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def epoch_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int, bucket_size: int,
                  seed: int, epoch: int) -> list[list[int]]:
    """The micro-batches of one epoch: shuffle, sort each bucket of `bucket_size` rows by length (longest
    first, ties by index), pack, then shuffle the batches so lengths are mixed across steps."""
    rng = np.random.default_rng([seed, _EPOCH_STREAM, epoch])
    order = rng.permutation(np.asarray(indices, dtype=np.int64)).tolist()
    batches: list[list[int]] = []
    for start in range(0, len(order), bucket_size):
        bucket = sorted(order[start:start + bucket_size], key=lambda i: (-lengths[i], i))
        batches += pack(bucket, lengths, max_tokens)
    return [batches[j] for j in rng.permutation(len(batches))]


def eval_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Validation micro-batches: fixed, sorted by length (no shuffling: every evaluation sees the same)."""
    return pack(sorted(indices, key=lambda i: (-lengths[i], i)), lengths, max_tokens)


@dataclass(frozen=True)
class StepSchedule:
    """Which micro-batches of an epoch's order make up each optimizer step, and which of them this rank
    computes. Step s of an epoch is the block [s*M, (s+1)*M) with M = grad_accum x world_size; rank r takes
    every world_size-th batch of the block starting at r. A trailing partial block is dropped so all ranks
    always run the same number of micro-batches."""

    grad_accum: int
    rank: int = 0
    world_size: int = 1

    @property
    def micro_per_step(self) -> int:
        return self.grad_accum * self.world_size

    def steps_per_epoch(self, n_batches: int) -> int:
        return n_batches // self.micro_per_step

    def rank_batches(self, n_batches: int, step_in_epoch: int) -> list[int]:
        """Positions (in the epoch's batch order) of this rank's micro-batches for that step."""
        start = step_in_epoch * self.micro_per_step
        if start + self.micro_per_step > n_batches:
            raise IndexError(f"step {step_in_epoch} is past the epoch's {self.steps_per_epoch(n_batches)} steps")
        return list(range(start + self.rank, start + self.micro_per_step, self.world_size))


@dataclass
class Batch:
    """A right-padded micro-batch of dump rows."""

    input_ids: torch.Tensor  # [B,T] int64, pad 0
    loss_mask: torch.Tensor  # [B,T] int64 0/1
    attention_mask: torch.Tensor  # [B,T] bool, True = real token
    final_hidden: torch.Tensor  # [B,T,H]
    aux_hidden: Optional[torch.Tensor]  # [B,T,n_layers*H] (eagle3) or None (eagle1 reads final_hidden only)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> "Batch":
        return Batch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                        for f in fields(self)})


def collate(reader, indices: Sequence[int], max_length: int, with_aux: bool,
            dtype: torch.dtype = torch.float32) -> Batch:
    """Rows of a DumpReader, truncated to max_length and right-padded to the longest. Features are cast
    to `dtype` (the master-weight dtype; autocast handles bf16 compute on GPU). Rows whose states are
    computed on demand (train.source=online, OnlineRows) build the same batch themselves."""
    if hasattr(reader, "collate"):
        return reader.collate(indices, max_length, with_aux, dtype)
    samples = [reader[i] for i in indices]
    t = min(max(len(s.input_ids) for s in samples), max_length)
    b, h = len(samples), samples[0].final_hidden.shape[-1]
    input_ids = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.bool)
    final_hidden = torch.zeros(b, t, h, dtype=dtype)
    aux = torch.zeros(b, t, samples[0].aux_hidden.shape[-1], dtype=dtype) if with_aux else None
    for row, s in enumerate(samples):
        n = min(len(s.input_ids), t)
        input_ids[row, :n] = s.input_ids[:n]
        loss_mask[row, :n] = s.loss_mask[:n]
        attention_mask[row, :n] = True
        final_hidden[row, :n] = s.final_hidden[:n]
        if with_aux:
            aux[row, :n] = s.aux_hidden[:n]
    return Batch(input_ids, loss_mask, attention_mask, final_hidden, aux)


def truncated_lengths(lengths: Sequence[int], max_length: int) -> list[int]:
    return [min(int(n), max_length) for n in lengths]


def prompt_of(sample) -> Optional[torch.Tensor]:
    """The prompt of a dump row's first assistant turn: its tokens before the first loss-masked one
    (None when the row has no trained tokens or no prompt)."""
    masked = sample.loss_mask.nonzero()
    if len(masked) == 0 or int(masked[0]) == 0:
        return None
    return sample.input_ids[: int(masked[0])].clone()
