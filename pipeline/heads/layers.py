"""Building blocks shared by the EAGLE-1 and EAGLE-3 draft heads: Llama-style RMSNorm, RoPE, attention
projections, SwiGLU MLP, the KV cache used by the tree decoder, and the frozen-vocabulary plumbing.

Attention is split into projections (`Attention.qkv`) and a pluggable kernel (`attend(q, k, v)`), so the same
layer runs plain/cached attention at decode time and the TTT attention (ttt.py) in training."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import DraftHeadConfig

# attend(q [B,h,T,D] (RoPE applied), k [B,kv,T,D] (RoPE applied), v [B,kv,T,D]) -> [B,h,T,D]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalize in fp32, scale in the input dtype (same numerics as HF LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Standard Llama RoPE (rotate_half convention, no scaling)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B,T] -> cos, sin [B,1,T,D] (broadcast over heads), computed in fp32."""
        freqs = position_ids[..., None].float() * self.inv_freq  # [B,T,D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B,1,T,D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B,kv,S,D] -> [B,kv*groups,S,D]. Explicit expansion instead of SDPA's enable_gqa: on CPU the
    flash kernel is markedly faster without it, and the copy is only O(S*D) per head."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


class Attention(nn.Module):
    """q/k/v from `in_features` (2H for EAGLE-3, H for EAGLE-1), o_proj back to H; no biases."""

    def __init__(self, config: DraftHeadConfig, in_features: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,T,in] -> q [B,h,T,D], k [B,kv,T,D] (RoPE applied), v [B,kv,T,D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        out = attend(q, k, v)  # [B,h,T,D]
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KVCache:
    """Per-layer keys/values [B, n_kv, S, head_dim] (RoPE applied) for decoding with a draft head."""

    def __init__(self, num_layers: int = 1):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[2]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new positions to layer `layer_idx`; returns the layer's full keys and values."""
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def crop(self, n: int) -> None:
        """Keep the first n positions (drop a rejected draft tree)."""
        self._select(lambda x: x[:, :, :n])

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only `indices` along S, in that order: LongTensor [S'] (all rows) or [B, S'] (per row)."""
        if indices.dim() == 1:
            self._select(lambda x: x.index_select(2, indices.to(x.device)))
        else:
            def gather(x):
                idx = indices.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
                return x.gather(2, idx)

            self._select(gather)

    def _select(self, fn) -> None:
        self.keys = [None if k is None else fn(k) for k in self.keys]
        self.values = [None if v is None else fn(v) for v in self.values]


def padded_causal_mask(attention_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """The causal mask of a padded training batch (attention_mask [B,T], True = real token) over its own keys,
    bool [B,1,T,T], or None when plain causal attention is exact.

    With right padding (every row a prefix of real tokens) causal attention never lets a real query see a pad
    key, so SDPA's is_causal suffices (and keeps its fused kernel). Otherwise (left padding) pad keys are hidden;
    every query keeps its own key so a pad query's row is never empty (its output is masked out of the loss)."""
    valid = attention_mask.bool()
    if bool((valid[:, 1:] <= valid[:, :-1]).all()):
        return None
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=valid.device)
    return (causal & valid[:, None, None, :]) | eye


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: Optional[KVCache] = None,
    layer_idx: int = 0,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of T new queries over the cache plus the T new keys (appended to the cache).

    attn_mask: bool [B,1,T,S] (True = may attend, S = cached + T), e.g. a draft-tree mask. None means
    causal among the new tokens with the whole cache visible."""
    if cache is not None:
        k, v = cache.append(layer_idx, k, v)
    t, s = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    is_causal = False
    if attn_mask is None and t > 1:
        if t == s:
            is_causal = True
        else:
            # SDPA's is_causal aligns top-left when T != S; new token i sits at absolute index S-T+i.
            past = s - t
            attn_mask = torch.arange(s, device=q.device)[None, :] <= torch.arange(t, device=q.device)[:, None] + past
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


class DraftHeadMixin:
    """Frozen target embedding, draft-vocabulary buffers and helpers common to both heads."""

    config: DraftHeadConfig
    embed_tokens: nn.Embedding

    def _init_head(self, config: DraftHeadConfig, kind: str) -> None:
        """Config check and the frozen target embedding, first in both heads (keeps state_dict order)."""
        if config.kind != kind:
            raise ValueError(f"{type(self).__name__} needs kind={kind!r}, got {config.kind!r}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)

    def _init_vocab_buffers(self) -> None:
        c = self.config
        # Identity-prefix default (draft id i = target id i) until `set_draft_vocab` installs the real one.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} != "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d.bool())

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B,T] -> frozen target embeddings [B,T,H]."""
        return self.embed_tokens(input_ids)

    @torch.no_grad()
    def copy_target_embeddings(self, weight: torch.Tensor) -> None:
        self.embed_tokens.weight.copy_(weight)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Optional[KVCache] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B,T,H] (EAGLE-3: fused target states or a previous out_hidden; EAGLE-1: the feature of
        tokens <= t), input_ids [B,T] (the token after the one whose state is hidden[t]), position_ids
        [B,T] -> (out_hidden [B,T,H]: EAGLE-3's pre-norm output fed back as the next hidden, EAGLE-1's
        predicted next feature; logits [B,T,V_draft])."""
        out = self.forward_hidden(hidden, input_ids, position_ids, cache, attn_mask)
        return out, self.logits(out)
