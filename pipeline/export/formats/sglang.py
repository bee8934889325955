"""`sglang`: SGLang's LlamaForCausalLMEagle3 (also what vLLM loads under that architecture name).

Tensors are the eaglet EAGLE-3 head's own names (midlayer.*, fc, norm, lm_head, d2t, t2d); the embedding is
the target's, shared at load (SGLang `set_embed`), never stored."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from pipeline.choices import Choice
from pipeline.heads.config import DraftHeadConfig, default_aux_layer_ids

from .base import DTYPE_NAMES, ExportContext, ExportFormat, register_format
from .llama import decoder_layer_tensors, llama_config_fields, llama_fields, vllm_command

log = logging.getLogger(__name__)


class SglangAuxConvention(Choice):
    output = "output"  # layer outputs (input index - 1): SGLang's historic rule
    input = "input"  # input indices: SGLang after PR #25454 (unless the first id is 1)


@dataclass
class SGLangExportOptions:
    """The sglang format's own settings (`export.sglang`)."""
    # How SGLang reads custom `eagle_config.eagle_aux_hidden_state_layer_ids` (docs/export.md). Only matters
    # when the aux layers are custom and exclude layer 2; otherwise eaglet writes ids that every SGLang
    # version reads the same way.
    aux_convention: SglangAuxConvention = SglangAuxConvention.output

    def __post_init__(self) -> None:
        self.aux_convention = SglangAuxConvention.parse(self.aux_convention, "export.sglang.aux_convention")

EAGLE3_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
CONVENTIONS = ("output", "input")
# The SGLang generation each convention targets: how SGLang's loader is named where its reading is reported.
SGLANG_RULES = {"output": "SGLang before PR #25454", "input": "SGLang with PR #25454"}


def sglang_aux_ids(layer_ids: Sequence[int], convention: str = "output") -> list[int]:
    """eaglet ids (ascending input indices) -> SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`.

    SGLang's capture loop records the residual entering layer i when i is in `layers_to_capture`, always in
    ascending layer order, so the list order is free. Historic SGLang sets layers_to_capture = ids + 1 (ids are
    layer outputs); since PR #25454 it adds 1 only when ids[0] == 1 and otherwise takes ids as inputs. Written
    in output numbering with the id 1 (= input of layer 2) first, both rules capture the same layers; without
    layer 2 no list satisfies both, and `convention` picks the SGLang generation to target."""
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


def eagle3_rest(c: DraftHeadConfig) -> dict[str, tuple[int, ...]]:
    """The EAGLE-3 tensors outside the decoder layer (shared with the vllm format), with EAGLE-3.1's per-state
    norms `fc_norm.{i}` (vLLM's and SGLang's module names) when the head has them."""
    h, v, vd = c.hidden_size, c.vocab_size, c.draft_vocab_size
    fc_norm = {f"fc_norm.{i}.weight": (c.target_hidden_size,) for i in range(3)} if c.fc_norm else {}
    return {**fc_norm, "fc.weight": (h, 3 * c.target_hidden_size), "norm.weight": (h,), "lm_head.weight": (vd, h),
            "d2t": (vd,), "t2d": (v,)}


def eagle31_fields(c: DraftHeadConfig) -> dict[str, bool]:
    """EAGLE-3.1's config keys, written only when on: an EAGLE-3 export stays as it was. vLLM's and SGLang's
    llama_eagle3 read both at the top level of config.json (`getattr(config, "fc_norm" / "norm_output")`)."""
    return {k: True for k in ("fc_norm", "norm_output") if getattr(c, k)}


def read_eagle31_fields(cfg: dict) -> dict[str, bool]:
    return {k: bool(cfg.get(k, False)) for k in ("fc_norm", "norm_output")}


class SGLangEagle3(ExportFormat):
    name, kind, architecture = "sglang", "eagle3", "LlamaForCausalLMEagle3"
    default = True
    from_target = frozenset({"embed_tokens.weight"})

    def expected_tensors(self, c: DraftHeadConfig) -> dict[str, tuple[int, ...]]:
        return {**decoder_layer_tensors("midlayer.", c, 2 * c.hidden_size, EAGLE3_NORMS), **eagle3_rest(c)}

    def fill_from_target(self, head: nn.Module, model: nn.Module) -> None:
        head.copy_target_embeddings(model.get_input_embeddings().weight)

    def write_config(self, c: DraftHeadConfig, dtype: torch.dtype, ctx: ExportContext) -> dict[str, Any]:
        cfg = {"architectures": [self.architecture], **llama_fields(c), "draft_vocab_size": c.draft_vocab_size,
               "target_hidden_size": c.target_hidden_size, **eagle31_fields(c), "torch_dtype": DTYPE_NAMES[dtype]}
        # Default layers: say nothing, so SGLang (and vLLM, which also loads this architecture) use their
        # default [2, L//2, L-3] -- the same inputs -- with no numbering to get wrong.
        if list(c.aux_layer_ids) != default_aux_layer_ids(ctx.num_target_layers):
            cfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids":
                                   sglang_aux_ids(c.aux_layer_ids, ctx.sglang_aux_convention)}
        return cfg

    def read_config(self, cfg: dict, num_target_layers: int, fc_bias: bool = False,
                    sglang_convention: str = "output") -> DraftHeadConfig:
        written = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = (sglang_captured_layers(written, after_pr_25454=sglang_convention == "input") if written
               else default_aux_layer_ids(num_target_layers))
        return DraftHeadConfig(kind="eagle3", draft_vocab_size=cfg["draft_vocab_size"],
                               target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
                               aux_layer_ids=sorted(ids), **read_eagle31_fields(cfg), **llama_config_fields(cfg))

    def config_problems(self, cfg: dict) -> list[str]:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        rules = [
            (cfg.get("architectures") == [self.architecture], f"architectures must be [{self.architecture}]"),
            (isinstance(cfg.get("draft_vocab_size"), int), "draft_vocab_size missing (SGLang would use the target "
                                                           "lm_head)"),
            (isinstance(cfg.get("target_hidden_size"), int), "target_hidden_size missing"),
            ("eagle_aux_hidden_state_layer_ids" not in cfg,
             "top-level eagle_aux_hidden_state_layer_ids: vLLM would read SGLang's numbering as its own"),
            (ids is None or len(set(ids)) == 3, "eagle_config must name 3 distinct aux layers")]
        return super().config_problems(cfg) + [what for ok, what in rules if not ok]

    def loader_aux_layers(self, cfg: dict, num_target_layers: int) -> list[tuple[str, list[int], bool]]:
        written = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        default = default_aux_layer_ids(num_target_layers)
        sglang = ([(SGLANG_RULES[c], sglang_captured_layers(written, after_pr_25454=c == "input"), True)
                   for c in CONVENTIONS] if written else [("SGLang", default, True)])
        # vLLM maps this architecture to its EAGLE-3 Llama, which reads a top-level id list only (never
        # eagle_config): without one it captures its default layers.
        return sglang + [("vLLM", sorted(cfg.get("eagle_aux_hidden_state_layer_ids") or default), False)]

    def serve_commands(self, path: str, layer_ids: Sequence[int], ctx: ExportContext) -> list[str]:
        import shlex

        top_k, depth, total = ctx.tree.top_k, ctx.tree.depth, ctx.tree.total_tokens
        sglang = (f"python -m sglang.launch_server --model {shlex.quote(ctx.verifier)} --speculative-algorithm "
                  f"EAGLE3 --speculative-draft-model-path {shlex.quote(path)} --speculative-num-steps {depth} "
                  f"--speculative-eagle-topk {top_k} --speculative-num-draft-tokens {total}")
        # vLLM loads this architecture too; with no aux layers named, both capture the same default layers.
        # Custom layers are written in SGLang's numbering, which vLLM would read off by one.
        default = sorted(layer_ids) == default_aux_layer_ids(ctx.num_target_layers)
        vllm = (vllm_command(ctx.verifier, path, "eagle3", ctx.speculative_tokens) if default else
                "re-export with export.format=vllm (custom aux layers are numbered per framework)")
        return [f"serve with SGLang: {sglang}", f"serve with vLLM:   {vllm}"]

    def warn(self, layer_ids: Sequence[int], ctx: ExportContext) -> None:
        if sorted(layer_ids) == default_aux_layer_ids(ctx.num_target_layers):
            return
        convention = ctx.sglang_aux_convention
        ids = sglang_aux_ids(sorted(layer_ids), convention)
        if not sglang_layers_agree(ids):
            other = "input" if convention == "output" else "output"
            log.warning("aux layers %s without layer 2: SGLang before and after PR #25454 read eagle_config ids "
                        "%s differently; this export targets the %s rule (export.sglang.aux_convention=%s), "
                        "re-export with export.sglang.aux_convention=%s for the other SGLang", sorted(layer_ids),
                        ids, "historic" if convention == "output" else "post-#25454", convention, other)


register_format(SGLangEagle3())
