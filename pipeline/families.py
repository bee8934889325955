"""Target families: what eaglet needs to know of a model architecture, one record per HF `model_type`.

Everything that depends on the family asks `family_of(config)` instead of testing model-type names or probing
the config: the tree decoder (which attention masks a layer takes, whether logits may be computed row by row),
the tensor-parallel loader (whether transformers has a plan for it) and the tests (the tiny model of each
family checks its record against the real transformers class: tests/test_families.py). Adding a family is one
`register_family(Family(...))` here plus its tiny test model in tests/support/families.py.

A model type without a record still loads, trains and dumps; eval then reads its attention kinds from the
config as HF writes them (`layer_types`, else one `sliding_window` for every layer) and takes the slower,
always-exact full-logits path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.choices import Choice


class Attention(Choice):
    """Where a family's config says each decoder layer's attention kind."""
    full = "full"  # every layer attends to the whole prefix (Llama)
    window = "window"  # one `sliding_window` for every layer when set (Mistral v0.1, Mixtral, Phi-3)
    layer_types = "layer_types"  # per layer, `config.layer_types` (Qwen 2/3 and Gemma 2/3 mix kinds)


class FinalNorm(Choice):
    rms = "rms"  # weight * x_hat (Llama's RMSNorm)
    rms_one_plus = "rms_one_plus"  # (1 + weight) * x_hat (Gemma's)


@dataclass(frozen=True)
class ChatFormat:
    """The turn-format quirks a family's template has (the template itself is the target's own)."""
    system_role: bool = True  # False: the system text is folded into the first user turn (Gemma, Mistral)
    assistant_header: bool = True  # False: the answer follows the user turn's close directly (Mistral [INST])


@dataclass(frozen=True)
class Family:
    model_type: str  # HF `config.model_type`
    attention: Attention
    final_norm: FinalNorm = FinalNorm.rms
    # logits == lm_head(final norm state) exactly: no softcapping and no logit scale, so the tree decoder may
    # score one row at a time (decoding's RowLogits).
    plain_logits: bool = True
    embed_scale: bool = False  # the input embeddings are multiplied by sqrt(hidden_size) (Gemma)
    tied_embeddings: bool = False  # the family's default `tie_word_embeddings` (a checkpoint may differ)
    tensor_parallel: bool = True  # transformers has a tensor-parallel plan (`tp_plan="auto"`) for it
    chat: ChatFormat = ChatFormat()


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if FAMILIES.get(family.model_type, family) != family:
        raise ValueError(f"target family {family.model_type!r} is registered twice")
    FAMILIES[family.model_type] = family
    return family


_NO_SYSTEM_NO_HEADER = ChatFormat(system_role=False, assistant_header=False)
for _family in (
    Family("llama", Attention.full),
    Family("mistral", Attention.window, chat=_NO_SYSTEM_NO_HEADER),
    Family("mixtral", Attention.window, chat=_NO_SYSTEM_NO_HEADER),
    Family("phi3", Attention.window),
    Family("qwen2", Attention.layer_types),
    Family("qwen3", Attention.layer_types),
    Family("qwen3_moe", Attention.window),
    Family("gemma3_text", Attention.layer_types, FinalNorm.rms_one_plus, plain_logits=False, embed_scale=True,
           tied_embeddings=True, chat=ChatFormat(system_role=False)),
    Family("gemma2", Attention.layer_types, FinalNorm.rms_one_plus, plain_logits=False, embed_scale=True,
           tied_embeddings=True, chat=ChatFormat(system_role=False)),
):
    register_family(_family)


def family_of(config: Any) -> Family:
    """The record of a (text) model config's family; a model type without one gets `unknown_family`."""
    text = getattr(config, "get_text_config", lambda: config)()
    return FAMILIES.get(text.model_type) or unknown_family(text)


def unknown_family(config: Any) -> Family:
    """What eaglet assumes of an unregistered family: its config's own attention fields, the exact full-logits
    path, and tensor parallelism where transformers declares a plan."""
    if getattr(config, "layer_types", None) is not None:
        attention = Attention.layer_types
    else:
        attention = Attention.window if hasattr(config, "sliding_window") else Attention.full
    return Family(config.model_type, attention, plain_logits=False,
                  tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                  tensor_parallel=bool(getattr(config, "base_model_tp_plan", None)))


# Attention layer kinds (HF `config.layer_types`) the tree decoder's masks can express.
MASKABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_layer_types(config: Any) -> list[str]:
    """Each decoder layer's attention kind: `config.layer_types` where the config lists them (HF's own per-layer
    word, whatever the record), else the family's rule (one window for every layer, or none). Refuses kinds a
    tree mask cannot express (linear or chunked attention, recurrent layers), naming them."""
    config = getattr(config, "get_text_config", lambda: config)()
    if getattr(config, "layer_types", None) is not None:
        types = list(config.layer_types)
    else:
        slides = family_of(config).attention == Attention.window and getattr(config, "sliding_window", None)
        types = ["sliding_attention" if slides else "full_attention"] * config.num_hidden_layers
    other = sorted(set(types) - set(MASKABLE_LAYER_TYPES))
    if other:
        raise NotImplementedError(
            f"{config.model_type}: layers of kind {other} cannot be verified with a tree attention mask (eaglet's "
            f"tree decoder supports {list(MASKABLE_LAYER_TYPES)}); this target can be trained on but not evaluated")
    return types
