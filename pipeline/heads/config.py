"""What to train (`HeadConfig`, the Hydra `head` group) and the architecture of a built head
(`DraftHeadConfig`, Hugging Face field names: the export writes it to config.json)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

from pipeline.choices import Choice

from .registry import head_spec


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high features, as input-to-layer ids: the inputs of layers 2, L//2 and L-3 --
    what SGLang and vLLM capture when a draft config names no layers (docs/design.md)."""
    return [2, num_layers // 2, num_layers - 3]


class LmHeadInit(Choice):
    random = "random"  # as the official EAGLE-3 trainer
    target = "target"  # the target's lm_head rows of the draft vocabulary and its final norm
    # The target's lm_head rows, the norm left at 1: copying the target's final norm too (mean weight 1.8 on
    # SmolLM2) scales a still-random out_hidden's logits up, which is what made "target" learn slowly.
    target_rows = "target_rows"


@dataclass
class HeadConfig:
    kind: str = "eagle3"  # a registered kind (pipeline/heads/registry.py): eagle3 | eagle1
    name: str = "eagle3"  # output folder name: outputs/<experiment>/train/<name>
    draft_vocab_size: int = 32000  # heads with a draft vocabulary (eagle3); capped at the distinct tokens seen
    ttt_steps: int = 7  # eagle3 training-time-test rounds
    ttt_decay: float = 0.8  # weight of round i is decay**i
    # eagle3: "random" as the official EAGLE-3 trainer; "target" starts lm_head/norm as the target's
    # (draft-vocab rows, final norm; as speculators does for lm_head), "target_rows" the lm_head rows only.
    # On the SmolLM2 quality dump "target" was worse (val round-0 accuracy 0.144 against 0.203 at step 50,
    # docs/results/quality.md), hence the default.
    lm_head_init: LmHeadInit = LmHeadInit.random
    rope_theta: float = 10000.0
    fc_bias: bool = False  # eagle1
    # EAGLE-3.1 (eagle3): an RMSNorm on each fused target state before fc, and the final norm's output (not the
    # pre-norm state) fed back as the next step's hidden. Config keys `fc_norm` / `norm_output` in both export
    # dialects, as vLLM, SGLang and speculators read them.
    fc_norm: bool = False
    norm_output: bool = False
    # medusa: K heads (head i predicts the token i + 2 ahead), each with L residual blocks; ttt_decay weighs
    # head i's loss by decay**i (Medusa-1's 0.8).
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    feature_loss_weight: float = 1.0  # eagle1
    token_loss_weight: float = 0.1  # eagle1
    feature_noise: float = 0.2  # eagle1: uniform noise scale on input features

    def __post_init__(self) -> None:
        head_spec(self.kind)  # an unknown kind fails when the config is built, naming the registered ones
        self.lm_head_init = LmHeadInit.parse(self.lm_head_init, "head.lm_head_init")


@dataclass
class DraftHeadConfig:
    kind: str = "eagle3"  # a registered head kind
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
    fc_norm: bool = False  # eagle3: EAGLE-3.1's per-layer RMSNorm on the fused states (fc_norm.{i})
    norm_output: bool = False  # eagle3: EAGLE-3.1's post-norm state fed back across draft steps
    medusa_num_heads: int = 4  # medusa (the Medusa repo's config names)
    medusa_num_layers: int = 1

    def __post_init__(self) -> None:
        spec = head_spec(self.kind)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.hidden_act != "silu":
            raise ValueError("only hidden_act='silu' (SwiGLU, as in the official heads) is supported")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if len(self.aux_layer_ids) != spec.num_aux_layers:
            raise ValueError(f"{self.kind} fuses exactly {spec.num_aux_layers} target layers, got "
                             f"aux_layer_ids={self.aux_layer_ids}")
        if spec.full_vocab and self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"{self.kind} predicts over the full target vocabulary: draft_vocab_size == vocab_size")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size cannot exceed the target vocab_size")
        if (self.fc_norm or self.norm_output) and not spec.fuses_target_layers:
            raise ValueError(f"fc_norm and norm_output are EAGLE-3.1 options of heads that fuse target layers, "
                             f"not of {self.kind}")

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
        fc_norm: bool = False,
        norm_output: bool = False,
        medusa_num_heads: int = 4,
        medusa_num_layers: int = 1,
    ) -> "DraftHeadConfig":
        """Dimensions from the target's HF config. `aux_layer_ids=None` takes `default_aux_layer_ids` for a
        head that fuses target layers; `draft_vocab_size=None` means the full target vocabulary."""
        t = target_hf_config
        heads = t.num_attention_heads
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // heads
        vocab = t.vocab_size
        spec = head_spec(kind)
        if spec.full_vocab:
            draft_vocab_size = vocab
        if spec.num_aux_layers == 0:
            aux_layer_ids = []
        elif aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(t.num_hidden_layers)
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
            fc_norm=fc_norm,
            norm_output=norm_output,
            medusa_num_heads=medusa_num_heads,
            medusa_num_layers=medusa_num_layers,
        )

    def to_dict(self) -> dict:
        """The fields, less the options a head does not use (EAGLE-3.1's when off, Medusa's on other kinds): a
        plain head's config.json, and the checkpoint identity resumes compare, stay as they were before those
        options existed; `from_dict` fills them back with their defaults."""
        d = asdict(self)
        for key in ("fc_norm", "norm_output"):
            if not d[key]:
                del d[key]
        if self.kind != "medusa":
            del d["medusa_num_heads"], d["medusa_num_layers"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftHeadConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DraftHeadConfig fields: {sorted(unknown)}")
        return cls(**d)


def build_draft_head(config: DraftHeadConfig):
    """A fresh head of `config.kind` (an nn.Module; weights random, frozen target copies and vocabulary set by
    the caller)."""
    return head_spec(config.kind).head_class(config)
