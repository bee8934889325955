"""What to train (`HeadConfig`, the Hydra `head` group) and the architecture of a built head
(`DraftHeadConfig`, Hugging Face field names: the export writes it to config.json)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

from pipeline.choices import Choice
from pipeline.files import check_name

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


# A head option that is part of the architecture: it goes into the head's DraftHeadConfig (config.json) under
# the same name; the other options only shape training (the kind's objective reads them).
ARCHITECTURE = {"architecture": True}


@dataclass
class HeadConfig:
    """What to train, the Hydra `head` group. Each kind subclasses it with its own typed options, in the kind's
    file (Eagle3HeadConfig in eagle3.py, ...) registered as `HeadSpec.options_class`; `conf/head/<kind>.yaml`
    selects it, so an option of another kind (`head=eagle1 head.ttt_steps=3`) fails at compose, naming the
    kind's class. A bare HeadConfig is only the schema's placeholder until the group picks a kind."""
    kind: str = "eagle3"  # a registered kind (pipeline/heads/registry.py): eagle3 | eagle1 | medusa
    name: str = "eagle3"  # output folder name: outputs/<experiment>/train/<name>

    def __post_init__(self) -> None:
        options = head_spec(self.kind).options_class  # an unknown kind fails, naming the registered ones
        check_name(self.name, "head.name")  # a folder: outputs/<experiment>/{train,export,eval}/<name>
        if type(self) not in (HeadConfig, options):
            raise ValueError(f"head.kind={self.kind} takes the options of {options.__name__}, not "
                             f"{type(self).__name__}: select the kind with head={self.kind}")

    def architecture_options(self) -> dict:
        """The options that are DraftHeadConfig fields (marked ARCHITECTURE), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("architecture")}


def head_config(kind: str = "eagle3", **options) -> HeadConfig:
    """The typed options of a head of `kind`; an option the kind does not have fails, naming the kind."""
    cls = head_spec(kind).options_class
    known = {f.name for f in fields(cls)} - {"kind"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"head kind {kind} has no option {', '.join(unknown)} "
                         f"(its options: {', '.join(sorted(known))})")
    return cls(kind=kind, **{"name": kind, **options})


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
        max_position_embeddings: Optional[int] = None,
        **options,
    ) -> "DraftHeadConfig":
        """Dimensions from the target's HF config; `options` are the kind's architecture options
        (`HeadConfig.architecture_options()`: rope_theta, fc_bias, fc_norm, ...). `aux_layer_ids=None` takes
        `default_aux_layer_ids` for a head that fuses target layers; `draft_vocab_size=None` means the full
        target vocabulary."""
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
            max_position_embeddings=max_position_embeddings or t.max_position_embeddings,
            vocab_size=vocab,
            draft_vocab_size=vocab if draft_vocab_size is None else draft_vocab_size,
            target_hidden_size=t.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            hidden_act=getattr(t, "hidden_act", "silu"),
            **options,
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
