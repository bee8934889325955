"""Hydra schema of the export stage (see pipeline/export/run.py and docs/export.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.choices import Choice


class ExportDtype(Choice):
    bfloat16 = "bfloat16"
    float32 = "float32"


class SglangAuxConvention(Choice):
    output = "output"  # layer outputs (input index - 1): SGLang's historic rule
    input = "input"  # input indices: SGLang after PR #25454 (unless the first id is 1)


@dataclass
class ExportConfig:
    # A registered format (pipeline/export/formats/): sglang | vllm | eagle1. None: the head kind's default
    # (sglang for eagle3, eagle1 for eagle1).
    format: Optional[str] = None
    dtype: ExportDtype = ExportDtype.bfloat16
    verify: bool = False  # print the tensor table and the round-trip logit difference
    verifier: Optional[str] = None  # vllm speculators_config verifier; None: target.hub_id
    # vLLM speculators `proposal_methods[0].speculative_tokens`, also the printed vLLM command's value.
    speculative_tokens: int = 3
    # How SGLang reads custom `eagle_config.eagle_aux_hidden_state_layer_ids` (docs/export.md). Only matters
    # when the aux layers are custom and exclude layer 2; otherwise eaglet writes ids that every SGLang
    # version reads the same way.
    sglang_aux_convention: SglangAuxConvention = SglangAuxConvention.output

    def __post_init__(self) -> None:
        from pipeline.export.formats import export_format

        if self.format is not None:
            export_format(self.format)  # an unknown format fails when the config is built, listing the known
        self.dtype = ExportDtype.parse(self.dtype, "export.dtype")
        self.sglang_aux_convention = SglangAuxConvention.parse(self.sglang_aux_convention,
                                                               "export.sglang_aux_convention")
