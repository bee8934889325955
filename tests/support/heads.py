"""Standalone draft heads of a small fixed shape, no target needed (test_heads.py, shared with test_padding.py):
their config and a seeded head with non-trivial norms."""
from __future__ import annotations

import torch

from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig

H, HEADS, KV, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 120, 40


def tiny_config(kind: str, **kw) -> DraftHeadConfig:
    return DraftHeadConfig(
        kind=kind, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
        intermediate_size=INTER, rms_norm_eps=1e-6, max_position_embeddings=256, vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB if kind == "eagle3" else VOCAB, target_hidden_size=H,
        aux_layer_ids=[2, 4, 5] if kind == "eagle3" else [], **kw,
    )


def make_head(kind: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    head = build_draft_head(tiny_config(kind, **kw)).eval()
    with torch.no_grad():  # non-trivial norms so a swapped or missing norm shows up in the outputs
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        head.embed_tokens.weight.normal_()
    return head
