"""EAGLE-1 draft head, module-for-module identical to the official head (SafeAILab/EAGLE
eagle/model/cnets1.py):

    fc                 Linear(2H -> H) on cat(embedding, feature) -- embedding FIRST, as the official code
    layers.0           one Llama decoder layer without input_layernorm (the official index-0 layer)
    embed_tokens       frozen copy of the target embedding
    lm_head            frozen copy of the target lm_head (neither trained nor exported)

Its output is the predicted next feature (what the target's lm_head would read); logits come from the
frozen target lm_head, so the draft vocabulary is the target vocabulary (d2t = 0, t2d = all True).

The official fc has a bias by default (cnets1.Model(bias=True), read back from the checkpoint's config);
here `fc_bias` defaults to False (head.fc_bias) -- set it True to mirror official checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
from torch import nn

from .config import ARCHITECTURE, DraftHeadConfig, HeadConfig
from .layers import MLP, AttendFn, Attention, DraftHeadMixin, KVCache, RMSNorm, RotaryEmbedding, cached_attention
from .losses import align_batch, eagle1_loss
from .registry import HeadSpec, register_head


@dataclass
class Eagle1HeadConfig(HeadConfig):
    """The `head` options of EAGLE-1 (conf/head/eagle1.yaml)."""
    kind: str = "eagle1"
    name: str = "eagle1"
    rope_theta: float = field(default=10000.0, metadata=ARCHITECTURE)
    fc_bias: bool = field(default=False, metadata=ARCHITECTURE)  # True mirrors official checkpoints
    feature_loss_weight: float = 1.0
    token_loss_weight: float = 0.1
    feature_noise: float = 0.2  # uniform noise scale on input features

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


class Eagle1Objective(nn.Module):
    """Head + EAGLE-1 loss (feature regression + token soft-CE through the frozen target lm_head)."""

    def __init__(self, head: Eagle1DraftHead, feature_weight: float, token_weight: float, noise: float):
        super().__init__()
        self.head = head
        self.feature_weight, self.token_weight, self.noise = feature_weight, token_weight, noise

    @classmethod
    def from_config(cls, head, head_cfg: Eagle1HeadConfig, target_lm_head_weight: torch.Tensor) -> "Eagle1Objective":
        # The head holds its own frozen copy of the target lm_head: the weight argument is not needed.
        return cls(head, head_cfg.feature_loss_weight, head_cfg.token_loss_weight, head_cfg.feature_noise)

    def stat_shapes(self) -> dict[str, int]:
        return {"loss": 1, "feature_loss": 1, "token_loss": 1, "round_correct": 1, "round_total": 1}

    def forward(self, input_ids, loss_mask, attention_mask, aux_hidden, final_hidden, noise_seed=None):
        batch = align_batch(input_ids, loss_mask, final_hidden, final_hidden, attention_mask)
        generator, noise = None, 0.0
        if self.training and self.noise > 0:
            noise = self.noise
            generator = torch.Generator(final_hidden.device).manual_seed(int(noise_seed or 0))
        out = eagle1_loss(self.head, batch, self.feature_weight, self.token_weight, noise, generator)
        return {"loss": out["loss"], "feature_loss": out["feature_loss"], "token_loss": out["token_loss"],
                "round_correct": out["correct"].reshape(1), "round_total": out["total"].reshape(1)}


register_head(HeadSpec(kind="eagle1", options_class=Eagle1HeadConfig, head_class=Eagle1DraftHead,
                       objective_class=Eagle1Objective, num_aux_layers=0, full_vocab=True))
