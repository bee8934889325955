"""`vllm`: vLLM's speculators Eagle3Speculator (transformer_layer_config + speculators_config).

The decoder layer is `layers.0.*` (eaglet's `midlayer.*`), and the embedding is stored."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeline.heads.config import DraftHeadConfig, default_aux_layer_ids

from .base import DTYPE_NAMES, ExportContext, ExportError, ExportFormat, register_format
from .llama import decoder_layer_tensors, llama_config_fields, llama_fields, vllm_command
from .sglang import EAGLE3_NORMS, eagle3_rest, eagle31_fields, read_eagle31_fields


class VLLMSpeculatorsEagle3(ExportFormat):
    name, kind, architecture = "vllm", "eagle3", "Eagle3Speculator"

    def to_format(self, head_name: str) -> str:
        return "layers.0." + head_name[len("midlayer."):] if head_name.startswith("midlayer.") else head_name

    def from_format(self, name: str) -> str:
        return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name

    def expected_tensors(self, c: DraftHeadConfig) -> dict[str, tuple[int, ...]]:
        return {**decoder_layer_tensors("layers.0.", c, 2 * c.hidden_size, EAGLE3_NORMS), **eagle3_rest(c),
                "embed_tokens.weight": (c.vocab_size, c.hidden_size)}

    def write_config(self, c: DraftHeadConfig, dtype: torch.dtype, ctx: ExportContext) -> dict[str, Any]:
        if not ctx.verifier:
            raise ExportError("the vllm format names its verifier: set export.verifier or target.hub_id")
        layer = {"architectures": ["LlamaForCausalLM"], **llama_fields(c), "torch_dtype": DTYPE_NAMES[dtype]}
        return {
            "architectures": [self.architecture],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": ctx.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": ctx.verifier, "architectures": list(ctx.verifier_architectures)},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": c.draft_vocab_size,
            # vLLM's speculators adapter defaults this to True; the official EAGLE-3 layer keeps the residual
            # un-normalized (eaglet's too), so it must be written.
            "norm_before_residual": False,
            "target_hidden_size": c.target_hidden_size,
            # vLLM's ids are input indices (LlamaModel.forward captures hidden_states + residual before running
            # layer idx): eaglet's own numbering.
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
            # speculators' --fc-norm / --norm-output write these top-level keys, which vLLM's speculators
            # adapter carries into the draft config (norm_output since vLLM PR #46488).
            **eagle31_fields(c),
            "torch_dtype": DTYPE_NAMES[dtype],
        }

    def detects(self, cfg: dict) -> bool:
        return cfg.get("speculators_model_type") == "eagle3"

    def layer_fields(self, cfg: dict) -> dict:
        return cfg.get("transformer_layer_config")

    def read_config(self, cfg: dict, num_target_layers: int, fc_bias: bool = False,
                    sglang_convention: str = "output") -> DraftHeadConfig:
        t = self.layer_fields(cfg)
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(num_target_layers)
        return DraftHeadConfig(kind="eagle3", draft_vocab_size=cfg["draft_vocab_size"],
                               target_hidden_size=cfg.get("target_hidden_size") or t["hidden_size"],
                               aux_layer_ids=sorted(ids), **read_eagle31_fields(cfg), **llama_config_fields(t))

    def loader_aux_layers(self, cfg: dict, num_target_layers: int) -> list[tuple[str, list[int], bool]]:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(num_target_layers)
        return [("vLLM", sorted(ids), True)]

    def config_problems(self, cfg: dict) -> list[str]:
        problems = super().config_problems(cfg)
        if problems and problems[0] == "transformer_layer_config missing":
            return problems
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        rules = [
            (cfg.get("architectures") == [self.architecture], f"architectures must be [{self.architecture}]"),
            (spec.get("algorithm") == "eagle3", "speculators_config.algorithm must be eagle3"),
            (isinstance(methods[0].get("speculative_tokens"), int) and methods[0]["speculative_tokens"] >= 1,
             "proposal_methods[0].speculative_tokens must be a positive int"),
            (spec.get("default_proposal_method") == methods[0].get("proposal_type"),
             "default_proposal_method must name proposal_methods[0]"),
            (bool((spec.get("verifier") or {}).get("name_or_path")), "verifier.name_or_path missing"),
            (cfg.get("norm_before_residual") is False, "norm_before_residual must be false (vLLM defaults to true)"),
            (isinstance(cfg.get("draft_vocab_size"), int), "draft_vocab_size missing"),
            (isinstance(cfg.get("target_hidden_size"), int), "target_hidden_size missing"),
            (isinstance(ids, list) and len(set(ids)) == 3, "eagle_aux_hidden_state_layer_ids must name 3 layers")]
        return problems + [what for ok, what in rules if not ok]

    def serve_commands(self, path: str, layer_ids: Sequence[int], ctx: ExportContext) -> list[str]:
        return [f"serve with vLLM:   {vllm_command(ctx.verifier, path, 'eagle3', ctx.speculative_tokens)}",
                "serve with SGLang: re-export with export.format=sglang"]


register_format(VLLMSpeculatorsEagle3())
