"""Online training rows (`train.source=online`): the target runs inside the training job and its hidden states
never touch the disk.

A dump of a real target is large (Llama-3.1-8B's EAGLE-3 inputs are 32 KiB a token in bf16: 1B tokens is
32 TB). Online, each micro-batch's states are computed when the trainer asks for it, by the dump stage's own
code: the same conversations (`read_conversations`, i.e. `dump.input`), the same tokenization and loss mask
(`tokenize_all`, made once and shared with the dump stage: hidden_states/tokens.py), the same layers and
capture (`HiddenStateCapture`), the target at the dump's precision. So a row trains on exactly what a dump would
have stored for it, and everything else in the trainer (data order, packing, resume, ranks) is the offline code
path: each rank computes the states of its own micro-batches on its own target replica.

Offline wins when the states are reused (several epochs, several heads, ablations); online when the data is
large and seen once or twice. docs/results/speed.md, "Online or offline training", has the figures.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from pipeline.hidden_states.capture import HiddenStateCapture, pad_batch, resolve_layer_ids
from pipeline.hidden_states.plan import TokenizedSample, row_order
from pipeline.hidden_states.tokens import tokenized_input

from .data import Batch

log = logging.getLogger(__name__)


@dataclass
class OnlineRow:
    """A training row before its states exist: what the draft vocabulary and the tau probe read."""

    id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T]


class OnlineRows:
    """The trainer's rows with states computed on demand: `len`, `lengths`, `num_tokens`, `layer_ids` and
    `rows[i]` (tokens only) as a DumpReader has them, and `collate` in place of reading a dump."""

    def __init__(self, target, samples: Sequence[TokenizedSample], layer_ids: Optional[Sequence[int]],
                 inputs: Sequence = ()):
        self.target = target
        self.samples = [samples[i] for i in row_order([len(s) for s in samples])]  # a dump's row order
        self.layer_ids = resolve_layer_ids(layer_ids, target.num_layers)
        self.lengths = [len(s) for s in self.samples]
        self.num_tokens = sum(self.lengths)
        self.inputs = list(inputs)  # stage dirs read (the regen output), for the train manifest

    @classmethod
    def from_config(cls, cfg, target) -> "OnlineRows":
        """What the dump stage would read for this experiment, tokenized by the target's template."""
        rows = tokenized_input(cfg, target, "train.source=online")  # the dump's arrays when it ran, else made here
        return cls(target, rows.samples, cfg.dump.layer_ids, rows.inputs)

    def digest(self) -> str:
        """sha256 of the rows as trained on (ids, tokens and loss masks, in order): the same on every machine that
        tokenized the same input, whatever its manifests say of times and paths."""
        h = hashlib.sha256()
        for s in self.samples:
            ids, mask = np.ascontiguousarray(s.input_ids, np.int32), np.ascontiguousarray(s.loss_mask, np.uint8)
            h.update(f"{s.id}\0{len(ids)}\0".encode())
            h.update(ids.tobytes())
            h.update(mask.tobytes())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> OnlineRow:
        s = self.samples[i]
        # Copies: the tokens are read-only views of the shared arrays (hidden_states/tokens.py).
        return OnlineRow(s.id, torch.from_numpy(np.array(s.input_ids, dtype=np.int64)),
                         torch.from_numpy(np.array(s.loss_mask, dtype=np.int64)))

    def tokens(self, indices: Sequence[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of the rows `indices`, as DumpReader.tokens gives them (here a row at a time)."""
        for i in indices:
            row = self[i]
            yield row.input_ids, row.loss_mask

    def collate(self, indices: Sequence[int], max_length: int, with_aux: bool,
                dtype: torch.dtype = torch.float32) -> Batch:
        """The micro-batch `collate` builds from a dump, with the states computed now: rows truncated to
        max_length (under a causal mask a prefix's states do not depend on what follows it), right-padded,
        states zero at the pads as a dump batch has them."""
        rows = [self.samples[i].input_ids[:max_length] for i in indices]
        input_ids, attention_mask = pad_batch(rows, self.target.device)  # [B, T], [B, T]
        with HiddenStateCapture(self.target.model, self.layer_ids) as cap:
            aux, final = cap.forward(input_ids, attention_mask)  # [B, T, n*H], [B, T, H], target dtype
        real = attention_mask.bool()
        keep = real.unsqueeze(-1).to(final.dtype)  # [B, T, 1]
        loss_mask, _ = pad_batch([self.samples[i].loss_mask[:max_length] for i in indices], input_ids.device)
        # The products are ordinary tensors (not inference-mode ones, which autograd refuses), on the target's
        # device, in the master dtype as collate gives them.
        return Batch(input_ids, loss_mask, real, (final * keep).to(dtype), (aux * keep).to(dtype) if with_aux else None)
