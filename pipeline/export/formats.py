"""What each export format is: its config.json, its exact tensor names and shapes, and how its serving
framework numbers the auxiliary (low/mid/high) target layers. Every rule here comes from the loader code named
in docs/export.md; eaglet's own layer ids are input-to-layer indices (docs/design.md).

    sglang   SGLang LlamaForCausalLMEagle3 (also what vLLM loads under that architecture name)
    vllm     vLLM speculators Eagle3Speculator (transformer_layer_config + speculators_config)
    eagle1   the official EAGLE-1 layout (LlamaForCausalLM, fc on cat(embedding, feature), layers.0)
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pipeline.train.heads.config import DraftHeadConfig

SGLANG, VLLM, EAGLE1 = "sglang", "vllm", "eagle1"
FORMATS = (SGLANG, VLLM, EAGLE1)
FORMAT_KIND = {SGLANG: "eagle3", VLLM: "eagle3", EAGLE1: "eagle1"}
SGLANG_CONVENTIONS = ("output", "input")

SGLANG_ARCH = "LlamaForCausalLMEagle3"
VLLM_ARCH = "Eagle3Speculator"
EAGLE1_ARCH = "LlamaForCausalLM"

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
# config.json spelling of a dtype, and safetensors' header spelling of each tensor dtype eaglet writes.
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32"}
INDEX_DTYPES = {"d2t": "I64", "t2d": "BOOL"}


class ExportError(RuntimeError):
    pass


def default_format(kind: str) -> str:
    return SGLANG if kind == "eagle3" else EAGLE1


def resolve_format(fmt: Optional[str], kind: str) -> str:
    fmt = fmt or default_format(kind)
    if fmt not in FORMATS:
        raise ExportError(f"export.format={fmt!r}: choose one of {', '.join(FORMATS)}")
    if FORMAT_KIND[fmt] != kind:
        allowed = [f for f in FORMATS if FORMAT_KIND[f] == kind]
        raise ExportError(f"export.format={fmt} holds {FORMAT_KIND[fmt]} heads, but this head is {kind}: "
                          f"use {' or '.join(allowed)}")
    return fmt


def check_convention(convention: str) -> None:
    if convention not in SGLANG_CONVENTIONS:
        raise ExportError(f"export.sglang_aux_convention={convention!r}: choose output or input")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ExportError(f"export.dtype={name!r}: choose bfloat16 or float32")
    return DTYPES[name]


# ---------------------------------------------------------------------------------------------------------
# auxiliary layers


def default_aux_layers(num_layers: int) -> list[int]:
    """The layers SGLang and vLLM capture when the draft config names none (input-to-layer ids)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(layer_ids: Sequence[int], num_layers: int) -> None:
    """Servable aux layers: three distinct inputs of real decoder layers. Both frameworks capture the residual
    stream *entering* a layer, once per layer, so an id of num_layers (past the last layer) or a repeated id
    would give the head fewer or other states than it was trained on."""
    ids = list(layer_ids)
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ExportError(f"aux layers {ids}: EAGLE-3 serving needs 3 distinct target layers")
    if not all(0 <= i < num_layers for i in ids):
        raise ExportError(f"aux layers {ids}: ids must be decoder-layer inputs 0..{num_layers - 1} "
                          f"(the target has {num_layers} layers)")


def sglang_aux_ids(layer_ids: Sequence[int], convention: str = "output") -> list[int]:
    """eaglet ids (ascending input indices) -> SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`.

    SGLang's capture loop records the residual entering layer i when i is in `layers_to_capture`, always in
    ascending layer order, so the list order is free. Historic SGLang sets layers_to_capture = ids + 1 (ids are
    layer outputs); since PR #25454 it adds 1 only when ids[0] == 1 and otherwise takes ids as inputs. Written
    in output numbering with the id 1 (= input of layer 2) first, both rules capture the same layers; without
    layer 2 no list satisfies both, and `convention` picks the SGLang generation to target."""
    check_convention(convention)
    if convention == "output" or 2 in layer_ids:
        ids = [i - 1 for i in layer_ids]
        return sorted(ids, key=lambda i: i != 1)  # stable: 1 first, the rest ascending
    return sorted(layer_ids, key=lambda i: i == 1)  # input numbering must not start with 1


def sglang_captured_layers(ids: Sequence[int], after_pr_25454: bool) -> list[int]:
    """The input-to-layer ids SGLang captures for a config's id list (ascending, as its loop records them)."""
    shift = not after_pr_25454 or ids[0] == 1
    return sorted(i + 1 if shift else i for i in ids)


def sglang_layers_agree(ids: Sequence[int]) -> bool:
    """Whether SGLang before and after PR #25454 capture the same layers for this id list."""
    return sglang_captured_layers(ids, False) == sglang_captured_layers(ids, True)


def vllm_aux_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` are input indices (LlamaModel.forward captures
    hidden_states + residual before running layer idx), i.e. eaglet's own numbering."""
    return list(layer_ids)


def aux_order(layer_ids: Sequence[int]) -> list[int]:
    """Permutation sorting the aux ids: frameworks hand the head its states in ascending layer order, so a
    head trained on another order is exported with its fc column blocks permuted to match."""
    return sorted(range(len(layer_ids)), key=lambda k: layer_ids[k])


# ---------------------------------------------------------------------------------------------------------
# tensors


def expected_tensors(fmt: str, c: DraftHeadConfig) -> dict[str, tuple[int, ...]]:
    """The exact tensor set of a format: name -> shape. Anything else in the file is an error (loaders skip
    unknown names silently, and a missing one stays at its random initialization)."""
    h, v, vd = c.hidden_size, c.vocab_size, c.draft_vocab_size
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size

    def decoder_layer(prefix: str, attn_in: int, norms: Sequence[str]) -> dict[str, tuple[int, ...]]:
        t = {f"{prefix}self_attn.q_proj.weight": (q, attn_in), f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
             f"{prefix}self_attn.v_proj.weight": (kv, attn_in), f"{prefix}self_attn.o_proj.weight": (h, q),
             f"{prefix}mlp.gate_proj.weight": (inter, h), f"{prefix}mlp.up_proj.weight": (inter, h),
             f"{prefix}mlp.down_proj.weight": (h, inter)}
        t.update({f"{prefix}{norm}.weight": (h,) for norm in norms})
        return t

    eagle3_norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    eagle3_rest = {"fc.weight": (h, 3 * c.target_hidden_size), "norm.weight": (h,), "lm_head.weight": (vd, h),
                   "d2t": (vd,), "t2d": (v,)}
    if fmt == SGLANG:  # the target's embedding is shared at load (SGLang set_embed), never stored
        return {**decoder_layer("midlayer.", 2 * h, eagle3_norms), **eagle3_rest}
    if fmt == VLLM:
        return {**decoder_layer("layers.0.", 2 * h, eagle3_norms), **eagle3_rest, "embed_tokens.weight": (v, h)}
    if fmt == EAGLE1:  # layer 0 has no input_layernorm; logits come from the target's lm_head
        t = {**decoder_layer("layers.0.", h, ("post_attention_layernorm",)), "fc.weight": (h, 2 * h),
             "embed_tokens.weight": (v, h)}
        if c.fc_bias:
            t["fc.bias"] = (h,)
        return t
    raise ExportError(f"unknown format {fmt!r}")


def export_name(fmt: str, head_name: str) -> Optional[str]:
    """eaglet head state_dict name -> the format's name (None: not stored in this format)."""
    if fmt == SGLANG:
        return None if head_name == "embed_tokens.weight" else head_name
    if fmt == VLLM:
        return "layers.0." + head_name[len("midlayer."):] if head_name.startswith("midlayer.") else head_name
    # EAGLE-1: lm_head is the target's; d2t/t2d are the identity (draft vocabulary = target vocabulary).
    return None if head_name in ("lm_head.weight", "d2t", "t2d") else head_name


def head_name(fmt: str, name: str) -> str:
    """Inverse of export_name."""
    if fmt == VLLM and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


# ---------------------------------------------------------------------------------------------------------
# config.json


def _llama_fields(c: DraftHeadConfig) -> dict[str, Any]:
    """The one-layer Llama description every loader builds the draft layer from. RoPE is written both the
    transformers-4 way (rope_theta, rope_scaling) and the transformers-5 way (rope_parameters), with the theta
    the head was trained with (not the target's). No `bias` key: vLLM's Llama layers read it as attention bias."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def sglang_config(c: DraftHeadConfig, dtype: torch.dtype, num_target_layers: int,
                  convention: str = "output") -> dict[str, Any]:
    cfg = {"architectures": [SGLANG_ARCH], **_llama_fields(c), "draft_vocab_size": c.draft_vocab_size,
           "target_hidden_size": c.target_hidden_size, "torch_dtype": DTYPE_NAMES[dtype]}
    # Default layers: say nothing, so SGLang (and vLLM, which also loads this architecture) use their
    # default [2, L//2, L-3] -- the same inputs -- with no numbering to get wrong.
    if list(c.aux_layer_ids) != default_aux_layers(num_target_layers):
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids(c.aux_layer_ids, convention),
                               "use_aux_hidden_state": True}
    return cfg


def vllm_config(c: DraftHeadConfig, dtype: torch.dtype, verifier: str, verifier_architectures: Sequence[str],
                speculative_tokens: int) -> dict[str, Any]:
    layer = {"architectures": [EAGLE1_ARCH], **_llama_fields(c), "torch_dtype": DTYPE_NAMES[dtype]}
    return {
        "architectures": [VLLM_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        # vLLM's speculators adapter defaults this to True; the official EAGLE-3 layer keeps the residual
        # un-normalized (eaglet's too), so it must be written.
        "norm_before_residual": False,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(c.aux_layer_ids),
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def eagle1_config(c: DraftHeadConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {"architectures": [EAGLE1_ARCH], **_llama_fields(c), "torch_dtype": DTYPE_NAMES[dtype]}


def detect_format(cfg: dict) -> str:
    if cfg.get("speculators_model_type") == "eagle3":
        return VLLM
    arch = (cfg.get("architectures") or [None])[0]
    if arch == SGLANG_ARCH:
        return SGLANG
    if arch == EAGLE1_ARCH and "draft_vocab_size" not in cfg:
        return EAGLE1
    raise ExportError(f"not an eaglet export format: architectures={cfg.get('architectures')}")


def layer_fields(cfg: dict, fmt: str) -> dict:
    return cfg["transformer_layer_config"] if fmt == VLLM else cfg


def head_config(cfg: dict, fmt: str, num_target_layers: int, fc_bias: bool = False,
                sglang_convention: str = "output") -> DraftHeadConfig:
    """Rebuild the DraftHeadConfig an export was written from (aux ids back in eaglet numbering)."""
    t = layer_fields(cfg, fmt)
    vocab = t["vocab_size"]
    common = dict(hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
                  num_key_value_heads=t["num_key_value_heads"],
                  head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                  intermediate_size=t["intermediate_size"], rms_norm_eps=t["rms_norm_eps"],
                  rope_theta=float((t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))),
                  max_position_embeddings=t["max_position_embeddings"], vocab_size=vocab,
                  hidden_act=t.get("hidden_act", "silu"))
    if fmt == EAGLE1:
        return DraftHeadConfig(kind="eagle1", draft_vocab_size=vocab, target_hidden_size=t["hidden_size"],
                               aux_layer_ids=[], fc_bias=fc_bias, **common)
    if fmt == VLLM:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_target_layers)
    else:
        written = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = (sglang_captured_layers(written, after_pr_25454=sglang_convention == "input") if written
               else default_aux_layers(num_target_layers))
    return DraftHeadConfig(kind="eagle3", draft_vocab_size=cfg["draft_vocab_size"],
                           target_hidden_size=cfg.get("target_hidden_size") or t["hidden_size"],
                           aux_layer_ids=sorted(ids), **common)


def config_problems(cfg: dict, fmt: str) -> list[str]:
    """Fields the loaders read, checked on a written config.json (empty list: fine)."""
    problems = []

    def want(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    t = cfg.get("transformer_layer_config") if fmt == VLLM else cfg
    if not isinstance(t, dict):
        return ["transformer_layer_config missing"]
    want(t.get("model_type") == "llama", "model_type must be llama")
    want(t.get("num_hidden_layers") == 1, "num_hidden_layers must be 1")
    want(t.get("tie_word_embeddings") is False, "tie_word_embeddings must be false (SGLang would tie lm_head)")
    want(not t.get("bias") and not t.get("attention_bias"), "no bias/attention_bias (the heads have none)")
    if fmt == SGLANG:
        want(cfg.get("architectures") == [SGLANG_ARCH], f"architectures must be [{SGLANG_ARCH}]")
        want(isinstance(cfg.get("draft_vocab_size"), int), "draft_vocab_size missing (SGLang would use the target "
                                                           "lm_head)")
        want(isinstance(cfg.get("target_hidden_size"), int), "target_hidden_size missing")
        want("eagle_aux_hidden_state_layer_ids" not in cfg,
             "top-level eagle_aux_hidden_state_layer_ids: vLLM would read SGLang's numbering as its own")
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        want(ids is None or len(set(ids)) == 3, "eagle_config must name 3 distinct aux layers")
    elif fmt == VLLM:
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        want(cfg.get("architectures") == [VLLM_ARCH], f"architectures must be [{VLLM_ARCH}]")
        want(spec.get("algorithm") == "eagle3", "speculators_config.algorithm must be eagle3")
        want(isinstance(methods[0].get("speculative_tokens"), int) and methods[0]["speculative_tokens"] >= 1,
             "proposal_methods[0].speculative_tokens must be a positive int")
        want(spec.get("default_proposal_method") == methods[0].get("proposal_type"),
             "default_proposal_method must name proposal_methods[0]")
        want(bool((spec.get("verifier") or {}).get("name_or_path")), "verifier.name_or_path missing")
        want(cfg.get("norm_before_residual") is False, "norm_before_residual must be false (vLLM defaults to true)")
        want(isinstance(cfg.get("draft_vocab_size"), int), "draft_vocab_size missing")
        want(isinstance(cfg.get("target_hidden_size"), int), "target_hidden_size missing")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        want(isinstance(ids, list) and len(set(ids)) == 3, "eagle_aux_hidden_state_layer_ids must name 3 layers")
    else:
        want(cfg.get("architectures") == [EAGLE1_ARCH], f"architectures must be [{EAGLE1_ARCH}]")
    return problems
