"""`eagle1`: the official EAGLE-1 layout (LlamaForCausalLM, fc on cat(embedding, feature), layers.0).

Layer 0 has no input_layernorm; logits come from the target's lm_head, so lm_head and the (identity)
vocabulary maps are not stored."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipeline.heads.config import DraftHeadConfig

from .base import DTYPE_NAMES, ExportContext, ExportFormat, register_format
from .llama import decoder_layer_tensors, llama_config_fields, llama_fields, vllm_command


class Eagle1Official(ExportFormat):
    name, kind, architecture = "eagle1", "eagle1", "LlamaForCausalLM"
    default = True
    from_target = frozenset({"lm_head.weight", "d2t", "t2d"})

    def expected_tensors(self, c: DraftHeadConfig) -> dict[str, tuple[int, ...]]:
        h = c.hidden_size
        t = {**decoder_layer_tensors("layers.0.", c, h, ("post_attention_layernorm",)), "fc.weight": (h, 2 * h),
             "embed_tokens.weight": (c.vocab_size, h)}
        if c.fc_bias:
            t["fc.bias"] = (h,)
        return t

    def fill_from_target(self, head: nn.Module, model: nn.Module) -> None:
        head.lm_head.weight.copy_(model.get_output_embeddings().weight)

    def write_config(self, c: DraftHeadConfig, dtype: torch.dtype, ctx: ExportContext) -> dict[str, Any]:
        return {"architectures": [self.architecture], **llama_fields(c), "torch_dtype": DTYPE_NAMES[dtype]}

    def detects(self, cfg: dict) -> bool:
        return super().detects(cfg) and "draft_vocab_size" not in cfg

    def read_config(self, cfg: dict, num_target_layers: int, fc_bias: bool = False,
                    sglang_convention: str = "output") -> DraftHeadConfig:
        return DraftHeadConfig(kind="eagle1", draft_vocab_size=cfg["vocab_size"], target_hidden_size=cfg["hidden_size"],
                               aux_layer_ids=[], fc_bias=fc_bias, **llama_config_fields(cfg))

    def config_problems(self, cfg: dict) -> list[str]:
        rules = [(cfg.get("architectures") == [self.architecture], f"architectures must be [{self.architecture}]")]
        return super().config_problems(cfg) + [what for ok, what in rules if not ok]

    def serve_commands(self, path: str, layer_ids: Sequence[int], ctx: ExportContext) -> list[str]:
        return [f"serve with vLLM:   {vllm_command(ctx.verifier, path, 'eagle', ctx.speculative_tokens)}",
                "serve with SGLang: not this layout (SGLang's EAGLE-2 loader wants LlamaForCausalLMEagle and an "
                "fc bias, see docs/export.md)"]


register_format(Eagle1Official())
