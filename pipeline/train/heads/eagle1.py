"""EAGLE-1 draft head, module-for-module identical to the official head (SafeAILab/EAGLE
eagle/model/cnets1.py):

    fc                 Linear(2H -> H) on cat(embedding, feature) -- embedding FIRST, as the official code
    layers.0           one Llama decoder layer without input_layernorm (the official index-0 layer)
    embed_tokens       frozen copy of the target embedding
    lm_head            frozen copy of the target lm_head (neither trained nor exported)

Its output is the predicted next feature (what the target's lm_head would read); logits come from the
frozen target lm_head, so the draft vocabulary is the target vocabulary (d2t = 0, t2d = all True).

The official fc has a bias by default (cnets1.Model(bias=True), read back from the checkpoint's config);
here `fc_bias` defaults to False per the project spec -- set it True to mirror official checkpoints.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import nn

from .common import MLP, AttendFn, Attention, DraftHeadMixin, KVCache, RMSNorm, RotaryEmbedding, cached_attention
from .config import DraftHeadConfig


class Eagle1DecoderLayer(nn.Module):
    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.self_attn = Attention(config, in_features=config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        h = x + self.self_attn(x, cos, sin, attend)  # no input_layernorm: fc output goes in directly
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1DraftHead(DraftHeadMixin, nn.Module):
    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self._init_head(config, "eagle1")
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList([Eagle1DecoderLayer(config)])
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self._init_vocab_buffers()

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """EAGLE-1 reads the target's final feature as is: [B,T,H] -> [B,T,H]."""
        return target_states.to(self.fc.weight.dtype)

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """predicted feature [..., H] -> target-vocabulary logits through the frozen target lm_head."""
        return self.lm_head(out_hidden)

    def forward_hidden(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Optional[KVCache] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`forward` without the logits (training computes them for the loss-masked rows only)."""
        emb = self.embed(input_ids).to(hidden.dtype)
        x = self.fc(torch.cat((emb, hidden), dim=-1))  # [B,T,2H] -> [B,T,H]
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        attend = partial(cached_attention, cache=cache, layer_idx=0, attn_mask=attn_mask)
        return self.layers[0](x, cos, sin, attend)

    @torch.no_grad()
    def copy_from_target(self, target_model: nn.Module) -> None:
        """Copy the frozen embedding and lm_head from an HF causal LM."""
        self.copy_target_embeddings(target_model.get_input_embeddings().weight)
        self.lm_head.weight.copy_(target_model.get_output_embeddings().weight)
