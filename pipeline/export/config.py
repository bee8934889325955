"""Hydra schema of the export stage (see pipeline/export/run.py and docs/export.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.choices import Choice
from pipeline.export.formats.sglang import SGLangExportOptions


class ExportDtype(Choice):
    bfloat16 = "bfloat16"
    float32 = "float32"


@dataclass
class ExportConfig:
    # A registered format (pipeline/export/formats/): sglang | vllm | eagle1 | gguf. None: the head kind's default
    # (sglang for eagle3, eagle1 for eagle1).
    format: Optional[str] = None
    dtype: ExportDtype = ExportDtype.bfloat16
    verify: bool = False  # print the tensor table and the round-trip logit difference
    verifier: Optional[str] = None  # vllm speculators_config verifier; None: target.hub_id
    # vLLM speculators `proposal_methods[0].speculative_tokens`, also the printed vLLM command's value.
    speculative_tokens: int = 3
    # Each format's own settings, in the format's file.
    sglang: SGLangExportOptions = field(default_factory=SGLangExportOptions)
    # Moved to `export.sglang.aux_convention`; kept only to name the new key when an old override sets it.
    sglang_aux_convention: Optional[str] = None

    def __post_init__(self) -> None:
        from pipeline.export.formats import export_format

        if self.format is not None:
            export_format(self.format)  # an unknown format fails when the config is built, listing the known
        self.dtype = ExportDtype.parse(self.dtype, "export.dtype")
        if self.sglang_aux_convention is not None:
            raise ValueError("export.sglang_aux_convention is now export.sglang.aux_convention (the sglang format's "
                             "own settings)")
