"""Medusa-1 heads (Cai et al. 2024), the baseline of the EAGLE papers: K independent heads on the target's last
hidden state (its final-norm output, the dump's final feature), the target frozen.

    head i (i = 0..K-1):  ResBlock^L (x + SiLU(W1 x), W1 zero-initialized) then lm_head (H -> draft vocab,
                          initialized from the target's lm_head rows): from the state at position t it predicts
                          the token at t + 2 + i (the target's own lm_head predicts t + 1).
    d2t, t2d              the draft vocabulary, as EAGLE-3's (Medusa's lm_heads are full-vocabulary; the same
                          draft vocabulary keeps the comparison at equal output size and the CPU cost down)

Unlike EAGLE, a head never sees the drafted tokens: the candidates at depth i + 1 are head i's top tokens for
every parent. Decoding builds a score-pruned tree over them (pipeline/decoding/drafter.py: MedusaDrafter). Training
(Medusa-1): cross-entropy on the next tokens, which in eaglet's data are the target's own answers, weighted
`loss_decay**i` per head. Medusa has no serving export here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ARCHITECTURE, DraftHeadConfig, HeadConfig
from .layers import DraftHeadMixin
from .registry import HeadSpec, register_head


@dataclass
class MedusaHeadConfig(HeadConfig):
    """The `head` options of Medusa-1 (conf/head/medusa.yaml)."""
    kind: str = "medusa"
    name: str = "medusa"
    draft_vocab_size: int = 32000  # capped at the distinct tokens the training data holds
    medusa_num_heads: int = field(default=4, metadata=ARCHITECTURE)  # K: head i predicts the token i + 2 ahead
    medusa_num_layers: int = field(default=1, metadata=ARCHITECTURE)  # L residual blocks per head
    loss_decay: float = 0.8  # head i's loss weighs loss_decay**i (Medusa-1's 0.8)

class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # the head starts as the target's lm_head (Medusa's init)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.blocks = nn.Sequential(*(ResBlock(config.target_hidden_size) for _ in range(config.medusa_num_layers)))
        self.lm_head = nn.Linear(config.target_hidden_size, config.draft_vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """final-norm states [..., H] -> draft logits [..., V_draft]."""
        return self.lm_head(self.blocks(hidden))


class MedusaHeads(DraftHeadMixin, nn.Module):
    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        if config.kind != "medusa":
            raise ValueError(f"MedusaHeads needs kind='medusa', got {config.kind!r}")
        self.config = config  # no embedding: the heads never read tokens
        self.heads = nn.ModuleList(MedusaHead(config) for _ in range(config.medusa_num_heads))
        self._init_vocab_buffers()
        self._target_lm_head: Optional[torch.Tensor] = None

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [..., H] -> K logits [..., V_draft] (head i: the token i + 2 positions ahead)."""
        return [head(hidden.to(head.lm_head.weight.dtype)) for head in self.heads]

    def head_logits(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        head = self.heads[i]
        return head(hidden.to(head.lm_head.weight.dtype))

    @torch.no_grad()
    def copy_from_target(self, target_model: nn.Module) -> None:
        """Keep the target's lm_head: `set_draft_vocab` starts each head's lm_head from its draft-vocab rows
        (after loading a trained head nothing is overwritten)."""
        self._target_lm_head = target_model.get_output_embeddings().weight

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        super().set_draft_vocab(d2t, t2d)
        if self._target_lm_head is not None:
            ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
            rows = self._target_lm_head[ids.to(self._target_lm_head.device)]  # [V_draft, H]
            for head in self.heads:
                head.lm_head.weight.copy_(rows)

    def init_output_from_target(self, target_model: nn.Module, copy_norm: bool = True) -> None:
        """head.lm_head_init: Medusa's heads always start from the target's rows (`set_draft_vocab`)."""

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -1 outside the draft vocabulary."""
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        lookup[self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))] = \
            torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        return lookup[target_ids]


class MedusaObjective(nn.Module):
    """Heads + the Medusa-1 loss: head i's cross-entropy on token t + 2 + i wherever that token is an
    assistant token (loss mask) inside the draft vocabulary; accuracy counts every assistant token."""

    def __init__(self, head: MedusaHeads, decay: float):
        super().__init__()
        self.head, self.decay = head, decay

    @classmethod
    def from_config(cls, head, head_cfg: MedusaHeadConfig, target_lm_head_weight: torch.Tensor) -> "MedusaObjective":
        return cls(head, head_cfg.loss_decay)

    def stat_shapes(self) -> dict[str, int]:
        k = self.head.config.medusa_num_heads
        return {"loss": 1, "round_loss": k, "round_correct": k, "round_total": k}

    def forward(self, input_ids, loss_mask, attention_mask, aux_hidden, final_hidden, noise_seed=None):
        losses, correct, total = [], [], []
        real = attention_mask.bool()
        valid = loss_mask.bool() & real  # [B,T]
        for i in range(self.head.config.medusa_num_heads):
            shift = i + 2
            rows = valid[:, shift:] & real[:, :-shift]  # [B, T - shift]: a real state, an assistant token ahead
            hidden = final_hidden[:, :-shift][rows]  # [n, H]
            labels = input_ids[:, shift:][rows]  # [n] target ids
            draft_labels = self.head.target_to_draft(labels)
            logits = self.head.head_logits(i, hidden).float()  # [n, V_draft]
            inside = draft_labels >= 0
            loss = (F.cross_entropy(logits[inside], draft_labels[inside]) if bool(inside.any())
                    else logits.sum() * 0.0)
            pred = self.head.draft_to_target(logits.argmax(-1)) if len(labels) else labels
            losses.append(loss)
            correct.append((pred == labels).sum().to(torch.float32))
            total.append(torch.tensor(float(len(labels)), device=labels.device))
        weights = torch.tensor([self.decay**i for i in range(len(losses))], device=losses[0].device)
        round_loss = torch.stack(losses)
        return {"loss": (weights * round_loss).sum(), "round_loss": round_loss.detach(),
                "round_correct": torch.stack(correct), "round_total": torch.stack(total)}


register_head(HeadSpec(kind="medusa", options_class=MedusaHeadConfig, head_class=MedusaHeads,
                       objective_class=MedusaObjective, num_aux_layers=0, full_vocab=False, drafter="medusa"))
