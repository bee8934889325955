"""The pieces every export format is made of: each holds its head's transformer layer as a one-layer Llama, so
the config fields, their checks, the layer's tensors and vLLM's serving command are written once, here."""
from __future__ import annotations

from typing import Any, Sequence

from pipeline.heads.config import DraftHeadConfig


def llama_fields(c: DraftHeadConfig) -> dict[str, Any]:
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


def llama_config_fields(t: dict) -> dict[str, Any]:
    """DraftHeadConfig fields from the one-layer Llama description (the inverse of `llama_fields`)."""
    return dict(hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
                num_key_value_heads=t["num_key_value_heads"],
                head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                intermediate_size=t["intermediate_size"], rms_norm_eps=t["rms_norm_eps"],
                rope_theta=float((t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))),
                max_position_embeddings=t["max_position_embeddings"], vocab_size=t["vocab_size"],
                hidden_act=t.get("hidden_act", "silu"))


def llama_problems(t: Any) -> list[str]:
    """Checks of the one-layer Llama description every format carries."""
    if not isinstance(t, dict):
        return ["transformer_layer_config missing"]
    rules = [(t.get("model_type") == "llama", "model_type must be llama"),
             (t.get("num_hidden_layers") == 1, "num_hidden_layers must be 1"),
             (t.get("tie_word_embeddings") is False, "tie_word_embeddings must be false (SGLang would tie lm_head)"),
             (not t.get("bias") and not t.get("attention_bias"), "no bias/attention_bias (the heads have none)")]
    return [what for ok, what in rules if not ok]


def decoder_layer_tensors(prefix: str, c: DraftHeadConfig, attn_in: int, norms: Sequence[str]
                          ) -> dict[str, tuple[int, ...]]:
    h, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    t = {f"{prefix}self_attn.q_proj.weight": (q, attn_in), f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
         f"{prefix}self_attn.v_proj.weight": (kv, attn_in), f"{prefix}self_attn.o_proj.weight": (h, q),
         f"{prefix}mlp.gate_proj.weight": (inter, h), f"{prefix}mlp.up_proj.weight": (inter, h),
         f"{prefix}mlp.down_proj.weight": (h, inter)}
    t.update({f"{prefix}{norm}.weight": (h,) for norm in norms})
    return t


def vllm_command(verifier: str, path: str, method: str, speculative_tokens: int) -> str:
    import json
    import shlex

    spec = {"model": path, "method": method, "num_speculative_tokens": speculative_tokens}
    return f"vllm serve {shlex.quote(verifier)} --speculative-config {shlex.quote(json.dumps(spec))}"
