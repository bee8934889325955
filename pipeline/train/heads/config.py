"""Architecture config of a draft head, with Hugging Face field names (the export writes it to config.json)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

KINDS = ("eagle3", "eagle1")


@dataclass
class DraftHeadConfig:
    kind: str = "eagle3"  # eagle3 | eagle1
    hidden_size: int = 576
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    # The official EAGLE heads always train with theta 10000, whatever the target uses; the exported
    # config must carry the value the head was trained with, so it lives here and not in the target's.
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152  # target vocabulary
    draft_vocab_size: int = 32000  # eagle1: always == vocab_size (logits through the target lm_head)
    target_hidden_size: int = 576
    aux_layer_ids: list = field(default_factory=list)  # eagle3: input-to-layer ids (low, mid, high)
    fc_bias: bool = False  # eagle1 only (eagle3's fc never has a bias)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.hidden_act != "silu":
            raise ValueError("only hidden_act='silu' (SwiGLU, as in the official heads) is supported")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.kind == "eagle3" and len(self.aux_layer_ids) != 3:
            raise ValueError(f"eagle3 fuses exactly 3 target layers, got aux_layer_ids={self.aux_layer_ids}")
        if self.kind == "eagle1" and self.draft_vocab_size != self.vocab_size:
            raise ValueError("eagle1 predicts over the full target vocabulary: draft_vocab_size == vocab_size")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size cannot exceed the target vocab_size")

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        kind: str,
        draft_vocab_size: Optional[int],
        aux_layer_ids: Optional[Sequence[int]],
        rope_theta: float = 10000.0,
        fc_bias: bool = False,
        max_position_embeddings: Optional[int] = None,
    ) -> "DraftHeadConfig":
        """Dimensions from the target's HF config. `aux_layer_ids=None` takes the default
        `[2, L//2, L-3]` for eagle3 (input-to-layer ids, docs/design.md); `draft_vocab_size=None` means
        the full target vocabulary."""
        t = target_hf_config
        heads = t.num_attention_heads
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // heads
        vocab = t.vocab_size
        if kind == "eagle1":
            draft_vocab_size, aux_layer_ids = vocab, []
        elif aux_layer_ids is None:
            n = t.num_hidden_layers
            aux_layer_ids = [2, n // 2, n - 3]
        return cls(
            kind=kind,
            hidden_size=t.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=t.intermediate_size,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings or t.max_position_embeddings,
            vocab_size=vocab,
            draft_vocab_size=vocab if draft_vocab_size is None else draft_vocab_size,
            target_hidden_size=t.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            fc_bias=fc_bias,
            hidden_act=getattr(t, "hidden_act", "silu"),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftHeadConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DraftHeadConfig fields: {sorted(unknown)}")
        return cls(**d)
