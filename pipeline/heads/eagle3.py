"""EAGLE-3 draft head, module-for-module identical to the official head (SafeAILab/EAGLE
eagle/traineagle3/cnets.py) so the exported weights load into SGLang/vLLM's LlamaForCausalLMEagle3:

    fc_norm            EAGLE-3.1 only (config.fc_norm): an RMSNorm per fused state, before fc
    fc                 Linear(3*H_target -> H, no bias) on the fused (low, mid, high) target states
                       (aux_layer_ids, input-to-layer ids; default `default_aux_layer_ids`)
    midlayer           one decoder layer whose attention reads cat(input_layernorm(emb), hidden_norm(hidden))
    norm, lm_head      final RMSNorm and Linear(H -> draft vocab)
    embed_tokens       frozen copy of the target embedding
    d2t, t2d           draft<->target vocabulary maps

EAGLE-3.1's `norm_output` (config.norm_output) feeds the next draft step (and TTT round) the final norm's output
instead of the pre-norm midlayer output; the logits then read that state without a second norm.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
from torch import nn

from pipeline.families import FinalNorm, family_of

from .config import ARCHITECTURE, DraftHeadConfig, HeadConfig, LmHeadInit
from .layers import MLP, AttendFn, Attention, DraftHeadMixin, KVCache, RMSNorm, RotaryEmbedding, cached_attention
from .losses import align_batch
from .registry import HeadSpec, register_head
from .ttt import eagle3_ttt_loss


@dataclass
class Eagle3HeadConfig(HeadConfig):
    """The `head` options of EAGLE-3 (conf/head/eagle3.yaml)."""
    kind: str = "eagle3"
    name: str = "eagle3"
    draft_vocab_size: int = 32000  # capped at the distinct tokens the training data holds
    ttt_steps: int = 7  # training-time-test rounds
    ttt_decay: float = 0.8  # weight of round i is decay**i
    # "random" as the official EAGLE-3 trainer; "target" starts lm_head/norm as the target's (draft-vocab rows,
    # final norm; as speculators does for lm_head), "target_rows" the lm_head rows only. On the SmolLM2
    # quality dump "target" was worse (val round-0 accuracy 0.144 against 0.203 at step 50), hence the default.
    lm_head_init: LmHeadInit = LmHeadInit.random
    rope_theta: float = field(default=10000.0, metadata=ARCHITECTURE)
    # EAGLE-3.1: an RMSNorm on each fused target state before fc, and the final norm's output (not the pre-norm
    # state) fed back as the next step's hidden. Config keys `fc_norm` / `norm_output` in both export dialects,
    # as vLLM, SGLang and speculators read them.
    fc_norm: bool = field(default=False, metadata=ARCHITECTURE)
    norm_output: bool = field(default=False, metadata=ARCHITECTURE)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lm_head_init = LmHeadInit.parse(self.lm_head_init, "head.lm_head_init")

class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """emb, hidden [B,T,H] -> pre-norm output [B,T,H]. The residual is the un-normalized hidden."""
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)  # [B,T,2H]
        h = hidden + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftHead(DraftHeadMixin, nn.Module):
    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self._init_head(config, "eagle3")
        h = config.hidden_size
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                         for _ in config.aux_layer_ids)
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self._init_vocab_buffers()

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """aux states [B,T,3*H_target] (low, mid, high) -> [B,T,H]."""
        x = target_states.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            chunks = x.split(self.config.target_hidden_size, dim=-1)  # 3 x [B,T,H_target]
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(x)

    def layer(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """One midlayer pass with a given attention kernel -> the state fed to the next step [B,T,H]: the
        pre-norm output, or with norm_output the final norm's output."""
        emb = self.embed(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.midlayer(emb, hidden, cos, sin, attend)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """`layer`'s output [..., H] -> draft-vocabulary logits [..., V_draft] (normed once either way)."""
        return self.lm_head(out_hidden if self.config.norm_output else self.norm(out_hidden))

    def forward_hidden(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Optional[KVCache] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`forward` without the logits."""
        attend = partial(cached_attention, cache=cache, layer_idx=0, attn_mask=attn_mask)
        return self.layer(hidden, input_ids, position_ids, attend)

    @torch.no_grad()
    def copy_from_target(self, target_model: nn.Module) -> None:
        """Copy the frozen embedding from an HF causal LM."""
        self.copy_target_embeddings(target_model.get_input_embeddings().weight)

    @torch.no_grad()
    def init_output_from_target(self, target_model: nn.Module, copy_norm: bool = True) -> None:
        """Start the (trainable) output path as the target's: lm_head = the target lm_head rows of the draft
        vocabulary (as vllm-project/speculators initializes it), norm = the target's final RMSNorm. Call
        after `set_draft_vocab`. The idea: training then only has to bring out_hidden near the target's last
        pre-norm state, as EAGLE-1 gets the target's lm_head for free. Measured on SmolLM2 it learned slower
        than a random lm_head (the target-scale logits of a still-random out_hidden give huge early
        gradients), so it is opt-in: head.lm_head_init=target; `copy_norm=False` (head.lm_head_init=target_rows)
        copies the lm_head rows only and leaves the norm at 1."""
        weight = target_model.get_output_embeddings().weight  # [V, H_target]
        if weight.shape[1] != self.lm_head.in_features:
            raise ValueError(f"target lm_head width {weight.shape[1]} != draft hidden {self.lm_head.in_features}")
        ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(weight[ids.to(weight.device)])  # [V_draft, H]
        final_norm = getattr(target_model.base_model, "norm", None)
        # Only a Llama-convention RMSNorm (weight * x_hat) means the same thing in this head's RMSNorm.
        if copy_norm and family_of(target_model.config).final_norm == FinalNorm.rms and final_norm is not None:
            self.norm.weight.copy_(final_norm.weight)


class Eagle3Objective(nn.Module):
    """Head + TTT loss (ttt.py). The frozen target lm_head is a non-persistent buffer: it gives the soft
    targets (the dump holds final hidden states, not logits) and is never trained or saved."""

    def __init__(self, head: Eagle3DraftHead, target_lm_head_weight: torch.Tensor, ttt_steps: int, ttt_decay: float):
        super().__init__()
        self.head = head
        self.register_buffer("target_lm_head", target_lm_head_weight.detach(), persistent=False)
        self.ttt_steps, self.decay = ttt_steps, ttt_decay

    @classmethod
    def from_config(cls, head, head_cfg: Eagle3HeadConfig, target_lm_head_weight: torch.Tensor) -> "Eagle3Objective":
        return cls(head, target_lm_head_weight, head_cfg.ttt_steps, head_cfg.ttt_decay)

    def stat_shapes(self) -> dict[str, int]:
        return {"loss": 1, "round_loss": self.ttt_steps, "round_correct": self.ttt_steps,
                "round_total": self.ttt_steps}

    def forward(self, input_ids, loss_mask, attention_mask, aux_hidden, final_hidden, noise_seed=None):
        batch = align_batch(input_ids, loss_mask, aux_hidden, final_hidden, attention_mask)
        out = eagle3_ttt_loss(self.head, batch, self.target_lm_head, self.ttt_steps, self.decay)
        return {"loss": out["loss"], "round_loss": out["round_loss"], "round_correct": out["round_correct"],
                "round_total": out["round_total"]}


register_head(HeadSpec(kind="eagle3", options_class=Eagle3HeadConfig, head_class=Eagle3DraftHead,
                       objective_class=Eagle3Objective, num_aux_layers=3, full_vocab=False))
